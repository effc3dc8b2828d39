"""Every message that crosses a process boundary, defined once.

    frontend --GenerateRequest/AbortRequest--> tokenizer_worker --TokenizedRequest/AbortRequest--> scheduler
    frontend <--RequestAccepted/Rejected, OutputBatch-- tokenizer_worker
                                               <--RequestAccepted/Rejected, TokenBatch-- scheduler
    scheduler --StepPlan--> gpu_worker --StepResult--> scheduler
    scheduler --CompileGrammar--> its compile worker --CompileWorkerReady, GrammarCompiled--> scheduler
    launcher/frontend --ControlRequest--> any process --ControlReply--> frontend
    any process --ProcessReady--> launcher             (a GPU worker: WorkerReady, with what it decided)

Stage times travel with the request (StageTimes) so every latency figure, in /metrics or in a benchmark,
is computed from the same stamps. Times are `time.time()` seconds: every process of one server shares the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.sampling_params import InvalidParameter, SamplingParams
from common.wire import message


@dataclass(slots=True)
class StageTimes:
    arrival: float = 0.0  # frontend received the HTTP request
    tokenized: float = 0.0  # tokenizer worker finished the prompt
    queued: float = 0.0  # scheduler put it in the waiting queue
    first_scheduled: float = 0.0  # scheduler first put it in a step plan


@dataclass(slots=True)
class Logprobs:
    """Log-probabilities of consecutive positions of one request: for each, the token there, its
    logprob, and the most likely tokens with theirs. The GPU worker fills the numbers; the tokenizer
    worker adds the texts (each token decoded alone, as OpenAI shows them)."""

    start: int  # position of the first token in the request's sequence (prompt, then outputs)
    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    token_texts: list[str] = field(default_factory=list)
    top_texts: list[list[str]] = field(default_factory=list)

    def extend(self, other: Logprobs) -> None:
        """Append the positions of `other` past this one's end (a chunk recomputed after a preemption
        repeats positions already here)."""
        skip = self.start + len(self.token_ids) - other.start
        if skip < 0:
            raise ValueError(f"logprobs of positions from {other.start} follow a gap after {self.start}")
        self.token_ids.extend(other.token_ids[skip:])
        self.logprobs.extend(other.logprobs[skip:])
        self.top_ids.extend(other.top_ids[skip:])
        self.top_logprobs.extend(other.top_logprobs[skip:])


@dataclass(slots=True)
class RequestLogprobs:
    rid: int
    logprobs: Logprobs


# ---------------------------------------------------------------- frontend -> tokenizer worker -> scheduler


# apply_chat_template's own parameters: a request's chat_template_kwargs may set the template's variables
# (enable_thinking, say), never these (a chat_template among them would be a template of the client's).
CHAT_TEMPLATE_RESERVED = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


@dataclass(slots=True)
class ChatTemplateOptions:
    """How chat messages are rendered (vLLM's chat request extensions): open the assistant's turn, or leave
    the last (assistant) message open to be continued; extra variables for the template."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict = field(default_factory=dict)
    tools: list[dict] | None = None  # OpenAI's function definitions, for templates that describe them


# vLLM's cache_salt: an opaque id (a tenant's, a user's) that heads a prefix-cache key, not data.
MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(salt: str | None) -> None:
    """A request's cache_salt is absent, or a non-empty string of at most MAX_CACHE_SALT_CHARS characters."""
    if salt is not None and not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise InvalidParameter(
            "cache_salt", f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters"
        )


@message(1)
@dataclass(slots=True)
class GenerateRequest:
    rid: int
    sampling: SamplingParams
    arrival_time: float
    prompt: str | None = None  # /v1/completions text
    prompt_token_ids: list[int] | None = None  # already tokenized prompt
    chat_messages: list[dict] | None = None  # /v1/chat/completions, rendered with the chat template
    chat_options: ChatTemplateOptions | None = None  # None: the defaults
    add_special_tokens: bool = True  # for a text prompt: the tokenizer's BOS and the like
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last this many tokens (vLLM's)
    priority: int = 0  # --scheduling-policy priority: lower first (vLLM's)
    # vLLM's: prefix-cache entries are shared only among requests with the same salt (None: the unsalted ones)
    cache_salt: str | None = None


@message(2)
@dataclass(slots=True)
class AbortRequest:
    """Stop a request: the client went away, or a stop string matched. Takes the request's own path."""

    rid: int
    reason: str = "abort"


@message(3)
@dataclass(slots=True)
class TokenizedRequest:
    rid: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    times: StageTimes
    priority: int = 0
    cache_salt: str | None = None


# ---------------------------------------------------------------- scheduler -> tokenizer worker -> frontend


@message(4)
@dataclass(slots=True)
class RequestAccepted:
    """The scheduler queued the request: from now on it streams tokens until a finish reason."""

    rid: int
    prompt_tokens: int
    times: StageTimes


@message(5)
@dataclass(slots=True)
class RequestRejected:
    """Refused before any token: `status` is the HTTP status the client gets, `param` the field at fault. Also
    how a stream ends in an error after it was accepted (its engine replica failed, the server stops); `code`:
    the error's code for the client where the status alone does not say it (None: the status's own)."""

    rid: int
    status: int
    message: str
    param: str | None = None
    code: str | None = None


@dataclass(slots=True)
class FirstTokens:
    """What a request's first sampled token carries, once."""

    rid: int
    first_scheduled: float
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    prompt_logprobs: Logprobs | None = None  # when it asked for prompt logprobs


@message(6)
@dataclass(slots=True)
class TokenBatch:
    """One step's new tokens: in the scheduler, of every request that sampled; on the way to a tokenizer worker,
    of the requests it owns. Entry i: request rids[i] sampled token_ids[i] (a request appears once).

    Columnar, because hundreds of requests sample each step: two lists of numbers cost microseconds to build,
    pack and unpack, where an object per request cost a microsecond or so at each of those. What only a few
    entries carry is apart, keyed by rid or holding its rid."""

    sampled_time: float  # when the GPU worker sampled these tokens
    rids: list[int]
    token_ids: list[int]
    finish_reasons: dict[int, str] = field(default_factory=dict)  # "stop" | "length": the requests that ended
    firsts: list[FirstTokens] = field(default_factory=list)  # the requests whose first token this is
    logprobs: list[RequestLogprobs] = field(default_factory=list)  # those of the tokens whose requests asked


@dataclass(slots=True)
class RequestOutput:
    """One output of one request as the frontend (and the offline engine) reads it: OutputBatch.outputs()."""

    rid: int
    text: str  # new text since the previous output of this request
    token_ids: list[int]
    sampled_time: float
    detokenized_time: float
    finish_reason: str | None = None
    first_scheduled: float = 0.0
    num_cached_tokens: int = 0
    streamed_time: float = 0.0  # set by the frontend when it hands the output to the client's stream
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    # With finish_reason "stop", vLLM's stop_reason: the stop string matched, or the stop token id sampled
    # (None: EOS, or a structured output complete).
    stop_reason: int | str | None = None


@dataclass(slots=True)
class OutputExtras:
    """What only a few of a step's outputs carry: a request's first (its scheduling facts, prompt logprobs), a stop
    that names its reason, logprobs asked for."""

    rid: int
    first_scheduled: float = 0.0
    num_cached_tokens: int = 0
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    stop_reason: int | str | None = None


@message(7)
@dataclass(slots=True)
class OutputBatch:
    """One step's outputs: in a tokenizer worker, of every request it owns that sampled; on the way to a frontend,
    of the requests that frontend holds. Entry i: request rids[i]'s token token_ids[i] made text texts[i] (a request
    appears once).

    Columnar, as TokenBatch and for the same reason: a step has hundreds of outputs, and an object per output cost
    a tokenizer worker and a frontend each about a microsecond and a half to encode or decode, where three lists
    cost a tenth of that. Times are the batch's: every output of a step was sampled together and detokenized in
    one pass. What only a few entries carry is apart (finish reasons keyed by rid, OutputExtras)."""

    sampled_time: float  # when the GPU worker sampled these tokens
    detokenized_time: float  # when the tokenizer worker had made their text
    rids: list[int]
    texts: list[str]
    token_ids: list[int]
    finish_reasons: dict[int, str] = field(default_factory=dict)  # "stop" | "length" | "abort": requests that ended
    extras: list[OutputExtras] = field(default_factory=list)

    def outputs(self) -> list[RequestOutput]:
        """The entries as RequestOutput objects, in batch order."""
        sampled, detokenized, reasons = self.sampled_time, self.detokenized_time, self.finish_reasons
        outputs = [
            RequestOutput(rid, text, [token], sampled, detokenized, reasons.get(rid) if reasons else None)
            for rid, text, token in zip(self.rids, self.texts, self.token_ids)
        ]
        if self.extras:
            by_rid = {output.rid: output for output in outputs}
            for extra in self.extras:
                output = by_rid[extra.rid]
                output.first_scheduled = extra.first_scheduled
                output.num_cached_tokens = extra.num_cached_tokens
                output.logprobs = extra.logprobs
                output.prompt_logprobs = extra.prompt_logprobs
                output.stop_reason = extra.stop_reason
        return outputs


# ---------------------------------------------------------------- frontend <-> tokenizer worker: /tokenize, /detokenize


@message(8)
@dataclass(slots=True)
class TokenizeRequest:
    """Text (or chat messages) to token ids, answered with a TextReply or a RequestRejected."""

    rid: int
    prompt: str | None = None
    chat_messages: list[dict] | None = None
    add_special_tokens: bool = True  # for a prompt: the tokenizer's BOS and the like
    chat_options: ChatTemplateOptions | None = None  # for messages: as a chat request renders them


@message(9)
@dataclass(slots=True)
class DetokenizeRequest:
    rid: int
    token_ids: list[int]


@message(12)
@dataclass(slots=True)
class TextReply:
    rid: int
    token_ids: list[int]
    text: str


# ---------------------------------------------------------------- scheduler <-> gpu worker


@dataclass(slots=True)
class NewRequestSpec:
    """Sent once, on a request's first plan (again after a preemption, with the tokens it had then)."""

    rid: int
    token_ids: list[int]  # prompt, plus the output so far when resumed after preemption
    sampling: SamplingParams
    num_sampled: int  # output tokens sampled before (seeds the sampler's per-token stream)


@dataclass(slots=True)
class ScheduledChunk:
    """One request's share of a forward, as an object: how tests and tools read a plan (`StepPlan.chunks`)
    and build one (`StepPlan.of`). The plan itself is columnar."""

    rid: int
    start: int
    num_tokens: int
    new_block_ids: list[int]  # appended to the worker's mirror of the block table
    sample: bool  # True when this chunk reaches the end of the known tokens
    # Structured output: the tokens its sample may take, int32 words (bit j of word i: token 32 i + j).
    token_bitmask: bytes | None = None


@message(10)
@dataclass(slots=True)
class StepPlan:
    """One forward. Entry i computes positions [starts[i], starts[i] + num_tokens[i]) of request rids[i] and,
    when samples[i] (the entry reaches the end of the known tokens), samples its next token.

    Columnar, because a step has hundreds of entries and this message is on every step's critical path
    (scheduler, then worker, before the step can launch): four lists of numbers pack, unpack and become the
    worker's numpy columns in microseconds, where an object per entry cost about a microsecond each to build,
    encode, decode and read back. What only a few entries carry is keyed by rid."""

    step_id: int
    new_requests: list[NewRequestSpec]
    rids: list[int]
    starts: list[int]
    num_tokens: list[int]
    samples: list[bool]
    released: list[int]  # finished, aborted or preempted rids: the worker drops their mirror
    new_block_ids: dict[int, list[int]] = field(default_factory=dict)  # appended to the worker's block table
    # Structured output: the tokens a sample may take, int32 words (bit j of word i: token 32 i + j).
    token_bitmasks: dict[int, bytes] = field(default_factory=dict)
    # --profile-steps: > 0 opens the worker's profiling window on this step, for this many steps (counted by
    # the worker, so the window stays on exactly those steps; scheduler/step_observer.py ProfileWindow).
    profile_steps: int = 0
    sent_time: float = 0.0  # when the scheduler sent it (time.time()): the worker times the plan's trip

    @classmethod
    def of(
        cls, step_id: int, new_requests: list[NewRequestSpec], chunks: list[ScheduledChunk], released: list[int]
    ) -> StepPlan:
        """A plan from per-request chunks (warm-up, tests)."""
        return cls(
            step_id,
            new_requests,
            [c.rid for c in chunks],
            [c.start for c in chunks],
            [c.num_tokens for c in chunks],
            [c.sample for c in chunks],
            released,
            {c.rid: c.new_block_ids for c in chunks if c.new_block_ids},
            {c.rid: c.token_bitmask for c in chunks if c.token_bitmask is not None},
        )

    @property
    def chunks(self) -> list[ScheduledChunk]:
        """The entries as objects, in plan order (for reading a plan, not for the step's hot path)."""
        return [
            ScheduledChunk(rid, start, n, self.new_block_ids.get(rid, []), sample, self.token_bitmasks.get(rid))
            for rid, start, n, sample in zip(self.rids, self.starts, self.num_tokens, self.samples)
        ]


@dataclass(slots=True)
class StepTimings:
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0  # finishing the step: waiting for the device, then reading the tokens back
    wait_s: float = 0.0  # the part of sample_s spent waiting for the device (host time is the rest)
    # The plan's trip: from the scheduler sending it to the worker taking it (the socket, and the worker busy
    # with another step meanwhile). Set by the worker process; 0 where no process sent it (in-process engine).
    plan_wait_s: float = 0.0


@message(11)
@dataclass(slots=True)
class StepResult:
    step_id: int
    rids: list[int]  # requests that sampled a token this step, in plan order
    token_ids: list[int]
    sampled_time: float
    timings: StepTimings
    # Only for requests that asked: logprobs of this step's samples, and of the prompt positions computed.
    logprobs: list[RequestLogprobs] = field(default_factory=list)
    prompt_logprobs: list[RequestLogprobs] = field(default_factory=list)


@message(13)
@dataclass(slots=True)
class LeaveGroup:
    """To a tensor-parallel rank, after the last plan, on the plans' own socket (so after every plan): leave
    the process group and exit. Every rank must leave together: NCCL's teardown waits for all of them, so
    rank 0 alone would wait forever for ranks that were simply killed. The in-process engine's close sends
    it; the server's ranks just exit with their processes."""

    reason: str = "closed"


# ---------------------------------------------------------------- grammars (scheduler/compile_worker.py)


@message(30)
@dataclass(slots=True)
class CompileWorkerReady:
    """The compile worker has its vocabulary: xgrammar's TokenizerInfo as its JSON, which the scheduler needs to
    compile grammars itself (and gives the next worker it starts, so that it need not prepare it again)."""

    tokenizer_info_json: str


@message(31)
@dataclass(slots=True)
class CompileGrammar:
    kind: str  # StructuredOutput's kind and spec
    spec: str


@message(32)
@dataclass(slots=True)
class GrammarCompiled:
    """The compile is over: it failed (`error`, in the user's terms), or the grammar compiles within the timeout
    (the scheduler then compiles it for itself: scheduler/compile_worker.py says why)."""

    error: str = ""


# ---------------------------------------------------------------- control


@message(20)
@dataclass(slots=True)
class ProcessReady:
    role: str
    pid: int


@dataclass(slots=True)
class WorkerLimits:
    """What a GPU worker allocated, and the limits it decided for its device where the flags left them open
    (gpu_worker/limits.py, the one place that fills in their defaults). The scheduler plans with them, the
    launcher and LLM report them, as they are."""

    num_kv_blocks: int  # blocks the scheduler hands out (the worker holds one more, its graphs' scratch block)
    max_num_seqs: int  # running requests: the decode batch
    max_num_batched_tokens: int  # prompt tokens computed per step (adaptive: at most)
    max_model_len: int  # the context: the model's (or --max-model-len), within what the KV store holds
    adaptive_prefill_budget: bool = False  # the scheduler sizes each step's prompt tokens to --target-itl-ms


@message(23)
@dataclass(slots=True)
class WorkerReady:
    """A GPU worker's READY (weights loaded, KV store allocated, warmed up). Rank 0 of an engine replica speaks
    for it; every rank of a tensor-parallel group has the same limits."""

    role: str
    pid: int
    device: str  # "cuda:0", "cpu"; "none" for --load-format null
    dtype: str
    limits: WorkerLimits


@message(21)
@dataclass(slots=True)
class ControlRequest:
    kind: str  # "ping" | "stats" (answered by the control thread) | "start_profile" | "stop_profile"
    seq: int = 0
    args: dict = field(default_factory=dict)
    reply_to: str = ""  # the asker whose control-replies-{asker} gets the answer; "": no answer wanted


@message(22)
@dataclass(slots=True)
class ControlReply:
    role: str
    pid: int
    kind: str
    seq: int
    payload: dict = field(default_factory=dict)
