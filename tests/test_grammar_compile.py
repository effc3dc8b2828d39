"""Structured output's grammars are compiled off the scheduler's loop, by its compile worker, on cycles serving leaves
idle: a request waits for its grammar in its own state (also while the vocabulary is still being prepared) while
everyone else runs; the bounds (--max-grammar-bytes, --grammar-compile-timeout in CPU time) refuse a grammar with a
400 naming its field, and a request's whole wait is bounded from its arrival (503 when the server was too busy); a
compile error says what is wrong in the user's terms."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest
from fastapi.testclient import TestClient

from common.config import EngineConfig
from common.messages import (
    CompileGrammar,
    GrammarCompiled,
    RequestAccepted,
    RequestRejected,
    StageTimes,
    StepPlan,
    StepResult,
    StepTimings,
    TokenizedRequest,
)
from common.model_info import ModelInfo
from common.sampling_params import SamplingParams, StructuredOutput
from common.wire import decode, encode
from frontend.app import build_app
from frontend.engine_client import EngineLimits
from gpu_worker.limits import decide_limits
from offline import LLM
from scheduler import compile_budget
from scheduler.compile_worker import CompileWorker
from scheduler.request import RequestStatus
from scheduler.scheduler import Scheduler
from scheduler.structured_output import compile_error_message
from tests.fake_engine import FakeEngineClient
from tests.server_process import ROOT, pid_alive, wait_until

WAIT_S = 300.0  # a deadline, not an expectation: compiles on a loaded 2-core machine take seconds


def many_choices(count: int) -> StructuredOutput:
    """A grammar no cache has seen, that takes seconds to compile (the issue's 8,000 choices)."""
    return StructuredOutput("choice", json.dumps([f"{time.time()} o{i}" for i in range(count)]), "guided_choice")


def make_scheduler(model, **config) -> Scheduler:
    engine, info = EngineConfig(model=str(model), **config), ModelInfo.from_folder(model, None)
    scheduler = Scheduler(engine, info, decide_limits(engine, info, on_gpu=False, num_kv_blocks=64))
    scheduler.grammars.start()
    return scheduler


@pytest.fixture(scope="module")
def scheduler(tiny_llama):
    # The 8,000-choice compile takes 8-17 s on a 2-core machine (more under load): past the default
    # --grammar-compile-timeout, which the timeout's own test checks. These tests wait for their compiles.
    scheduler = make_scheduler(tiny_llama, grammar_compile_timeout=WAIT_S)
    yield scheduler
    scheduler.close()


_rids = iter(range(10**6))


def add(scheduler: Scheduler, structured: StructuredOutput | None, max_tokens: int = 4) -> tuple[int, object]:
    rid = next(_rids)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=structured)
    return rid, scheduler.add_request(TokenizedRequest(rid, [5, 6, 7], sampling, StageTimes()))


_verdicts: dict[int, RequestAccepted | RequestRejected] = {}  # taken, not yet asked for (rids are unique)


def verdict_of(scheduler: Scheduler, rid: int) -> RequestAccepted | RequestRejected:
    deadline = time.monotonic() + WAIT_S
    while rid not in _verdicts and time.monotonic() < deadline:
        _verdicts.update((verdict.rid, verdict) for verdict in scheduler.take_grammar_verdicts(timeout_s=0.5))
    assert rid in _verdicts, f"no verdict for request {rid} within {WAIT_S} s"
    return _verdicts.pop(rid)


def run_step(scheduler: Scheduler, token: int = 9) -> StepPlan | None:
    """One step planned and its result processed at once, every sample `token`."""
    plan = scheduler.schedule()
    if plan is not None:
        sampled = [rid for rid, sample in zip(plan.rids, plan.samples) if sample]
        scheduler.process_result(StepResult(plan.step_id, sampled, [token] * len(sampled), 0.0, StepTimings()))
    return plan


# ---------------------------------------------------------------- the scheduler and its compile worker


