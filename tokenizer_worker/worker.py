"""What a tokenizer worker does with each message, sockets aside: the requests it owns and their text.

    GenerateRequest ──tokenize──▶ TokenizedRequest (to the scheduler)  or  RequestRejected (to the frontend)
                    (a long prompt: an EncodeJob for background_encoder.py, then finish_encoding)
    TokenBatch ──detokenize, stop strings, logprobs' token texts──▶ OutputBatch (a step's outputs, columnar)
                                                               (+ AbortRequest "stop" to the scheduler)
    TokenizeRequest / DetokenizeRequest ──▶ TextReply  or  RequestRejected (to the frontend; nothing kept)

A request is tracked from its tokenization until its last output, its rejection or its abort; tokens
that arrive for an untracked request (aborted, or stopped by a stop string while the scheduler was
already sampling its next token) are dropped.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from common.library_errors import library_message
from common.messages import (
    AbortRequest,
    DetokenizeRequest,
    GenerateRequest,
    Logprobs,
    OutputBatch,
    OutputExtras,
    RequestRejected,
    StageTimes,
    TextReply,
    TokenBatch,
    TokenizedRequest,
    TokenizeRequest,
)
from common.sampling_params import InvalidParameter, SamplingParams
from tokenizer_worker.background_encoder import EncodeJob
from tokenizer_worker.detokenizer import IncrementalDetokenizer
from tokenizer_worker.stop_strings import StopStringMatcher
from tokenizer_worker.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestState:
    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher
    num_prompt_tokens: int
    num_output_tokens: int = 0
    min_tokens: int = 0  # stop strings are not looked for before this many output tokens (as vLLM)
    # Whether the EOS or stop token id that ends the request shows in its text (as vLLM: only when asked).
    include_stop_token_text: bool = False
    sampling: SamplingParams | None = None  # its stop token ids name the stop_reason of an engine "stop"


class TokenizerWorker:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[int, RequestState] = {}
        self.encoding: dict[int, GenerateRequest] = {}  # long prompts being encoded off the loop

    def add_request(self, request: GenerateRequest) -> TokenizedRequest | RequestRejected | EncodeJob:
        """The tokenized request, its rejection, or for a long prompt the job of encoding it off the loop
        (finish_encoding() takes the ids)."""
        if request.rid in self.requests or request.rid in self.encoding:
            # Refused here: the scheduler's own refusal would come back and drop the live request's state.
            return RequestRejected(request.rid, 400, f"request id {request.rid} is already in use")
        try:  # sampling parameters were validated by the frontend; what needs the vocabulary is checked here
            request.sampling.check_token_ids(self.tokenizer.vocab_size)
            long_prompt = self.tokenizer.long_prompt_text(request)
            if long_prompt is not None:
                self.encoding[request.rid] = request
                return EncodeJob(request.rid, *long_prompt)
            ids = self.tokenizer.tokenize(request)
        except InvalidParameter as exc:
            return RequestRejected(request.rid, 400, str(exc), exc.field)
        return self._track(request, ids)

    def finish_encoding(self, rid: int, ids: list[int] | Exception) -> TokenizedRequest | RequestRejected | None:
        """A long prompt's ids (or its encode's failure); None: the request was aborted meanwhile."""
        request = self.encoding.pop(rid, None)
        if request is None:
            return None
        if isinstance(ids, Exception):
            return RequestRejected(rid, 400, f"the prompt cannot be tokenized: {library_message(ids)}", "prompt")
        return self._track(request, ids)

    def _track(self, request: GenerateRequest, ids: list[int]) -> TokenizedRequest:
        if request.truncate_prompt_tokens is not None:
            ids = ids[-request.truncate_prompt_tokens :]
        self.track(request.rid, request.sampling, len(ids))
        return TokenizedRequest(
            request.rid,
            ids,
            request.sampling,
            StageTimes(arrival=request.arrival_time, tokenized=time.time()),
            request.priority,
            request.cache_salt,
        )

    def track(self, rid: int, sampling: SamplingParams, num_prompt_tokens: int) -> None:
        """Make the text of request `rid`'s tokens from now on (process_tokens): the server's requests once
        tokenized, the offline engine's (offline/llm.py) as it adds them."""
        stop = StopStringMatcher(sampling.stop, sampling.include_stop_str_in_output)
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, sampling.skip_special_tokens, sampling.spaces_between_special_tokens
        )
        self.requests[rid] = RequestState(
            detokenizer,
            stop,
            num_prompt_tokens,
            min_tokens=sampling.min_tokens,
            include_stop_token_text=sampling.include_stop_str_in_output,
            sampling=sampling,
        )

    def answer_text_request(self, request: TokenizeRequest | DetokenizeRequest) -> TextReply | RequestRejected:
        """/tokenize and /detokenize: answered at once, nothing is kept."""
        try:
            if isinstance(request, DetokenizeRequest):
                ids = self.tokenizer.check_token_ids(request.token_ids) if request.token_ids else []
                return TextReply(request.rid, ids, self.tokenizer.decode(ids))
            if (request.prompt is None) == (request.chat_messages is None):
                raise InvalidParameter("prompt", "give exactly one of 'prompt' and 'messages'")
            if request.prompt is not None:
                ids = self.tokenizer.hf.encode(request.prompt, add_special_tokens=request.add_special_tokens)
            else:
                ids = self.tokenizer.render_chat(request.chat_messages, request.chat_options)
        except InvalidParameter as exc:
            return RequestRejected(request.rid, 400, str(exc), exc.field)
        return TextReply(request.rid, list(ids), "")

    def drop(self, rid: int) -> bool:
        """Forget a request (aborted by the client, or rejected by the scheduler); False if the scheduler does
        not hold it (never tokenized, still being encoded, or already ended)."""
        self.encoding.pop(rid, None)
        return self.requests.pop(rid, None) is not None

    def process_tokens(self, batch: TokenBatch) -> tuple[OutputBatch, list[AbortRequest]]:
        """The outputs of one step's tokens, and the aborts to send the scheduler for stop-string matches."""
        rids: list[int] = []
        texts: list[str] = []
        tokens: list[int] = []
        ended: dict[int, str] = {}
        extras: list[OutputExtras] = []
        aborts: list[AbortRequest] = []
        finish_reasons = batch.finish_reasons
        firsts = {first.rid: first for first in batch.firsts} if batch.firsts else None
        logprobs = {item.rid: item.logprobs for item in batch.logprobs} if batch.logprobs else None
        requests = self.requests
        for rid, token in zip(batch.rids, batch.token_ids):
            state = requests.get(rid)
            if state is None:
                continue
            state.num_output_tokens += 1
            engine_reason = finish_reasons.get(rid) if finish_reasons else None
            final = engine_reason is not None
            # The engine's "stop" is an EOS or stop token id sampled: its text is not the output's.
            text_ids = [] if engine_reason == "stop" and not state.include_stop_token_text else [token]
            delta = state.detokenizer.step(text_ids, final)
            if state.num_output_tokens < state.min_tokens:
                text, stopped = delta, False
            else:
                text, stopped = state.stop.feed(delta, final)
            rids.append(rid)
            texts.append(text)
            tokens.append(token)
            extra = None
            if stopped:
                ended[rid] = "stop"
                extra = OutputExtras(rid, stop_reason=state.stop.matched)
                if not final:
                    aborts.append(AbortRequest(rid, "stop"))  # the scheduler would go on generating
            elif final:
                ended[rid] = engine_reason
                if engine_reason == "stop" and state.sampling is not None:
                    extra = OutputExtras(rid, stop_reason=state.sampling.stop_reason_of(token))
            if rid in ended:
                del requests[rid]
                log.debug(
                    "request %d finished (%s): %d prompt tokens, %d output tokens",
                    rid,
                    ended[rid],
                    state.num_prompt_tokens,
                    state.num_output_tokens,
                )
            if firsts is not None and (first := firsts.get(rid)) is not None:
                extra = extra or OutputExtras(rid)
                extra.first_scheduled = first.first_scheduled
                extra.num_cached_tokens = first.num_cached_tokens
                extra.prompt_logprobs = self._with_texts(first.prompt_logprobs)
            if logprobs is not None and (own := logprobs.get(rid)) is not None:
                extra = extra or OutputExtras(rid)
                extra.logprobs = self._with_texts(own)
            if extra is not None:
                extras.append(extra)
        return OutputBatch(batch.sampled_time, time.time(), rids, texts, tokens, ended, extras), aborts

    def _with_texts(self, logprobs: Logprobs | None) -> Logprobs | None:
        if logprobs is not None:
            texts = self.tokenizer.token_texts
            logprobs.token_texts = texts(logprobs.token_ids)
            logprobs.top_texts = [texts(ids) for ids in logprobs.top_ids]
        return logprobs
