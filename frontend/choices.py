"""The generations behind one OpenAI response: one per (prompt, sample) pair, choice index
prompt_index * n + sample_index. One prompt and n=1 is the common case: a single generation.

start()     submit each request in turn, waiting for its verdict; the first refusal aborts the others
batches()   (choice index, outputs ready together), merged from every generation as they come
collect()   every choice's outputs (non-streaming), aborting all if the client leaves first
close()     abort what is unfinished: every path out of an endpoint ends here
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from starlette.types import Receive

from common.messages import GenerateRequest, RequestOutput
from frontend.engine_client import EngineClient
from frontend.generation import Generation
from frontend.metrics import FrontendMetrics
from frontend.streaming import unless_disconnected


class Choices:
    def __init__(self, generations: list[Generation], n: int):
        self.generations = generations
        self.n = n

    @classmethod
    async def start(
        cls, client: EngineClient, requests: list[GenerateRequest], n: int, metrics: FrontendMetrics, receive: Receive
    ) -> Choices:
        generations: list[Generation] = []
        try:
            # One after the other: a sample of a prompt already queued finds the prompt's full blocks in the
            # prefix cache once the first is prefilled (or shares the forward that fills them).
            for request in requests:
                generations.append(await Generation.start(client, request, metrics, receive))
        except BaseException:
            for generation in generations:
                await asyncio.shield(generation.close())
            raise
        return cls(generations, n)

    @property
    def rid(self) -> int:
        return self.generations[0].rid

    async def batches(self) -> AsyncGenerator[tuple[int, list[RequestOutput]], None]:
        if len(self.generations) == 1:
            async for batch in self.generations[0].output_batches():
                yield 0, batch
            return
        queue: asyncio.Queue[tuple[int, list[RequestOutput] | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, generation: Generation) -> None:
            try:
                async for batch in generation.output_batches():
                    queue.put_nowait((index, batch))
                queue.put_nowait((index, None))
            except BaseException as exc:  # handed to the reader, which re-raises it
                queue.put_nowait((index, exc))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self.generations)]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()

    async def collect(self, receive: Receive) -> list[list[RequestOutput]]:
        async def outputs(generation: Generation) -> list[RequestOutput]:
            return [output async for output in generation.outputs()]

        async def all_outputs() -> list[list[RequestOutput]]:
            return list(await asyncio.gather(*(outputs(g) for g in self.generations)))

        try:
            return await unless_disconnected(receive, all_outputs())
        finally:
            await asyncio.shield(self.close())

    async def close(self) -> None:
        for generation in self.generations:
            await generation.close()

    def usage(self) -> dict:
        # A prompt counts once however many samples it has (OpenAI's usage for n > 1).
        prompt = sum(g.accepted.prompt_tokens for g in self.generations[:: self.n])
        completion = sum(g.completion_tokens for g in self.generations)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(g.num_cached_tokens for g in self.generations[:: self.n])},
        }