def test_the_vocabulary_is_prepared_when_the_compile_worker_starts_not_on_the_first_grammar(tiny_llama):
    scheduler = make_scheduler(tiny_llama)
    try:
        assert scheduler.grammars.worker.ready.wait(WAIT_S)
        assert scheduler.grammars.worker.compiles == 0, "ready before any grammar was asked for"
    finally:
        scheduler.close()


def test_a_new_grammar_gets_its_verdict_when_compiled_and_is_admitted_with_a_mask(scheduler):
    rid, verdict = add(scheduler, StructuredOutput("regex", "[a-c]{2}-[0-9]{3}", "structured_outputs"))
    assert verdict is None, "no verdict before the grammar is compiled"
    assert scheduler.requests[rid].status is RequestStatus.WAITING_FOR_GRAMMAR
    assert all(request.rid != rid for request in scheduler.waiting), "in no queue"
    accepted = verdict_of(scheduler, rid)
    assert isinstance(accepted, RequestAccepted) and accepted.prompt_tokens == 3
    plan = scheduler.schedule()
    assert plan is not None and rid in plan.rids and rid in plan.token_bitmasks
    scheduler.abort_request(rid)


def test_other_requests_run_to_the_end_while_a_grammar_compiles(scheduler):
    waiting, _ = add(scheduler, many_choices(8000))
    free, accepted = add(scheduler, None, max_tokens=8)
    assert isinstance(accepted, RequestAccepted)
    deadline = time.monotonic() + WAIT_S
    while free in scheduler.requests and time.monotonic() < deadline:
        run_step(scheduler)
        scheduler.check_integrity()
    assert free not in scheduler.requests, "the free request finished"
    assert scheduler.requests[waiting].status is RequestStatus.WAITING_FOR_GRAMMAR, "before the grammar was ready"
    assert isinstance(verdict_of(scheduler, waiting), RequestAccepted)
    scheduler.abort_request(waiting)


def test_requests_for_the_same_grammar_share_one_compile_and_later_ones_hit_the_cache(scheduler):
    structured = StructuredOutput("json", json.dumps({"type": "object", "properties": {"n": {"type": "number"}}}))
    compiles = scheduler.grammars.worker.compiles
    first, none_yet = add(scheduler, structured)
    second, none_either = add(scheduler, structured)
    assert none_yet is None and none_either is None
    assert isinstance(verdict_of(scheduler, first), RequestAccepted)
    assert isinstance(verdict_of(scheduler, second), RequestAccepted)
    third, at_once = add(scheduler, structured)
    assert isinstance(at_once, RequestAccepted), "from the cache, without waiting"
    assert scheduler.grammars.worker.compiles == compiles + 1
    for rid in (first, second, third):
        scheduler.abort_request(rid)


def test_an_abort_while_waiting_for_the_grammar_frees_the_request(scheduler):
    worker = scheduler.grammars.worker
    compiles = worker.compiles
    big = many_choices(3000)
    under_way, _ = add(scheduler, big)
    deadline = time.monotonic() + WAIT_S
    while worker.compiles == compiles and time.monotonic() < deadline:
        time.sleep(0.01)  # a poll bounded by the deadline, until the worker has it
    queued, _ = add(scheduler, StructuredOutput("regex", "[0-9]{7}x"))  # behind it, not started
    assert scheduler.abort_request(under_way) and scheduler.abort_request(queued)
    assert under_way not in scheduler.requests and queued not in scheduler.requests
    assert scheduler.grammars.num_waiting == 0
    scheduler.check_integrity()
    last, _ = add(scheduler, StructuredOutput("regex", "[0-9]{8}y"))  # the worker takes jobs in order
    assert isinstance(verdict_of(scheduler, last), RequestAccepted)
    assert under_way not in _verdicts and queued not in _verdicts, "no verdict for an aborted request"
    # (The compile under way was given up for the last one's, or finished first: the fake worker's tests below.)
    assert worker.compiles == compiles + 2, "the queued one was never started"
    scheduler.abort_request(last)


