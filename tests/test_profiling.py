"""Per-process profiling and the per-process summary: the profilers on their own (one clock, markers, a new
file per run), the merge, the HTTP endpoints against a fake engine, then a real server on CPU writing one
Chrome trace per process and one merged trace, on request and with --profile-steps."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
import zmq
from fastapi.testclient import TestClient

import common.process as process_module
from common.messages import AbortRequest
from common.profiling import (
    MARKER_TID,
    NOT_ENABLED,
    ProcessProfiler,
    ProcessStats,
    ProfileConfig,
    PythonProfiler,
    TorchProfiler,
    epoch_us,
)
from common.transport import pull_socket, push_socket, recv, send
from frontend.app import build_app
from frontend.trace_merge import merge_traces
from tests.fake_engine import FakeEngineClient
from tests.server_process import ServerProcess, wait_until

ROLES = {"gpu_worker", "scheduler", "tokenizer-0", "tokenizer-1", "frontend-0"}  # every child of the launcher
SUMMARY_KEYS = {
    "uptime_s",
    "busy_s",
    "idle_s",
    "busy_pct",
    "messages_in",
    "messages_out",
    "bytes_in",
    "bytes_out",
    "msgpack_encode_s",
    "msgpack_decode_s",
    "gc_collections",
    "gc_full_collections",
    "gc_pause_s",
    "gc_max_pause_ms",
    "gc_frozen_objects",
}
TRACE_NAME = re.compile(r"(?P<role>[a-z_]+(?:-\d+)?)-(?P<pid>\d+)-(?P<run>\d+)\.trace\.json")


def inner(x: int) -> int:
    return x + 1


def outer(x: int) -> int:
    return inner(x) * 2


def complete_events(path: str | Path) -> list[dict]:
    return [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]


def named(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e["name"].split(" ")[0].endswith(name)]


def markers(events: list[dict], prefix: str) -> list[dict]:
    return [e for e in events if e.get("cat") == "marker" and e["name"].startswith(prefix)]


# ---------------------------------------------------------------- the profilers


def test_python_profiler_records_a_nested_call_as_nested_complete_events(tmp_path):
    profiler = PythonProfiler()
    profiler.start(str(tmp_path), "unit")
    outer(1)
    path = profiler.stop()

    assert path == str(tmp_path / f"unit-{os.getpid()}-1.trace.json")
    events = complete_events(path)
    [caller], [callee] = named(events, "outer"), named(events, "inner")
    assert caller["pid"] == callee["pid"] == os.getpid() and caller["tid"] == callee["tid"]
    assert caller["ts"] <= callee["ts"] and callee["ts"] + callee["dur"] <= caller["ts"] + caller["dur"]


def test_python_profiler_keeps_at_most_its_event_cap(tmp_path):
    profiler = PythonProfiler(max_events=1000)
    profiler.start(str(tmp_path), "unit")
    for i in range(10_000):
        inner(i)
    events = complete_events(profiler.stop())
    assert 0 < len(events) <= 1000
    assert named(events, "inner")  # the latest calls are the ones kept


def test_torch_profiler_writes_a_chrome_trace_of_operators(tmp_path):
    import torch

    profiler = TorchProfiler()
    profiler.start(str(tmp_path), "gpu_worker")
    torch.ones(8, 8) @ torch.ones(8, 8)
    path = profiler.stop()

    assert Path(path).name == f"gpu_worker-{os.getpid()}-1.trace.json"
    assert named(complete_events(path), "aten::matmul")


@pytest.mark.parametrize("kind", [PythonProfiler, TorchProfiler])
def test_every_profiler_writes_unix_epoch_microseconds_and_its_markers(kind, tmp_path):
    import torch

    before = epoch_us()
    profiler = kind()
    profiler.start(str(tmp_path), "unit")
    started = epoch_us()
    outer(1)
    torch.ones(8, 8) @ torch.ones(8, 8)
    profiler.mark("step 7", started, {"step_id": 7, "tokens": 3})
    path = profiler.stop()
    after = epoch_us()

    events = complete_events(path)
    assert events and all(before <= e["ts"] <= e["ts"] + e["dur"] <= after for e in events)
    [marker] = markers(events, "step")
    assert marker["args"] == {"step_id": 7, "tokens": 3} and marker["tid"] == MARKER_TID
    assert marker["pid"] == os.getpid() and marker["ts"] == started


def test_each_profiling_run_writes_a_new_file(tmp_path):
    profiler = PythonProfiler()
    paths = []
    for _ in range(2):
        profiler.start(str(tmp_path), "unit")
        outer(1)
        paths.append(profiler.stop())
    assert [Path(p).name for p in paths] == [f"unit-{os.getpid()}-1.trace.json", f"unit-{os.getpid()}-2.trace.json"]
    assert all(complete_events(p) for p in paths)


def test_merged_trace_gives_each_process_and_each_device_a_named_lane(tmp_path):
    def write(name: str, events: list[dict]) -> str:
        path = tmp_path / name
        path.write_text(json.dumps({"traceEvents": events}))
        return str(path)

    op = {"ph": "X", "name": "aten::mm", "ts": 10.0, "dur": 1.0, "tid": 1}
    worker = write(
        "w.json",
        [
            {**op, "pid": 42},
            {**op, "name": "gemm_kernel", "pid": 0},
            {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
        ],
    )
    frontend = write("f.json", [{**op, "name": "handle", "pid": 7}])
    merged = json.loads(
        Path(merge_traces({"gpu_worker": (42, worker), "frontend-0": (7, frontend)}, str(tmp_path / "m"))).read_text()
    )

    events = merged["traceEvents"]
    lanes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    kernel_lane = next(e["pid"] for e in events if e["name"] == "gemm_kernel")
    assert lanes == {42: "gpu_worker", 7: "frontend-0", kernel_lane: "gpu_worker: GPU 0"}
    assert kernel_lane not in (0, 7, 42), "a device's lane never collides with a process's"
    assert {e["name"] for e in events if e["ph"] == "X"} == {"aten::mm", "gemm_kernel", "handle"}


def test_a_process_profiler_answers_each_command_with_a_result_or_a_reason_and_status(tmp_path):
    assert ProcessProfiler(ProfileConfig(), "scheduler").answer("start_profile") == {
        "error": NOT_ENABLED,
        "status": 400,
    }
    profiler = ProcessProfiler(ProfileConfig(str(tmp_path)), "scheduler")
    assert profiler.answer("stop_profile")["status"] == 409
    assert profiler.answer("start_profile") == {"started": True}
    assert profiler.answer("start_profile")["status"] == 409
    assert Path(profiler.answer("stop_profile")["trace"]).is_file()
    assert profiler.answer("shutdown")["status"] == 400


def test_process_stats_count_messages_bytes_and_busy_time():
    stats = ProcessStats()
    ctx = zmq.Context()
    try:
        receiver = pull_socket(ctx, "inproc://stats")
        sender = push_socket(ctx, "inproc://stats")
        with stats.busy():
            sent = send(sender, AbortRequest(7), stats.sockets)
            assert recv(receiver, stats=stats.sockets) == AbortRequest(7)
    finally:
        ctx.destroy(linger=0)

    summary = stats.summary()
    assert set(summary) == SUMMARY_KEYS
    assert (summary["messages_in"], summary["messages_out"]) == (1, 1)
    assert summary["bytes_in"] == summary["bytes_out"] == sent
    assert 0 < summary["busy_s"] <= summary["uptime_s"]
    assert summary["busy_s"] + summary["idle_s"] == pytest.approx(summary["uptime_s"])


# ---------------------------------------------------------------- the endpoints (fake engine)


@pytest.mark.parametrize("path", ["/start_profile", "/stop_profile"])
def test_profiling_endpoints_are_400_without_a_profile_dir(path):
    response = TestClient(build_app(FakeEngineClient())).post(path)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == NOT_ENABLED


def profiled_fake(tmp_path) -> tuple[FakeEngineClient, TestClient]:
    engine = FakeEngineClient()
    engine.control_answers["start_profile"] = {"started": True}
    return engine, TestClient(build_app(engine, profiler=ProcessProfiler(ProfileConfig(str(tmp_path)), "frontend")))


def test_profiling_endpoints_reach_every_process_and_profile_the_frontend_too(tmp_path):
    engine, http = profiled_fake(tmp_path)
    other = PythonProfiler()  # stands for the other processes' traces (one viztracer at a time per process)
    other.start(str(tmp_path / "others"), "other")
    engine.control_answers["stop_profile"] = {"trace": other.stop()}

    started = http.post("/start_profile").json()
    assert engine.control_calls[-1][0] == "start_profile"
    assert set(started["replies"]) == {"tokenizer-0", "scheduler", "gpu_worker", "frontend"}
    assert started["replies"]["frontend"] == {"pid": os.getpid(), "payload": {"started": True}}

    stopped = http.post("/stop_profile").json()
    assert engine.control_calls[-1][0] == "stop_profile"
    assert Path(stopped["replies"]["frontend"]["payload"]["trace"]).name == f"frontend-{os.getpid()}-1.trace.json"
    assert Path(stopped["merged_trace"]).name == f"merged-{os.getpid()}-1.trace.json"
    events = json.loads(Path(stopped["merged_trace"]).read_text())["traceEvents"]
    lanes = {e["args"]["name"].split(":")[0] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert lanes == {"tokenizer-0", "scheduler", "gpu_worker", "frontend"}


def test_profiling_twice_or_stopping_without_a_profile_is_a_409(tmp_path):
    engine, http = profiled_fake(tmp_path)
    stopped = http.post("/stop_profile")
    assert stopped.status_code == 409 and "not profiling" in stopped.json()["error"]["message"]
    assert http.post("/start_profile").status_code == 200
    again = http.post("/start_profile")
    assert again.status_code == 409 and "already profiling" in again.json()["error"]["message"]


def test_a_process_that_refuses_makes_the_answer_a_409_naming_it(tmp_path):
    engine, http = profiled_fake(tmp_path)
    engine.control_answers["start_profile"] = {"error": "scheduler is already profiling", "status": 409}
    refused = http.post("/start_profile")
    assert refused.status_code == 409
    assert "gpu_worker: scheduler is already profiling" in refused.json()["error"]["message"]


# ---------------------------------------------------------------- a real server on CPU


def traces_by_role(paths) -> dict[str, tuple[int, list[dict]]]:
    """Every process's trace among `paths` by role: (pid from the file name, its complete events)."""
    traces = {}
    for path in paths:
        if path.name.startswith("merged-"):
            continue
        match = TRACE_NAME.fullmatch(path.name)
        assert match, f"unexpected file {path.name}"
        traces[match["role"]] = (int(match["pid"]), complete_events(path))
    return traces


