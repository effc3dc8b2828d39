"""The tokenizer worker: a real spawned process, driven over its real sockets by a test that plays both the
frontend and the scheduler; and the tokenizer's validation of the three prompt forms."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import zmq

from common.messages import (
    AbortRequest,
    ChatTemplateOptions,
    ControlReply,
    ControlRequest,
    DetokenizeRequest,
    FirstTokens,
    GenerateRequest,
    Logprobs,
    OutputBatch,
    ProcessReady,
    RequestAccepted,
    RequestLogprobs,
    RequestRejected,
    StageTimes,
    TextReply,
    TokenBatch,
    TokenizedRequest,
    TokenizeRequest,
)
from common.profiling import ProfileConfig
from common.sampling_params import InvalidParameter, SamplingParams
from common.transport import Endpoints, make_run_dir, pull_socket, push_socket, recv, send
from tests.tiny_models import build_tokenizer
from tokenizer_worker.background_encoder import EncodeJob
from tokenizer_worker.chat_template import ChatTemplateError, read_chat_template
from tokenizer_worker.process import main
from tokenizer_worker.tokenizer import LONG_PROMPT_CHARS, Tokenizer
from tokenizer_worker.worker import TokenizerWorker

STARTUP_S = 60.0  # spawning and importing transformers
REPLY_S = 10.0


def receive(sock: zmq.Socket, timeout_s: float = REPLY_S) -> Any:
    assert sock.poll(timeout_s * 1000), f"nothing received within {timeout_s}s"
    return recv(sock)


@dataclass
class Harness:
    """The worker's peers: what the test sends as frontend and scheduler, and where it reads replies."""

    process: multiprocessing.process.BaseProcess
    requests: zmq.Socket  # frontend -> worker
    tokens: zmq.Socket  # scheduler -> worker
    to_frontend: zmq.Socket  # worker -> frontend
    to_scheduler: zmq.Socket  # worker -> scheduler
    control: zmq.Socket
    control_replies: zmq.Socket
    tokenizer: Tokenizer
    other_replicas: list[zmq.Socket] = field(default_factory=list)  # replicas 1.. (to_scheduler is replica 0's)

    def submit(self, rid: int, sampling: SamplingParams | None = None, **prompt: Any) -> TokenizedRequest:
        send(self.requests, GenerateRequest(rid, sampling or SamplingParams(), 100.0, **prompt))
        tokenized = receive(self.to_scheduler)
        assert isinstance(tokenized, TokenizedRequest) and tokenized.rid == rid
        return tokenized

    def step(self, *entries: Sampled) -> OutputBatch:
        """One step's tokens sent as the scheduler sends them; the output batch the frontend gets."""
        batch = TokenBatch(200.0, [e.rid for e in entries], [e.token for e in entries])
        for e in entries:
            if e.finish_reason is not None:
                batch.finish_reasons[e.rid] = e.finish_reason
            if e.first is not None:
                batch.firsts.append(e.first)
            if e.logprobs is not None:
                batch.logprobs.append(RequestLogprobs(e.rid, e.logprobs))
        send(self.tokens, batch)
        return receive(self.to_frontend)


@contextmanager
def running_worker(model_folder: str, num_replicas: int = 1) -> Iterator[Harness]:
    run_dir = make_run_dir()
    endpoints = Endpoints(run_dir)
    ctx = zmq.Context()
    to_frontend = pull_socket(ctx, endpoints.frontend_outputs(0))
    to_scheduler = pull_socket(ctx, endpoints.scheduler_requests(0))
    other_replicas = [pull_socket(ctx, endpoints.scheduler_requests(r)) for r in range(1, num_replicas)]
    launcher = pull_socket(ctx, endpoints.launcher_ready)
    control_replies = pull_socket(ctx, endpoints.control_replies(ASKER))
    process = multiprocessing.get_context("spawn").Process(
        target=main,
        args=(0, model_folder, 1, run_dir, "warning", os.getpid(), ProfileConfig(), None, num_replicas),
        daemon=True,
    )
    process.start()
    try:
        assert receive(launcher, STARTUP_S) == ProcessReady("tokenizer-0", process.pid)
        yield Harness(
            process,
            push_socket(ctx, endpoints.tokenizer_requests(0)),
            push_socket(ctx, endpoints.tokenizer_tokens(0)),
            to_frontend,
            to_scheduler,
            push_socket(ctx, endpoints.control("tokenizer-0")),
            control_replies,
            Tokenizer.load(model_folder),
            other_replicas,
        )
    finally:
        process.kill()
        process.join()
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer(folder)
    return str(folder)