def test_the_doorbell_rings_when_a_grammar_is_ready(scheduler):
    assert scheduler.take_grammar_verdicts() == [], "quiet: nothing compiled, the doorbell silenced"
    rid, _ = add(scheduler, StructuredOutput("regex", "[x-z]{3}"))
    # A compile an earlier test aborted may still finish into the cache and ring once with no verdict to take:
    # the loop then finds nothing and polls again, as here.
    verdicts: list = []
    deadline = time.monotonic() + WAIT_S
    while not verdicts:
        readable, _, _ = select.select([scheduler.grammars.doorbell], [], [], max(0.0, deadline - time.monotonic()))
        assert readable, "the loop, polling the doorbell, wakes"
        verdicts = scheduler.take_grammar_verdicts()
    assert [v.rid for v in verdicts] == [rid]
    scheduler.abort_request(rid)


@pytest.mark.parametrize(
    "structured, what",
    [
        (StructuredOutput("regex", "(unclosed", "guided_regex"), "parenthesis is not closed"),
        (StructuredOutput("grammar", 'root ::= "a" foo', "structured_outputs"), 'Rule "foo" is not defined'),
        (StructuredOutput("json", '{"type": "nonsense"}', "response_format"), 'Unsupported type "nonsense"'),
    ],
    ids=["regex", "ebnf", "json-schema"],
)
def test_a_grammar_that_does_not_compile_is_refused_in_the_users_terms(scheduler, structured, what):
    rid, _ = add(scheduler, structured)
    refused = verdict_of(scheduler, rid)
    assert isinstance(refused, RequestRejected) and refused.status == 400 and refused.param == structured.field
    assert what in refused.message
    assert not re.search(r"\.(cc|h|cpp|py)\b|/project/|\[\d\d:\d\d:\d\d\]|Stack trace", refused.message)
    assert rid not in scheduler.requests


def test_compile_error_messages_drop_library_paths_frames_and_quoted_input():
    raw = RuntimeError(
        "[06:11:35] /project/cpp/json_schema_converter.cc:4939: Check failed: (error.empty()) is false: Failed to "
        'parse JSON: syntax error at line 1 near: . The JSON string is:{"type": ' + "x" * 5000 + "\n"
        "Stack trace:\n  [bt] (0) /usr/lib/libxgrammar.so(+0x1234) [0x7f]\n"
    )
    message = compile_error_message("json", raw)
    assert message == "the JSON schema does not compile: Failed to parse JSON: syntax error at line 1 near: ."


def test_a_compile_past_the_timeout_is_refused_naming_its_field_and_the_worker_is_replaced(tiny_llama, monkeypatch):
    monkeypatch.setattr(compile_budget, "WAIT_BOUND_FACTOR", 1000)  # CPU time alone: however busy the machine
    scheduler = make_scheduler(tiny_llama, grammar_compile_timeout=0.2)
    try:
        assert scheduler.grammars.worker.ready.wait(WAIT_S)
        pid = scheduler.grammars.worker.pid
        rid, _ = add(scheduler, many_choices(20000))
        refused = verdict_of(scheduler, rid)
        assert isinstance(refused, RequestRejected) and refused.status == 400 and refused.param == "guided_choice"
        assert "--grammar-compile-timeout" in refused.message
        assert scheduler.grammars.worker.restarts == 1 and scheduler.grammars.worker.pid != pid
        after, _ = add(scheduler, StructuredOutput("regex", "ab?"))  # compiles well within 0.2 s on the new worker
        assert isinstance(verdict_of(scheduler, after), RequestAccepted)
    finally:
        scheduler.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's; elsewhere the worker runs at nice 19")
