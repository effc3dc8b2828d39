"""One request from submission to its last output, as the endpoints see it.

start()    submit, then wait for the engine's verdict while watching the client:
           accepted -> a Generation;  rejected -> ApiError(status);  client gone -> abort, ClientDisconnected
outputs()  the outputs in order (ApiError if the stream ends in an error: the frontend is stopping, or the
           request timed out), each recorded in the metrics and in the usage, and stamped with
           streamed_time as it is handed to the client's stream (unless the client already set one:
           tests' scripted clients do)
collect()  all outputs (non-streaming), aborting if the client leaves first
close()    abort unless finished: every path out of an endpoint ends here
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

from starlette.types import Receive

from common.messages import GenerateRequest, RequestAccepted, RequestOutput, RequestRejected
from frontend.engine_client import REQUEST_TIMED_OUT, SERVER_STOPPING, EngineClient, RequestStream
from frontend.errors import ApiError
from frontend.metrics import FrontendMetrics
from frontend.streaming import unless_disconnected


class Generation:
    def __init__(self, stream: RequestStream, accepted: RequestAccepted, metrics: FrontendMetrics):
        self.stream = stream
        self.accepted = accepted
        self.metrics = metrics
        self.completion_tokens = 0
        self.num_cached_tokens = 0
        self.first_scheduled = accepted.times.first_scheduled
        self.finish_reason: str | None = None
        self._last_token_streamed: float | None = None

    @property
    def rid(self) -> int:
        return self.stream.rid

    @classmethod
    async def start(
        cls, client: EngineClient, request: GenerateRequest, metrics: FrontendMetrics, receive: Receive
    ) -> Generation:
        stream = await client.submit(request)
        try:
            first = await unless_disconnected(receive, stream.next_event())
        except BaseException:
            await asyncio.shield(stream.abort())
            raise
        if isinstance(first, RequestRejected):
            metrics.rejected(first.status)
            # A 504 is --request-timeout, before the verdict as after it; a 503 may be the queue limit here.
            code = first.code or (_ERROR_CODES[REQUEST_TIMED_OUT] if first.status == REQUEST_TIMED_OUT else None)
            raise ApiError(first.status, first.message, param=first.param, code=code)
        assert isinstance(first, RequestAccepted), f"an accepted or rejected verdict comes first, got {first!r}"
        metrics.accepted(first.prompt_tokens, first.times)
        return cls(stream, first, metrics)

    async def outputs(self) -> AsyncGenerator[RequestOutput, None]:
        async for event in self.stream:
            output = _output(event)
            output.streamed_time = output.streamed_time or time.time()  # handed to the client's stream now
            self._record(output)
            yield output

    async def output_batches(self) -> AsyncGenerator[list[RequestOutput], None]:
        """Outputs grouped by what had arrived when the previous group was written: one output per group
        while the client keeps up, several when it (or this process) falls behind, so the per-write cost
        is paid once per group rather than once per token. Metrics still see every output."""
        async for first in self.stream:
            events = [first, *self.stream.ready_events()]
            failed = events.pop() if isinstance(events[-1], RequestRejected) else None  # an error ends a stream
            handed = time.time()
            batch = [event if type(event) is RequestOutput else _output(event) for event in events]
            for output in batch:
                output.streamed_time = output.streamed_time or handed
                self._record(output)
            if batch:
                yield batch
            if failed is not None:
                _output(failed)

    def _record(self, output: RequestOutput) -> None:
        self.metrics.output(output, self.accepted.times, self._last_token_streamed)
        if output.token_ids:
            self._last_token_streamed = output.streamed_time
        if self.completion_tokens == 0 and output.first_scheduled:
            self.first_scheduled = output.first_scheduled
            self.num_cached_tokens = output.num_cached_tokens
        self.completion_tokens += len(output.token_ids)
        self.finish_reason = output.finish_reason

    async def collect(self, receive: Receive) -> list[RequestOutput]:
        async def all_outputs() -> list[RequestOutput]:
            return [output async for output in self.outputs()]

        try:
            return await unless_disconnected(receive, all_outputs())
        finally:
            await asyncio.shield(self.close())

    async def close(self) -> None:
        if not self.stream.finished:
            self.metrics.finished("abort")
            await self.stream.abort()

    def usage(self) -> dict:
        prompt = self.accepted.prompt_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }

    def stage_times(self) -> dict:
        times = self.accepted.times
        return {
            "arrival": times.arrival,
            "tokenized": times.tokenized,
            "queued": times.queued,
            "first_scheduled": self.first_scheduled,
        }


def _output(event: object) -> RequestOutput:
    if isinstance(event, RequestRejected):
        raise ApiError(
            event.status, event.message, param=event.param, code=event.code or _ERROR_CODES.get(event.status)
        )
    assert isinstance(event, RequestOutput), f"outputs follow the verdict, got {event!r}"
    return event


_ERROR_CODES = {SERVER_STOPPING: "server_stopping", REQUEST_TIMED_OUT: "request_timeout"}