@pytest.fixture(scope="module")
def worker(model_folder) -> Iterator[Harness]:
    with running_worker(model_folder) as harness:
        yield harness


_rids = itertools.count(1)
ASKER = "test"  # the control requests' asker: replies come to control-replies-test


@pytest.fixture
def rid() -> int:
    return next(_rids)


@dataclass
class Sampled:
    """One request's token in a step's TokenBatch."""

    rid: int
    token: int
    finish_reason: str | None = None
    first: FirstTokens | None = None
    logprobs: Logprobs | None = None


def tokens(rid: int, token: int, finish_reason: str | None = None) -> Sampled:
    return Sampled(rid, token, finish_reason)


# ------------------------------------------------------------------ the process


def test_ping_is_answered_on_the_control_socket(worker):
    send(worker.control, ControlRequest("ping", seq=41, reply_to=ASKER))
    reply = receive(worker.control_replies)
    assert (reply.role, reply.pid, reply.kind, reply.seq) == ("tokenizer-0", worker.process.pid, "ping", 41)


def test_stats_count_requests_and_messages(worker, rid):
    worker.submit(rid, prompt="hello")
    send(worker.control, ControlRequest("stats", seq=42, reply_to=ASKER))
    reply: ControlReply = receive(worker.control_replies)
    assert reply.payload["requests"] >= 1
    assert reply.payload["messages_in"] >= 1 and reply.payload["bytes_out"] > 0


def test_a_prompt_is_tokenized_for_the_scheduler_with_its_stage_times(worker, rid):
    sampling = SamplingParams(max_tokens=5, stop=["x"])
    tokenized = worker.submit(rid, sampling, prompt="你好 🚀", priority=3)
    assert tokenized.prompt_token_ids == worker.tokenizer.hf.encode("你好 🚀")
    assert tokenized.sampling == sampling
    assert tokenized.priority == 3  # for the scheduler's queue (--scheduling-policy priority)
    assert tokenized.times.arrival == 100.0 and tokenized.times.tokenized > tokenized.times.arrival


def test_a_truncated_prompt_keeps_its_last_tokens(worker, rid):
    tokenized = worker.submit(rid, prompt_token_ids=[5, 6, 7, 8, 9], truncate_prompt_tokens=2)
    assert tokenized.prompt_token_ids == [8, 9]


def test_prompt_token_ids_are_passed_through(worker, rid):
    assert worker.submit(rid, prompt_token_ids=[5, 6, 7]).prompt_token_ids == [5, 6, 7]


def test_chat_messages_are_rendered_with_the_chat_template(worker, rid):
    messages = [{"role": "user", "content": "hello"}]
    tokenized = worker.submit(rid, chat_messages=messages)
    assert (
        worker.tokenizer.hf.decode(tokenized.prompt_token_ids)
        == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )


def test_acceptance_is_forwarded_to_the_frontend(worker, rid):
    worker.submit(rid, prompt="hi")
    accepted = RequestAccepted(rid, 1, StageTimes(1.0, 2.0, 3.0))
    send(worker.tokens, accepted)
    assert receive(worker.to_frontend) == accepted


def test_an_empty_prompt_is_rejected_to_the_frontend(worker, rid):
    send(worker.requests, GenerateRequest(rid, SamplingParams(), 100.0, prompt=""))
    rejected = receive(worker.to_frontend)
    assert isinstance(rejected, RequestRejected)
    assert (rejected.rid, rejected.status, rejected.param) == (rid, 400, "prompt")