def all_traces_written(folder: Path, processes: int) -> dict | None:
    """The traces once one per process is there (a trace being written has another name until it is whole)."""
    written = list(folder.glob("*.trace.json"))
    return traces_by_role(written) if len(written) >= processes else None


def replies_with_frontend(body: dict) -> dict[str, dict]:
    """A control endpoint's answer by role: the other processes' replies and the answering frontend's own."""
    return body["replies"]


def server_pids(server: ServerProcess) -> dict[str, int]:
    return server.child_pids()


def generate(server: ServerProcess, n: int, max_tokens: int) -> None:
    with server.client() as c:
        for i in range(n):
            response = c.post(
                "/v1/completions",
                json={"prompt": f"profile me {i}", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
            )
            assert response.status_code == 200, response.text


# The shared tiny server profiles on request into its profile_dir (tests/conftest.py); every profiled run
# there writes new files, so each test looks at the files of its own run.


def test_a_profiled_run_writes_one_chrome_trace_per_process_named_by_role_and_pid(tiny_server):
    server, folder = tiny_server, tiny_server.profile_dir
    pids = server_pids(server)
    before = set(folder.iterdir())
    with server.client() as c:
        started = c.post("/start_profile").json()
        assert started["silent"] == []
        assert {role: r["payload"] for role, r in replies_with_frontend(started).items()} == {
            role: {"started": True} for role in ROLES
        }
        generate(server, n=3, max_tokens=4)
        body = c.post("/stop_profile").json()
    stopped = replies_with_frontend(body)

    assert set(stopped) == ROLES
    written = set(folder.iterdir()) - before
    traces = traces_by_role(written)
    assert {role: pid for role, (pid, _) in traces.items()} == pids
    assert {Path(r["payload"]["trace"]).name for r in stopped.values()} | {Path(body["merged_trace"]).name} == {
        p.name for p in written
    }
    for role, (_, events) in traces.items():
        assert events, f"{role}'s trace has no events"
    assert named(traces["scheduler"][1], "Scheduler.schedule")
    assert named(traces["gpu_worker"][1], "aten::embedding")


def test_every_trace_is_on_one_clock_with_a_marker_per_step_and_merged_into_one(tiny_server):
    server, folder = tiny_server, tiny_server.profile_dir
    files_before = set(folder.iterdir())
    with server.client() as c:
        before = epoch_us()
        assert c.post("/start_profile").status_code == 200
        assert c.post("/start_profile").status_code == 409
        generate(server, n=2, max_tokens=4)
        body = c.post("/stop_profile").json()
        after = epoch_us()
        assert c.post("/stop_profile").status_code == 409

    traces = {role: complete_events(r["payload"]["trace"]) for role, r in body["replies"].items()}
    assert not {Path(r["payload"]["trace"]) for r in body["replies"].values()} & files_before, "a run writes new files"
    for role, events in traces.items():
        assert all(before <= e["ts"] <= after for e in events), f"{role}'s trace is not on the Unix epoch clock"
    plans, steps = markers(traces["scheduler"], "plan"), markers(traces["gpu_worker"], "step")
    assert plans and steps
    # A plan that only releases finished requests may be sent as the last responses go out, and reach the
    # worker after /stop_profile did: the steps that computed tokens are the ones both sides saw.
    computing = [p for p in plans if p["args"]["rids"]]
    assert {p["args"]["step_id"] for p in computing} == {s["args"]["step_id"] for s in steps if s["args"]["rids"]}
    assert sum(p["args"]["prefill_tokens"] for p in plans) > 0 and sum(p["args"]["decode_tokens"] for p in plans) > 0
    by_id = {s["args"]["step_id"]: s for s in steps}
    for plan in computing:
        step = by_id[plan["args"]["step_id"]]
        assert step["args"]["tokens"] == plan["args"]["prefill_tokens"] + plan["args"]["decode_tokens"]
        assert step["args"]["rids"] == plan["args"]["rids"]
        assert plan["ts"] <= step["ts"], "a step runs after it is planned"

    merged = json.loads(Path(body["merged_trace"]).read_text())["traceEvents"]
    lanes = {e["pid"]: e["args"]["name"] for e in merged if e["ph"] == "M" and e["name"] == "process_name"}
    assert {name for name in lanes.values() if ":" not in name} == ROLES
    assert len([e for e in merged if e.get("cat") == "marker"]) == len(plans) + len(steps) + len(
        markers(traces["scheduler"], "result")
    )


def test_stats_report_busy_idle_and_messages_for_every_process(tiny_server):
    server = tiny_server
    generate(server, n=2, max_tokens=2)  # consecutive request ids: one for each tokenizer worker (rid % 2)
    with server.client() as c:
        stats = replies_with_frontend(c.get("/stats").json())
    assert set(stats) == ROLES
    for role, reply in stats.items():
        summary = reply["payload"]
        assert set(summary) >= SUMMARY_KEYS, role
        assert summary["messages_in"] > 0 and summary["messages_out"] > 0, role
        assert 0 < summary["busy_s"] <= summary["uptime_s"] and 0 <= summary["busy_pct"] <= 100, role
    assert stats["scheduler"]["payload"]["steps"] > 0  # the scheduling counters are still there


def test_the_scheduler_times_each_link_from_a_steps_tokens_to_the_next_launch(tiny_server):
    """scheduler/step_chain.py: the result's trip, the scheduler's turnaround, the plan's trip (timed by the worker
    from the plan's send time) and the worker's launch, summed per step."""
    server = tiny_server
    with server.client() as c:
        before = c.get("/stats").json()["replies"]["scheduler"]["payload"]
        generate(server, n=4, max_tokens=8)
        after = c.get("/stats").json()["replies"]["scheduler"]["payload"]
    results = after["chain_results"] - before["chain_results"]
    assert results >= after["steps"] - before["steps"] > 0  # every step's result (release-only plans too)
    assert after["chain_plans"] > before["chain_plans"]
    for link in ("result_transit_s", "scheduler_s", "plan_transit_s", "worker_launch_s"):
        assert after[f"chain_{link}"] > before[f"chain_{link}"], link


def test_every_process_froze_its_startup_objects_and_reports_its_collector_pauses(tiny_server):
    """Start-up's objects (torch and the model in the GPU worker) are out of the cyclic collector's sight, so a
    full collection traverses only what requests left; the pauses it does take are counted (common/garbage.py)."""
    server = tiny_server
    generate(server, n=4, max_tokens=8)
    with server.client() as c:
        stats = replies_with_frontend(c.get("/stats").json())
    assert set(stats) == ROLES
    for role, reply in stats.items():
        summary = reply["payload"]
        assert summary["gc_frozen_objects"] > 0, role
        assert summary["gc_collections"] >= summary["gc_full_collections"] >= 0, role
        assert summary["gc_pause_s"] >= summary["gc_max_pause_ms"] / 1e3 >= 0, role
    # The worker has the most to freeze: torch and the model's modules.
    assert stats["gpu_worker"]["payload"]["gc_frozen_objects"] > stats["scheduler"]["payload"]["gc_frozen_objects"]


def profiling_server(model, tmp_path: Path, steps: int) -> tuple[ServerProcess, Path]:
    """A server that profiles its first `steps` steps into a folder of its own."""
    folder = tmp_path / "traces"
    flags = ["--num-kv-blocks", "64", "--profile-dir", str(folder), "--profile-steps", str(steps)]
    return ServerProcess(model, *flags, "--tokenizer-workers", "1", log_path=tmp_path / "server.log"), folder


def test_profile_steps_profiles_that_many_steps_in_every_process_then_stops(tiny_llama, tmp_path):
    server, folder = profiling_server(tiny_llama, tmp_path, steps=3)
    try:
        pids = server_pids(server)
        generate(server, n=1, max_tokens=8)  # 8 steps: the window closes after the third
        traces = wait_until(
            lambda: all_traces_written(folder, len(pids)), timeout=60, what="a trace from every process"
        )
        assert {role: pid for role, (pid, _) in traces.items()} == pids
        for role, (_, events) in traces.items():
            assert events, f"{role}'s trace has no events"
        # One embedding lookup per forward: the worker's window held exactly the three steps.
        assert len(named(traces["gpu_worker"][1], "aten::embedding")) == 3
    finally:
        server.stop()


def test_a_server_stopped_as_its_profile_window_closes_leaves_every_trace_whole(tiny_llama, tmp_path):
    # The window closes on the run's last step and the server is stopped at once, as a benchmark does: each
    # process finishes writing its trace before it exits (a SIGTERM used to cut the GPU worker's in half).
    server, folder = profiling_server(tiny_llama, tmp_path, steps=4)
    try:
        processes = len(server_pids(server))
        generate(server, n=1, max_tokens=4)
    finally:
        assert server.stop() == 0
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".trace.json")) == []
    traces = traces_by_role(folder.iterdir())  # every file parses
    assert len(traces) == processes
    assert len(named(traces["gpu_worker"][1], "aten::embedding")) == 4