def test_compiles_run_only_on_cycles_that_serving_leaves_idle(tiny_llama, monkeypatch):
    monkeypatch.delenv(compile_budget.PRIORITY_ENV, raising=False)  # the default (tests/conftest.py sets normal)
    scheduler = make_scheduler(tiny_llama)
    try:
        worker = scheduler.grammars.worker
        # The priority is set before the worker is spawned: no need to wait for its vocabulary (which, on idle
        # cycles of a machine the suite keeps busy, can take minutes).
        pid = wait_until(lambda: worker.pid, WAIT_S, "the compile worker's spawn")
        thread = worker.native_id  # this scheduler's (another test's scheduler in this process has its own)
        assert thread is not None and os.sched_getscheduler(thread) == os.SCHED_IDLE, "its thread"
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE, "the compile worker"
        assert os.sched_getscheduler(threading.get_native_id()) != os.SCHED_IDLE, "not the scheduler's loop"
    finally:
        scheduler.close()


def test_a_host_busy_by_design_can_keep_compiles_at_normal_priority(tiny_llama, monkeypatch):
    monkeypatch.setenv(compile_budget.PRIORITY_ENV, "normal")
    scheduler = make_scheduler(tiny_llama)
    try:
        worker = scheduler.grammars.worker
        assert worker.ready.wait(WAIT_S)
        assert os.sched_getscheduler(worker.pid) == os.SCHED_OTHER, "the compile worker"
    finally:
        scheduler.close()


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process gets no CPU at all inside the block (SIGSTOP), as on a machine busy throughout."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGCONT)


def test_a_compile_starved_of_cpu_is_not_refused_for_waiting(tiny_llama, monkeypatch):
    monkeypatch.setattr(compile_budget, "WAIT_BOUND_FACTOR", 100)  # not the wait bound's test: however busy the machine
    timeout_s = 0.5
    scheduler = make_scheduler(tiny_llama, grammar_compile_timeout=timeout_s)
    try:
        assert scheduler.grammars.worker.ready.wait(WAIT_S)
        with stopped(scheduler.grammars.worker.pid):
            rid, _ = add(scheduler, StructuredOutput("regex", "[0-4]{2}z"))
            time.sleep(3 * timeout_s)  # what is tested: the grammar handed over, its worker without CPU this long
            assert scheduler.take_grammar_verdicts() == [], "no verdict while it waits for a core"
        assert isinstance(verdict_of(scheduler, rid), RequestAccepted), "compiled once it had a core"
        assert scheduler.grammars.worker.restarts == 0
    finally:
        scheduler.close()


def test_a_compile_that_gets_no_cpu_is_refused_at_the_wait_bound_and_given_up_for_the_next_grammar(
    tiny_llama, monkeypatch
):
    monkeypatch.setattr(compile_budget, "WAIT_BOUND_FACTOR", 4)
    scheduler = make_scheduler(tiny_llama, grammar_compile_timeout=0.25)
    try:
        worker = scheduler.grammars.worker
        assert worker.ready.wait(WAIT_S)
        pid = worker.pid
        with stopped(pid):
            rid, _ = add(scheduler, StructuredOutput("regex", "[5-9]{2}q", "guided_regex"))
            refused = verdict_of(scheduler, rid)
            assert isinstance(refused, RequestRejected) and refused.status == 503 and refused.param is None
            assert "too busy to finish compiling it" in refused.message and "retry later" in refused.message
            scheduler.grammars.wait_bound_s = WAIT_S  # the next one has a worker to start
            after, _ = add(scheduler, StructuredOutput("regex", "[5-9]{2}r"))
            assert isinstance(verdict_of(scheduler, after), RequestAccepted)
        assert worker.restarts == 1 and worker.pid != pid, "the starved worker killed and replaced"
        assert worker.compiles == 2
    finally:
        scheduler.close()


@pytest.fixture
def vocabulary_gate(monkeypatch) -> Iterator[threading.Event]:
    """The first compile worker's vocabulary is held back until the test sets the event (a slow start-up)."""
    gate = threading.Event()
    start = CompileWorker._start_process

    def held_start(worker: CompileWorker) -> None:
        if not worker.ready.is_set():
            assert gate.wait(WAIT_S), "the test never let the vocabulary be prepared"
        start(worker)

    monkeypatch.setattr(CompileWorker, "_start_process", held_start)
    yield gate
    gate.set()