def test_tokens_stream_back_as_text_one_output_batch_per_token_batch(worker, rid):
    worker.submit(rid, prompt="hi")
    ids = worker.tokenizer.hf.encode("天气很好 🚀✨")
    first = worker.step(Sampled(rid, ids[0], first=FirstTokens(rid, 150.0, 16)))
    assert (first.outputs()[0].first_scheduled, first.outputs()[0].num_cached_tokens) == (150.0, 16)
    outputs = [first.outputs()[0]]
    for i, token in enumerate(ids[1:], start=1):
        batch = worker.step(tokens(rid, token, "length" if i == len(ids) - 1 else None))
        assert [out.rid for out in batch.outputs()] == [rid]
        outputs.append(batch.outputs()[0])
    assert "".join(out.text for out in outputs) == "天气很好 🚀✨"
    assert [out.token_ids for out in outputs] == [[i] for i in ids]
    assert [out.finish_reason for out in outputs] == [None] * (len(ids) - 1) + ["length"]
    assert all(out.sampled_time == 200.0 and out.detokenized_time > 200.0 for out in outputs)


def test_a_stop_string_ends_the_request_and_aborts_it_at_the_scheduler(worker, rid):
    worker.submit(rid, SamplingParams(stop=["世界"]), prompt="hi")
    ids = worker.tokenizer.hf.encode("你好，世界。今天")
    outputs = []
    for token in ids:
        outputs += worker.step(tokens(rid, token)).outputs()
        if outputs[-1].finish_reason:
            break
    assert "".join(out.text for out in outputs) == "你好，"
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", "世界")  # vLLM's stop_reason
    assert receive(worker.to_scheduler) == AbortRequest(rid, "stop")
    # The scheduler may have sampled one more token before the abort reached it: it is dropped.
    other = next(_rids)
    worker.submit(other, prompt="hi")
    assert [out.rid for out in worker.step(tokens(rid, ids[0]), tokens(other, ids[0])).outputs()] == [other]


def test_a_client_abort_is_forwarded_and_later_tokens_are_dropped(worker, rid):
    worker.submit(rid, prompt="hi")
    send(worker.requests, AbortRequest(rid))
    assert receive(worker.to_scheduler) == AbortRequest(rid, "abort")
    other = next(_rids)
    worker.submit(other, prompt="hi")
    assert [out.rid for out in worker.step(tokens(rid, 5, "abort"), tokens(other, 5)).outputs()] == [other]


def test_a_scheduler_rejection_is_forwarded_and_the_request_forgotten(worker, rid):
    worker.submit(rid, prompt="hi")
    rejected = RequestRejected(rid, 503, "queue full")
    send(worker.tokens, rejected)
    assert receive(worker.to_frontend) == rejected
    other = next(_rids)
    worker.submit(other, prompt="hi")
    assert [out.rid for out in worker.step(tokens(rid, 5), tokens(other, 5)).outputs()] == [other]


def test_held_back_text_is_flushed_when_the_scheduler_finishes_the_request(worker, rid):
    worker.submit(rid, SamplingParams(stop=["world"]), prompt="hi")
    for token in worker.tokenizer.hf.encode("wor"):
        assert worker.step(tokens(rid, token)).outputs()[0].text == ""
    last = worker.step(tokens(rid, 0, "stop")).outputs()[0]  # EOS
    assert (last.text, last.finish_reason, last.stop_reason) == ("wor", "stop", None)


@pytest.mark.parametrize(
    "sampling, text",
    [
        (SamplingParams(), "hi there"),
        (SamplingParams(skip_special_tokens=False), "hi<|im_end|> there"),
        (SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True), "hi<|im_end|> there<|endoftext|>"),
    ],
    ids=["special-tokens-dropped", "shown-but-not-the-eos-that-ends-it", "the-eos-too-when-asked"],
)
def test_special_tokens_show_in_the_text_as_the_request_asks(worker, rid, sampling, text):
    worker.submit(rid, sampling, prompt="hi")
    hf = worker.tokenizer.hf
    ids = hf.encode("hi") + [hf.convert_tokens_to_ids("<|im_end|>")] + hf.encode(" there")
    outputs = [worker.step(tokens(rid, token)).outputs()[0] for token in ids]
    outputs.append(worker.step(tokens(rid, hf.eos_token_id, "stop")).outputs()[0])
    assert "".join(out.text for out in outputs) == text
    assert outputs[-1].token_ids == [hf.eos_token_id]


