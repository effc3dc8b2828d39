"""The generations behind one OpenAI response: one per (prompt, sample) pair, choice index
prompt_index * n + sample_index. One prompt and n=1 is the common case: a single generation.

start()     submit each request in turn (each prompt's first sample, then the others), waiting for its verdict;
            the first refusal, or prompts whose tokens times n pass the ceiling, abort the others
batches()   (choice index, outputs ready together), merged from every generation as they come
collect()   every choice's outputs (non-streaming), aborting all if the client leaves first
            (both: a prompt's samples share the prompt logprobs that its first sample alone asked for)
close()     abort what is unfinished: every path out of an endpoint ends here
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncGenerator
from dataclasses import replace

from starlette.types import Receive

from common.messages import GenerateRequest, Logprobs, RequestOutput
from frontend.engine_client import EngineClient
from frontend.errors import ApiError
from frontend.generation import Generation
from frontend.metrics import FrontendMetrics
from frontend.streaming import unless_disconnected


class Choices:
    def __init__(self, generations: list[Generation], n: int, prompt_logprobs: bool = False):
        """prompt_logprobs: the request asked for them (echo with logprobs); each prompt's first sample brings them."""
        self.generations = generations
        self.n = n
        self.shares_prompt_logprobs = prompt_logprobs and n > 1

    @classmethod
    async def start(
        cls,
        client: EngineClient,
        requests: list[GenerateRequest],
        n: int,
        metrics: FrontendMetrics,
        receive: Receive,
        max_prompt_tokens: int,
        prompt_field: str,
    ) -> Choices:
        """requests: one per choice, in choice order. max_prompt_tokens: the request's ceiling of prompt tokens
        times n (--max-request-prompt-tokens); beyond it a 400 names n, or prompt_field when even n=1 is beyond."""
        generations: list[Generation | None] = [None] * len(requests)
        try:
            # Each prompt's first sample, then the others, one after the other: a later sample finds the prompt's
            # full blocks in the prefix cache (planned before it arrived, or in the forward that fills them),
            # and leaves the prompt logprobs to the first, whose every sample shares them (batches, collect).
            prompt_tokens = 0
            for i in range(0, len(requests), n):
                first = generations[i] = await Generation.start(client, requests[i], metrics, receive)
                prompt_tokens += first.accepted.prompt_tokens
                _check_prompt_tokens(prompt_tokens, i + n < len(requests), n, max_prompt_tokens, prompt_field)
            for i, request in enumerate(requests):
                if i % n:
                    sample = replace(request, sampling=replace(request.sampling, prompt_logprobs=None))
                    generations[i] = await Generation.start(client, sample, metrics, receive)
        except BaseException:
            for generation in generations:
                if generation is not None:
                    await asyncio.shield(generation.close())
            raise
        return cls([g for g in generations if g is not None], n, requests[0].sampling.prompt_logprobs is not None)

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
        shared = SharedPromptLogprobs(self.n) if self.shares_prompt_logprobs else None
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                elif shared is None:
                    yield index, item
                else:
                    for ready in shared.release(index, item):
                        yield ready
        finally:
            for task in tasks:
                task.cancel()

    async def collect(self, receive: Receive) -> list[list[RequestOutput]]:
        async def outputs(generation: Generation) -> list[RequestOutput]:
            return [output async for output in generation.outputs()]

        async def all_outputs() -> list[list[RequestOutput]]:
            return list(await asyncio.gather(*(outputs(g) for g in self.generations)))

        try:
            collected = await unless_disconnected(receive, all_outputs())
        finally:
            await asyncio.shield(self.close())
        if self.shares_prompt_logprobs:
            for index, choice in enumerate(collected):
                first = collected[index - index % self.n]
                if index % self.n and choice and first:
                    choice[0].prompt_logprobs = first[0].prompt_logprobs
        return collected

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


def _check_prompt_tokens(prompt_tokens: int, more_prompts: bool, n: int, ceiling: int, prompt_field: str) -> None:
    """The prompts' tokens so far, once per sample, within the ceiling; else a 400 naming what to change: n where
    fewer samples of these prompts would fit, else the prompts."""
    if prompt_tokens * n <= ceiling:
        return
    has = f"the prompts have {'at least ' if more_prompts else ''}{prompt_tokens} tokens"
    limit = f"this server computes at most {ceiling} prompt tokens (each prompt's, times n) per request"
    hint = "--max-request-prompt-tokens"
    if prompt_tokens > ceiling:
        raise ApiError(400, f"{has}; {limit} ({hint})", param=prompt_field)
    fits = "" if more_prompts else f"; n={ceiling // prompt_tokens} would fit"
    raise ApiError(400, f"{has}, times n={n}; {limit} ({hint}){fits}", param="n")


class SharedPromptLogprobs:
    """A stream's later samples take their prompt logprobs from the first sample's first batch: their batches are
    held until it has come (it comes in the same step as theirs, or before, unless the first was preempted)."""

    def __init__(self, n: int):
        self.n = n
        self.logprobs: dict[int, Logprobs | None] = {}  # by the first sample's choice index: what its first batch had
        self.held: dict[int, list[tuple[int, list[RequestOutput]]]] = defaultdict(list)  # by the first sample's
        self.opened: set[int] = set()  # later samples whose first batch went out

    def release(self, index: int, batch: list[RequestOutput]) -> list[tuple[int, list[RequestOutput]]]:
        """The batches ready to go out now that `batch` of choice `index` has come, in order."""
        first = index - index % self.n
        if first not in self.logprobs:
            if index != first:
                self.held[first].append((index, batch))
                return []
            self.logprobs[first] = batch[0].prompt_logprobs
            return [(index, batch), *(self._opened(i, b) for i, b in self.held.pop(first, []))]
        return [(index, batch) if index == first else self._opened(index, batch)]

    def _opened(self, index: int, batch: list[RequestOutput]) -> tuple[int, list[RequestOutput]]:
        if index not in self.opened:
            self.opened.add(index)
            batch[0].prompt_logprobs = self.logprobs[index - index % self.n]
        return index, batch