def test_a_structured_request_sent_before_the_vocabulary_is_ready_waits_for_it_and_completes(
    tiny_llama, vocabulary_gate
):
    pattern = "[a-c]{2,4}-[0-9]{3}"
    sampling = SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured=StructuredOutput("regex", pattern))
    outputs: list = []
    with LLM(str(tiny_llama), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64) as llm:
        generating = threading.Thread(target=lambda: outputs.extend(llm.generate([[5, 9, 7]], [sampling])))
        generating.start()
        wait_until(lambda: llm.scheduler.grammars.num_waiting == 1, timeout=WAIT_S, what="the request to arrive")
        snapshot = llm.scheduler.snapshot()
        assert snapshot.num_waiting_for_grammar == 1 and snapshot.grammar_vocabulary_ready == 0
        assert not outputs, "waiting, not refused"
        vocabulary_gate.set()
        generating.join(WAIT_S)
        assert llm.scheduler.snapshot().grammar_vocabulary_ready == 1
    [out] = outputs
    text = llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert re.fullmatch(pattern, text) and out.finish_reason == "stop", text


def test_the_wait_for_the_vocabulary_is_not_counted_by_the_compile_timeout(tiny_llama, vocabulary_gate, monkeypatch):
    monkeypatch.setattr(compile_budget, "WAIT_BOUND_FACTOR", 100)  # counted by the wait bound: the next tests'
    timeout_s = 1.0  # of CPU: the wait below outlasts it
    scheduler = make_scheduler(tiny_llama, grammar_compile_timeout=timeout_s)
    try:
        rid, verdict = add(scheduler, StructuredOutput("regex", "[a-c]{2}-[0-9]{2}", "structured_outputs"))
        assert verdict is None and scheduler.requests[rid].status is RequestStatus.WAITING_FOR_GRAMMAR
        time.sleep(3.5 * timeout_s)  # what is tested: a wait for the vocabulary longer than the timeout
        assert scheduler.take_grammar_verdicts() == [] and not scheduler.grammars.vocabulary_ready
        vocabulary_gate.set()
        assert isinstance(verdict_of(scheduler, rid), RequestAccepted)
        assert scheduler.grammars.worker.restarts == 0
    finally:
        scheduler.close()


# ---------------------------------------------------------------- the wait bound, from a request's arrival

BOUND_S = 1.0  # the wait bound in these tests (a server's: 10x --grammar-compile-timeout)


class FakePipe:
    """The scheduler's end of a fake compile worker's pipe: a trial ends only when the test finishes its grammar,
    refused (the fake compiles nothing), or when its worker is killed."""

    def __init__(self, compiles: FakeCompiles):
        self.compiles = compiles
        self.key: tuple[str, str] | None = None
        self.hung_up = False

    def send_bytes(self, data: bytes) -> None:
        job: CompileGrammar = decode(data)
        self.key = (job.kind, job.spec)
        self.compiles.handed.append(self.key)

    def poll(self, timeout: float) -> bool:
        with self.compiles.changed:
            return self.compiles.changed.wait_for(lambda: self.hung_up or self.key in self.compiles.finished, timeout)

    def recv_bytes(self) -> bytes:
        if self.hung_up:
            raise EOFError
        return encode(GrammarCompiled(error="the fake compiles nothing"))

    def close(self) -> None:
        pass


@dataclass
class FakeProcess:
    pipe: FakePipe
    pid: int = -1  # /proc cannot tell its CPU time: its clock is wall time (the tests' timeout is WAIT_S)
    exitcode: int | None = None

    def kill(self) -> None:
        self.exitcode = -9
        with self.pipe.compiles.changed:
            self.pipe.hung_up = True
            self.pipe.compiles.changed.notify_all()

    def join(self, timeout: float) -> None:
        pass