def test_a_stop_token_id_that_ends_a_request_is_not_in_its_text(worker, rid):
    # As vLLM: the token the engine stopped on (EOS or one of stop_token_ids) is the output's last token id,
    # and its text is left out unless include_stop_str_in_output.
    hf = worker.tokenizer.hf
    *body, stop = hf.encode("ok.")
    worker.submit(rid, SamplingParams(stop_token_ids=[stop]), prompt="hi")
    outputs = [worker.step(tokens(rid, token)).outputs()[0] for token in body]
    outputs.append(worker.step(tokens(rid, stop, "stop")).outputs()[0])
    assert "".join(out.text for out in outputs) == "ok"
    assert [out.token_ids for out in outputs][-1] == [stop]
    assert outputs[-1].stop_reason == stop  # vLLM's stop_reason: the stop token id


# ------------------------------------------------------------------ validation of the prompt forms


@pytest.fixture(scope="module")
def tokenizer(model_folder) -> Tokenizer:
    return Tokenizer.load(model_folder)


@pytest.mark.parametrize("ids", [[], [5, 512], [-1], [5, 2.0], [True]])
def test_prompt_token_ids_outside_the_vocabulary_are_refused(tokenizer, ids):
    with pytest.raises(InvalidParameter) as raised:
        tokenizer.tokenize(GenerateRequest(1, SamplingParams(), 0.0, prompt_token_ids=ids))
    assert raised.value.field == "prompt"


@pytest.mark.parametrize("messages", [[], [{"content": "no role"}], ["not a message"]])
def test_malformed_chat_messages_are_refused(tokenizer, messages):
    with pytest.raises(InvalidParameter) as raised:
        tokenizer.tokenize(GenerateRequest(1, SamplingParams(), 0.0, chat_messages=messages))
    assert raised.value.field == "messages"


def test_a_request_must_carry_exactly_one_prompt_form(tokenizer):
    with pytest.raises(InvalidParameter, match="exactly one"):
        tokenizer.tokenize(GenerateRequest(1, SamplingParams(), 0.0, prompt="a", prompt_token_ids=[5]))
    with pytest.raises(InvalidParameter, match="exactly one"):
        tokenizer.tokenize(GenerateRequest(1, SamplingParams(), 0.0))


def test_a_final_message_can_be_continued_and_the_template_gets_the_requests_variables(model_folder):
    tokenizer = Tokenizer.load(model_folder)
    started = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Sure, the"}]
    continued = tokenizer.render_chat(started, ChatTemplateOptions(False, True), tokenize=False)
    assert continued.endswith("<|im_start|>assistant\nSure, the")  # left open: the model writes on
    template = "{% if shout %}{{ messages[0].content | upper }}{% else %}{{ messages[0].content }}{% endif %}"
    custom = Tokenizer.load(model_folder, read_chat_template(template))
    assert custom.render_chat(started, ChatTemplateOptions(template_kwargs={"shout": True}), tokenize=False) == "HELLO"
    assert custom.render_chat(started, tokenize=False) == "hello"


def test_a_completion_prompt_may_go_without_the_tokenizers_special_tokens(model_folder):
    from tokenizers.processors import TemplateProcessing

    tokenizer = Tokenizer.load(model_folder)
    bos = tokenizer.hf.convert_tokens_to_ids("<|endoftext|>")
    tokenizer.hf.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    plain = tokenizer.hf.encode("hello there", add_special_tokens=False)

    def asking(text: str) -> list[GenerateRequest]:
        return [GenerateRequest(1, SamplingParams(), 0.0, prompt=text, add_special_tokens=a) for a in (True, False)]

    assert [tokenizer.tokenize(r) for r in asking("hello there")] == [[bos, *plain], plain]
    long_text = "hello there " * 400  # past LONG_PROMPT_CHARS: encoded off the loop, with the same choice
    assert [tokenizer.long_prompt_text(r) for r in asking(long_text)] == [(long_text, True), (long_text, False)]