def test_a_profile_still_open_when_the_server_stops_is_written_by_every_process(tiny_llama, tmp_path):
    folder = tmp_path / "traces"
    server = ServerProcess(
        tiny_llama, "--num-kv-blocks", "64", "--profile-dir", str(folder), log_path=tmp_path / "server.log"
    )
    try:
        processes = len(server_pids(server))
        with server.client() as c:
            assert c.post("/start_profile").status_code == 200
        generate(server, n=1, max_tokens=3)
    finally:
        assert server.stop() == 0  # no /stop_profile: the window is open when SIGTERM comes
    traces = traces_by_role(folder.glob("*.trace.json"))
    assert len(traces) == processes and all(events for _, events in traces.values())


def test_a_sigterm_while_a_trace_is_written_ends_the_process_once_it_is_whole(tmp_path):
    profiler = PythonProfiler()
    profiler.start(str(tmp_path), "unit")
    inner(1)
    previous = signal.signal(signal.SIGTERM, process_module._exit_on_sigterm)  # as every child installs it
    written = profiler._stop_and_write

    def write_then_receive_sigterm(path: str) -> None:
        written(path)
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher stopping the server mid-write

    profiler._stop_and_write = write_then_receive_sigterm  # type: ignore[method-assign]
    try:
        with pytest.raises(SystemExit) as stopped:
            profiler.stop()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 0
    (trace,) = tmp_path.iterdir()
    assert trace.name.endswith("-1.trace.json")
    (call,) = named(complete_events(trace), "inner")
    assert abs(call["ts"] - epoch_us()) < 60e6  # rewritten to the common clock: the trace was finished


@pytest.mark.parametrize("kind", [PythonProfiler, TorchProfiler])
def test_a_trace_file_is_readable_by_its_owner_only(tmp_path, kind):
    # A trace shows what the server ran, prompts' token ids included.
    profiler = kind()
    profiler.start(str(tmp_path), "unit")
    inner(1)
    path = profiler.stop()
    assert os.stat(path).st_mode & 0o777 == 0o600