class FakeCompiles:
    """Stands in for the compile worker process (CompileWorker._start_process): the scheduler's compile thread hands
    it grammars one at a time as to the real one, and the test says when each compile ends."""

    def __init__(self) -> None:
        self.vocabulary = threading.Event()  # cleared before the scheduler starts: the vocabulary is held back
        self.vocabulary.set()
        self.handed: list[tuple[str, str]] = []  # every grammar handed to a worker, in order
        self.finished: set[tuple[str, str]] = set()
        self.changed = threading.Condition()

    def start(self, worker: CompileWorker) -> None:
        if not worker.ready.is_set():
            assert self.vocabulary.wait(WAIT_S), "the test never let the vocabulary be prepared"
        pipe = FakePipe(self)
        worker._process, worker._conn = FakeProcess(pipe), pipe
        worker.ready.set()

    def finish(self, structured: StructuredOutput) -> None:
        with self.changed:
            self.finished.add(key_of(structured))
            self.changed.notify_all()


def key_of(structured: StructuredOutput) -> tuple[str, str]:
    return (structured.kind, structured.spec)


@pytest.fixture
def fake_compiles(monkeypatch) -> Iterator[FakeCompiles]:
    compiles = FakeCompiles()
    monkeypatch.setattr(CompileWorker, "_start_process", lambda worker: compiles.start(worker))
    yield compiles
    compiles.vocabulary.set()


@contextmanager
def bounded_scheduler(model, compiles: FakeCompiles) -> Iterator[Scheduler]:
    """A scheduler whose requests wait BOUND_S for their grammar, compiled by `compiles`."""
    scheduler = make_scheduler(model, grammar_compile_timeout=WAIT_S)
    scheduler.grammars.wait_bound_s = BOUND_S
    try:
        yield scheduler
    finally:
        compiles.vocabulary.set()  # (a compile thread held at the vocabulary lets go)
        scheduler.close()


def verdicts_until(scheduler: Scheduler, rids: set[int], between=lambda: None) -> dict[int, object]:
    """The verdicts of `rids`, polled for (with `between` run before each poll)."""
    verdicts: dict[int, object] = {}
    deadline = time.monotonic() + WAIT_S
    while not rids <= verdicts.keys() and time.monotonic() < deadline:
        between()
        verdicts.update((v.rid, v) for v in scheduler.take_grammar_verdicts(timeout_s=0.01))
    assert rids <= verdicts.keys(), f"no verdict for {rids - verdicts.keys()} within {WAIT_S} s"
    return verdicts


LONG = StructuredOutput("regex", "a{1000}", "guided_regex")  # finished only when the test says (FakeCompiles)
QUEUED = StructuredOutput("regex", "b+", "guided_regex")


def queued_behind_a_long_compile(scheduler: Scheduler, compiles: FakeCompiles) -> tuple[int, int, int]:
    """Three requests: the first's grammar compiles until the test finishes it; the second's is queued behind it;
    the third asks for the first's grammar (joining its compile, which it keeps wanted after the first gives up).
    Their rids."""
    first, _ = add(scheduler, LONG)
    wait_until(lambda: compiles.handed == [key_of(LONG)], WAIT_S, "the long compile to start")
    queued, _ = add(scheduler, QUEUED)
    joining, _ = add(scheduler, LONG)
    return first, queued, joining


def test_a_request_queued_behind_a_long_compile_is_refused_at_its_bound_from_arrival_while_a_stream_runs(
    tiny_llama, fake_compiles
):
    with bounded_scheduler(tiny_llama, fake_compiles) as scheduler:
        arrived = time.monotonic()
        _, queued, _ = queued_behind_a_long_compile(scheduler, fake_compiles)
        stream, accepted = add(scheduler, None, max_tokens=400)
        assert isinstance(accepted, RequestAccepted)
        refused = verdicts_until(scheduler, {queued}, between=lambda: run_step(scheduler))[queued]
        assert time.monotonic() - arrived >= BOUND_S
        assert isinstance(refused, RequestRejected) and refused.status == 503 and refused.param is None
        assert f"not ready within {BOUND_S:g} s of the request's arrival" in refused.message
        assert "busy compiling other grammars; retry later" in refused.message
        assert queued not in scheduler.requests
        running = scheduler.requests[stream]
        assert running.status is RequestStatus.RUNNING and running.output_ids, "the stream ran meanwhile"
        tokens = len(running.output_ids)
        run_step(scheduler)
        assert len(running.output_ids) == tokens + 1, "and runs on"
        scheduler.check_integrity()