def test_a_model_without_a_chat_template_refuses_messages(model_folder):
    bare = Tokenizer.load(model_folder)
    bare.hf.chat_template = None
    with pytest.raises(InvalidParameter, match="no chat template"):
        bare.render_chat([{"role": "user", "content": "hi"}])


def test_a_chat_template_given_at_start_renders_chat_requests_instead_of_the_tokenizers_own(model_folder):
    template = "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}{% endfor %}"
    custom = Tokenizer.load(model_folder, read_chat_template(template))
    messages = [{"role": "user", "content": "hi"}]
    assert custom.render_chat(messages) == custom.hf.encode("<<user>>hi", add_special_tokens=False)
    assert Tokenizer.load(model_folder).render_chat(messages) != custom.render_chat(messages)


def test_a_chat_template_is_read_from_a_file_or_taken_as_written(tmp_path):
    template = "{{ messages[0].content }}"
    (tmp_path / "t.jinja").write_text(template)
    assert read_chat_template(str(tmp_path / "t.jinja")) == template
    assert read_chat_template(template) == template
    with pytest.raises(ChatTemplateError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ChatTemplateError, match="not a valid Jinja template"):
        read_chat_template("{% for m in messages %}")


def test_tokenize_and_detokenize_are_answered_to_the_frontend_with_their_rid(worker, rid):
    ids = worker.tokenizer.hf.encode("hello world")
    send(worker.requests, TokenizeRequest(rid, prompt="hello world"))
    assert receive(worker.to_frontend) == TextReply(rid, ids, "")
    send(worker.requests, DetokenizeRequest(rid, ids))
    assert receive(worker.to_frontend) == TextReply(rid, ids, "hello world")
    send(worker.requests, DetokenizeRequest(rid, [10**6]))
    refused = receive(worker.to_frontend)
    assert isinstance(refused, RequestRejected) and refused.rid == rid and refused.status == 400


def test_logprobs_get_each_tokens_text(worker, rid):
    worker.submit(rid, prompt="hi")
    ids = worker.tokenizer.hf.encode("import json")
    item = Sampled(rid, ids[0], logprobs=Logprobs(0, ids[:1], [-0.5], [ids[:2]], [[-0.5, -1.0]]))
    [out] = worker.step(item).outputs()
    texts = [worker.tokenizer.hf.decode([i]) for i in ids[:2]]
    assert out.logprobs.token_texts == texts[:1] and out.logprobs.top_texts == [texts]


def test_stop_strings_wait_for_min_tokens(worker, rid):
    worker.submit(rid, SamplingParams(stop=["a"], min_tokens=2), prompt="hi")
    [a] = worker.tokenizer.hf.encode("a")
    assert worker.step(tokens(rid, a)).outputs()[0].text == "a", "one token out: not yet a stop"
    out = worker.step(tokens(rid, a)).outputs()[0]
    assert (out.text, out.finish_reason) == ("", "stop")


def test_logit_bias_outside_the_vocabulary_is_refused(worker, rid):
    send(worker.requests, GenerateRequest(rid, SamplingParams(logit_bias={10**6: 1.0}), 100.0, prompt="hi"))
    refused = receive(worker.to_frontend)
    assert isinstance(refused, RequestRejected) and refused.param == "logit_bias"


def test_more_logprobs_than_the_vocabulary_holds_are_refused(worker, rid):
    """Only a --max-logprobs above the vocabulary lets one through the frontend; the worker's top-k could not."""
    send(worker.requests, GenerateRequest(rid, SamplingParams(logprobs=10**6), 100.0, prompt="hi"))
    refused = receive(worker.to_frontend)
    assert isinstance(refused, RequestRejected) and refused.param == "logprobs"