def test_a_grammar_queued_when_its_request_gave_up_is_never_compiled(tiny_llama, fake_compiles):
    with bounded_scheduler(tiny_llama, fake_compiles) as scheduler:
        verdicts_until(scheduler, set(queued_behind_a_long_compile(scheduler, fake_compiles)))
        assert fake_compiles.handed == [key_of(LONG)]
        fake_compiles.finish(LONG)  # nobody waits for it, nobody else is wanted: it went on to its end
        worker = scheduler.grammars.worker
        wait_until(lambda: worker.under_way is None, WAIT_S, "the long compile to end")
        later = StructuredOutput("regex", "c+", "guided_regex")
        add(scheduler, later)
        wait_until(lambda: len(fake_compiles.handed) == 2, WAIT_S, "the next grammar handed over")
        assert fake_compiles.handed == [key_of(LONG), key_of(later)]
        assert worker.restarts == 0


def test_a_compile_nobody_waits_for_is_given_up_for_the_next_grammar(tiny_llama, fake_compiles):
    with bounded_scheduler(tiny_llama, fake_compiles) as scheduler:
        first, _ = add(scheduler, LONG)
        verdicts_until(scheduler, {first})
        scheduler.grammars.wait_bound_s = WAIT_S  # (a longer bound for later arrivals: deadlines stay in order)
        later = StructuredOutput("regex", "c+", "guided_regex")
        rid, _ = add(scheduler, later)
        worker = scheduler.grammars.worker
        wait_until(lambda: len(fake_compiles.handed) == 2, WAIT_S, "the next grammar handed over")
        assert worker.restarts == 1, "the worker compiling the grammar nobody waits for killed and replaced"
        fake_compiles.finish(later)
        refused = verdicts_until(scheduler, {rid})[rid]
        assert isinstance(refused, RequestRejected) and refused.message == "the fake compiles nothing", "its outcome"


def test_a_request_waiting_for_the_vocabulary_is_refused_at_its_bound_saying_so_and_counted(tiny_llama, fake_compiles):
    fake_compiles.vocabulary.clear()
    with bounded_scheduler(tiny_llama, fake_compiles) as scheduler:
        assert scheduler.snapshot().grammar_wait_refusals == 0
        rid, _ = add(scheduler, QUEUED)
        refused = verdicts_until(scheduler, {rid})[rid]
        assert isinstance(refused, RequestRejected) and refused.status == 503
        assert "still preparing its grammar vocabulary; retry later" in refused.message
        snapshot = scheduler.snapshot()
        assert snapshot.grammar_wait_refusals == 1 and snapshot.num_waiting_for_grammar == 0
        assert snapshot.grammar_vocabulary_ready == 0


KEEP_A_SCHEDULER = """
import sys, threading
from tests.test_grammar_compile import make_scheduler
scheduler = make_scheduler(sys.argv[1])
assert scheduler.grammars.worker.ready.wait(300)
print(scheduler.grammars.worker.pid, flush=True)
threading.Event().wait()
"""


def test_the_compile_worker_dies_with_its_scheduler(tiny_llama):
    """Even killed (SIGKILL: no cleanup of its own), a scheduler leaves no compile worker behind."""
    host = subprocess.Popen(
        [sys.executable, "-c", KEEP_A_SCHEDULER, str(tiny_llama)], stdout=subprocess.PIPE, cwd=ROOT, text=True
    )
    try:
        worker = int(host.stdout.readline())
        assert pid_alive(worker)
    finally:
        host.kill()
        host.wait()
    wait_until(lambda: not pid_alive(worker), timeout=30, what="the compile worker to exit")