def test_requests_are_spread_over_engine_replicas_and_each_abort_reaches_its_requests_replica(model_folder):
    with running_worker(model_folder, num_replicas=2) as harness:
        replicas = [harness.to_scheduler, *harness.other_replicas]
        for rid, replica in [(1, 0), (2, 1), (3, 0)]:  # least load, then index
            send(harness.requests, GenerateRequest(rid, SamplingParams(), 100.0, prompt=f"request {rid}"))
            assert receive(replicas[replica]).rid == rid
        send(harness.requests, AbortRequest(2))
        assert receive(replicas[1]) == AbortRequest(2)
        harness.step(tokens(1, 5, "length"))  # finished: replica 0 has one request left, replica 1 none
        send(harness.requests, GenerateRequest(4, SamplingParams(), 100.0, prompt="request 4"))
        assert receive(replicas[1]).rid == 4
        send(harness.requests, AbortRequest(3))
        assert receive(replicas[0]) == AbortRequest(3)
        assert not any(replica.poll(100) for replica in replicas)


# Last: it ends the module's worker (a start costs seconds of CPU: transformers and torch).
def test_a_long_prompt_does_not_hold_back_other_requests_tokens(worker, rid):
    """While the worker encodes a huge prompt (seconds), the tokens of a request it already streams are
    detokenized: their output reaches the frontend before the huge prompt reaches the scheduler."""
    while worker.to_scheduler.poll(0):  # what earlier tests left for the scheduler (their stop-string aborts)
        recv(worker.to_scheduler)
    worker.submit(rid, prompt="hi")
    huge = next(_rids)
    send(worker.requests, GenerateRequest(huge, SamplingParams(), 100.0, prompt=LONG_TEXT * 60))
    output = worker.step(tokens(rid, worker.tokenizer.hf.encode("ok")[0]))
    assert [out.rid for out in output.outputs()] == [rid]
    assert worker.to_scheduler.poll(0) == 0  # the huge prompt's encoding is still going on
    tokenized = receive(worker.to_scheduler, timeout_s=60.0)
    assert tokenized.rid == huge and tokenized.prompt_token_ids == worker.tokenizer.hf.encode(LONG_TEXT * 60)


def test_sigterm_stops_the_worker_cleanly(worker):
    worker.process.terminate()
    worker.process.join(REPLY_S)
    assert worker.process.exitcode == 0


# ------------------------------------------------------------------ long prompts, encoded off the loop

LONG_TEXT = " ".join(f"word{i % 97} 你好 {i}" for i in range(LONG_PROMPT_CHARS // 8))


def test_a_long_prompt_is_encoded_off_the_loop_to_the_same_ids(tokenizer):
    request = GenerateRequest(1, SamplingParams(), 0.0, prompt=LONG_TEXT)
    text, add_special_tokens = tokenizer.long_prompt_text(request)
    assert tokenizer.encode_releasing_gil(text, add_special_tokens) == tokenizer.tokenize(request)
    assert tokenizer.long_prompt_text(GenerateRequest(2, SamplingParams(), 0.0, prompt="short")) is None


def test_long_chat_messages_are_encoded_off_the_loop_to_the_same_ids(tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": LONG_TEXT}]
    request = GenerateRequest(1, SamplingParams(), 0.0, chat_messages=messages)
    text, add_special_tokens = tokenizer.long_prompt_text(request)
    assert tokenizer.encode_releasing_gil(text, add_special_tokens) == tokenizer.tokenize(request)


def test_a_request_aborted_while_its_prompt_is_encoded_is_forgotten(tokenizer):
    worker = TokenizerWorker(tokenizer)
    job = worker.add_request(GenerateRequest(7, SamplingParams(), 0.0, prompt=LONG_TEXT))
    assert isinstance(job, EncodeJob) and job.rid == 7
    assert isinstance(worker.add_request(GenerateRequest(7, SamplingParams(), 0.0, prompt="x")), RequestRejected)
    assert worker.drop(7) is False  # the scheduler never saw it: there is no abort to forward
    assert worker.finish_encoding(7, tokenizer.encode_releasing_gil(job.text, job.add_special_tokens)) is None
    assert worker.requests == {} and worker.encoding == {}