# ---------------------------------------------------------------- --max-grammar-bytes, where requests enter

BIG_REGEX = "a" * 300
BIG_SCHEMA = {"type": "object", "title": BIG_REGEX}


@pytest.mark.parametrize(
    "path, fields, param",
    [
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": BIG_REGEX}}, "structured_outputs"),
        ("/v1/completions", {"prompt": "x", "guided_choice": [BIG_REGEX]}, "guided_choice"),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": BIG_SCHEMA}},
            },
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": BIG_SCHEMA}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
    ids=["structured_outputs", "guided_choice", "response_format", "forced_tool_call"],
)
def test_a_grammar_past_max_grammar_bytes_is_refused_by_the_frontend_naming_its_field(path, fields, param):
    limits = EngineLimits("fake-model", 128, 64, 16, 32, max_grammar_bytes=256)
    engine = FakeEngineClient(limits)
    response = TestClient(build_app(engine)).post(path, json={"model": "fake-model", **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "--max-grammar-bytes" in error["message"]
    assert engine.submitted == [], "refused before it went further"


# ---------------------------------------------------------------- a live server


def test_a_running_stream_keeps_streaming_while_a_big_grammar_compiles(tiny_server):
    """While the structured request waits for its verdict (most of that wait is its compile), the stream's tokens
    keep coming."""
    arrivals: list[float] = []
    stop = threading.Event()

    def stream() -> None:
        body = {"prompt": "Hello", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.Client(base_url=tiny_server.url, timeout=WAIT_S) as client:
            while not stop.is_set():
                with client.stream("POST", "/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data:") and "[DONE]" not in line:
                            arrivals.append(time.monotonic())
                        if stop.is_set():
                            break

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    deadline = time.monotonic() + WAIT_S
    while len(arrivals) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)  # a poll bounded by the deadline
    structured = many_choices(8000)
    sent = time.monotonic()
    response = httpx.post(
        f"{tiny_server.url}/v1/completions",
        json={"prompt": "x", "max_tokens": 1, "structured_outputs": {"choice": json.loads(structured.spec)}},
        timeout=WAIT_S,
    )
    answered = time.monotonic()
    stop.set()
    streamer.join(timeout=WAIT_S)
    # 400: past the compile timeout on a slow machine; 503: not ready within its wait bound on a busy one
    assert response.status_code in (200, 400, 503), response.text
    # Progress throughout: no pause of the stream covers a quarter of the wait (on the loop, one pause is
    # nearly all of it: the compile's).
    window = [sent, *(t for t in arrivals if sent < t < answered), answered]
    longest_pause = max(b - a for a, b in zip(window, window[1:]))
    assert longest_pause < (answered - sent) / 4, f"a {longest_pause:.1f} s pause in {answered - sent:.1f} s"


def test_stats_and_metrics_say_when_the_grammar_vocabulary_is_ready_and_count_wait_refusals(tiny_server):
    def ready() -> bool:
        replies = httpx.get(f"{tiny_server.url}/stats", timeout=30).json()["replies"]
        schedulers = [reply["payload"] for role, reply in replies.items() if role.startswith("scheduler")]
        assert schedulers and all("num_waiting_for_grammar" in payload for payload in schedulers)
        assert all("grammar_wait_refusals" in payload for payload in schedulers)
        return all(payload["grammar_vocabulary_ready"] == 1 for payload in schedulers)

    wait_until(ready, timeout=WAIT_S, what="the grammar vocabulary to be ready")
    metrics = httpx.get(f"{tiny_server.url}/metrics", timeout=30).text
    assert re.search(r"^clearserve_grammar_vocabulary_ready 1\.0$", metrics, re.M), "in /metrics too"
    assert re.search(r"^clearserve_grammar_wait_refusals_total \d+\.0$", metrics, re.M), "beside it: the refusals"
