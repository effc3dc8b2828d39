"""The whole server through real processes, real sockets and real HTTP: the official openai client,
streaming text that matches the in-process engine, multi-byte UTF-8, disconnects, bad input, queue
limits, and the lifecycle (a killed child stops everything; signals shut down cleanly; no orphans)."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from common.sampling_params import SamplingParams
from frontend.protocol import ChatCompletionRequest
from offline import LLM
from tests.server_process import ServerProcess, pid_alive, wait_until
from tests.tiny_models import build_scripted_model

PROMPTS = [
    "def main():",
    "import json\n",
    "The quick",
    "class Foo",
    "return None",
    "for i in range(",
    "if __name__",
    "print(",
    "x = [",
    "while True:",
    "try:\n",
    "with open(",
    "lambda x:",
    "yield",
    "# a",
    "os.",
]


@pytest.fixture
def server(tiny_server):
    """The session's shared tiny server (tests/conftest.py): the tiny Llama, 256 KV blocks."""
    return tiny_server


def openai_client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_sixteen_concurrent_openai_streams_match_the_in_process_engine(server, tiny_llama):
    expected = [
        o.text
        for o in LLM(str(tiny_llama), device="cpu").generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0))
    ]
    model = openai_client(server).models.list().data[0].id

    def complete(i: int) -> str:
        client = openai_client(server)
        if i % 2:
            return (
                client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=24, temperature=0).choices[0].text
            )
        stream = client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=24, temperature=0, stream=True)
        return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(complete, range(16))) == expected


def test_chat_completion_streams_with_usage(server):
    client = openai_client(server)
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens <= 5 and chunks[-1].usage.prompt_tokens > 0
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["length"], ["stop"])
    assert isinstance(text, str)


def test_client_disconnect_frees_the_requests_blocks(server):
    with (
        server.client() as c,
        c.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "disconnect me", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True},
        ) as r,
    ):
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert server.stats()["scheduler"]["payload"]["num_running"] == 1
    # Closing the stream mid-generation aborts the request; its blocks are released before the next plan.
    wait_until(
        lambda: (lambda s: s["num_running"] == 0 and s["kv_blocks_used"] == 0)(server.stats()["scheduler"]["payload"]),
        timeout=10,
        what="the aborted request's blocks to be freed",
    )


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x " * 600, "max_tokens": 4}, "prompt"),  # longer than the 512-token context
        ({"prompt": "hello", "max_tokens": 100000}, "max_tokens"),
        ({"prompt": "", "max_tokens": 4}, "prompt"),
        ({"prompt": "hello", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hello", "temperature": -1}, "temperature"),
        ({"prompt": "hello", "top_p": 1.5}, "top_p"),
        ({"prompt": 3}, "prompt"),
    ],
)
def test_bad_input_gets_400_naming_the_field_and_the_server_keeps_serving(server, body, param):
    with server.client() as c:
        response = c.post("/v1/completions", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        assert c.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2}).status_code == 200


LIBRARY_INTERNALS = re.compile(r"\.(cc|cpp|h|py|so)\b|/project/|Check failed|Traceback| object at 0x")
BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"tools": [BAD_TOOL], "tool_choice": "required"}, "tools"),
        (
            "/v1/chat/completions",
            {"tools": [BAD_TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tools",
        ),
        (
            "/v1/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
            "response_format",
        ),
        ("/v1/completions", {"guided_regex": "(unclosed"}, "guided_regex"),
        ("/v1/completions", {"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs"),
    ],
    ids=["required-tool", "named-tool", "json-schema", "regex", "grammar"],
)
def test_a_library_refusal_names_the_field_in_the_librarys_words_without_its_internals(server, path, body, param):
    """xgrammar's message, without its C++ source file and line, or its checks."""
    base = {"messages": [{"role": "user", "content": "hi"}]} if path.endswith("chat/completions") else {"prompt": "hi"}
    with server.client() as c:
        response = c.post(path, json={**base, **body, "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert not LIBRARY_INTERNALS.search(error["message"]), error["message"]


def test_large_bodies_posted_at_once_do_not_hold_up_health(server):
    """Four 15 MB bodies of 500,000 chat content parts (under the 16 MiB default body limit): parsed on the
    frontend's event loop, each held it as long as parsing it takes, and /health waited behind them. Counted
    off the loop, each is a 400, and /health answers meanwhile: within half of what parsing one of them costs on
    this machine (measured here, idle, on a tenth of one: the cost is per value). Waiting behind one parse would
    take all of it, behind the four up to four times; the polls run beside the four bodies' transfer and
    counting on the same cores, hence half, not less (a quarter failed once in ~10 full-suite runs on 2 cores)."""
    parts = 500_000
    tenth = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * (parts // 10)}]})
    started = time.monotonic()
    ChatCompletionRequest.model_validate_json(tenth)
    parse_one_s = 10 * (time.monotonic() - started)
    body = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * parts}]})
    health: list[float] = []
    done = threading.Event()

    def poll_health() -> None:
        with server.client() as c:
            while not done.is_set():
                started = time.monotonic()
                assert c.get("/health").status_code == 200
                health.append(time.monotonic() - started)

    def post(_: int) -> tuple[int, str | None]:
        with server.client() as c:
            response = c.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        return response.status_code, response.json()["error"]["param"]

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(post, range(4)))
    finally:
        done.set()
        poller.join()
    assert answers == [(400, "messages")] * 4
    assert max(health) < parse_one_s / 2, (max(health), parse_one_s)


def test_a_model_not_served_raises_the_openai_clients_not_found_error(server):
    with pytest.raises(openai.NotFoundError, match="The model `no-such-model` does not exist"):
        openai_client(server).completions.create(model="no-such-model", prompt="hello", max_tokens=2)


def test_invalid_json_gets_400(server):
    with server.client() as c:
        response = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert response.status_code == 400
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_health_and_metrics_report_every_process(server):
    with server.client() as c:
        assert c.get("/health").status_code == 200
        metrics = c.get("/metrics").text
    assert "clearserve_kv_blocks_total 256.0" in metrics
    assert "clearserve_time_to_first_token_seconds_count" in metrics
    assert set(server.child_pids()) == {"gpu_worker", "scheduler", "tokenizer-0", "tokenizer-1", "frontend-0"}


def test_each_process_is_named_by_its_role_in_ps_and_top(server):
    """`pgrep -x scheduler`, top and py-spy show the role, not `python -c from multiprocessing.spawn ...`."""
    for role, pid in server.child_pids().items():
        with open(f"/proc/{pid}/comm") as f:
            assert f.read().strip() == role


def test_native_generate_streams_token_ids_with_timestamps(server):
    with (
        server.client() as c,
        c.stream(
            "POST",
            "/generate",
            json={
                "input_ids": [5, 6, 7],
                "stream": True,
                "sampling_params": {"max_tokens": 4, "temperature": 0, "ignore_eos": True},
            },
        ) as r,
    ):
        events = [json.loads(line) for line in r.iter_lines() if line]
    tokens = [e for e in events if "token_ids" in e and "times" not in e]
    assert sum(len(e["token_ids"]) for e in tokens) == 4
    assert all(e["sampled_time"] <= e["streamed_time"] for e in tokens)
    times = events[-1]["times"]
    assert times["arrival"] <= times["tokenized"] <= times["queued"] <= times["first_scheduled"]


# ---------------------------------------------------------------------------- scripted output

# Multi-byte characters cut at every kind of boundary: single bytes of a 4-byte emoji, a 3-byte CJK
# character split 1+2, whole-character tokens, and a stop string made of CJK text.
SCRIPT_TEXT = "🚀天气很好。"


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("scripted")
    from tests.tiny_models import build_tokenizer

    build_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    byte_token = {b: tokenizer.convert_tokens_to_ids(ch) for b, ch in _byte_to_unicode().items()}
    # Starts from an ASCII token (the prompt), then the emoji's four bytes one token each, then the
    # tokenizer's own split of the CJK text.
    chain = tokenizer.encode("x") + [byte_token[b] for b in "🚀".encode()] + tokenizer.encode("天气很好。")
    assert len(set(chain)) == len(chain), chain
    build_scripted_model(folder, chain)
    return folder, tokenizer, chain


def _byte_to_unicode() -> dict[int, str]:
    # GPT-2's byte-level alphabet: how a raw byte is written as a vocabulary entry.
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@pytest.fixture(scope="module")
def scripted_server(scripted, tmp_path_factory):
    """The scripted model, with one request running and one waiting at most: the multi-byte tests send one
    request at a time, the queue-limit test more (a start costs seconds of CPU: one server for both)."""
    folder, _, _ = scripted
    srv = ServerProcess(
        folder,
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "1",
        "--tokenizer-workers",
        "1",
        log_path=tmp_path_factory.mktemp("log") / "scripted.log",
    )
    yield srv
    srv.stop()


def test_multibyte_utf8_streams_exactly_whatever_the_token_boundaries(scripted, scripted_server):
    _, _, chain = scripted
    with (
        scripted_server.client() as c,
        c.stream(
            "POST",
            "/generate",
            json={"input_ids": [chain[0]], "stream": True, "sampling_params": {"max_tokens": 50, "temperature": 0}},
        ) as r,
    ):
        events = [json.loads(line) for line in r.iter_lines() if line]
    deltas = [e["text"] for e in events if "times" not in e]
    token_ids = [t for e in events if "times" not in e for t in e["token_ids"]]
    assert token_ids == chain[1:] + [0]  # the scripted walk, then EOS
    assert "".join(deltas) == SCRIPT_TEXT
    assert all("\ufffd" not in d for d in deltas), deltas


def test_multibyte_output_through_openai_streaming(scripted_server):
    client = openai_client(scripted_server)
    stream = client.completions.create(
        model=client.models.list().data[0].id, prompt="x", max_tokens=50, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert "".join(pieces) == SCRIPT_TEXT
    assert all("\ufffd" not in p for p in pieces)


def test_cjk_stop_string_ends_the_request(scripted_server):
    client = openai_client(scripted_server)
    out = client.completions.create(
        model=client.models.list().data[0].id, prompt="x", max_tokens=50, temperature=0, stop=["很好"]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == "🚀天气"


# ---------------------------------------------------------------------------- lifecycle


def test_past_the_queue_limit_requests_get_a_503(scripted_server):
    # (A killed child stopping everything: tests/test_fault_injection.py, for each role.) The scripted model
    # runs to max_tokens with EOS ignored: one request runs, one waits, the rest are refused.
    body = {"prompt": "busy", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(6) as pool:
        statuses = list(
            pool.map(
                lambda _: httpx.post(f"{scripted_server.url}/v1/completions", json=body, timeout=120).status_code,
                range(6),
            )
        )
    assert 503 in statuses and 200 in statuses and set(statuses) <= {200, 503}


# Last in the module: it ends the module's server (after all the traffic above), so that no server is started
# only to be stopped. (SIGINT, Ctrl-C, with streams open: tests/test_fault_injection.py.)
def test_sigterm_shuts_everything_down_cleanly(scripted_server):
    pids = scripted_server.child_pids()
    assert scripted_server.stop(signal.SIGTERM) == 0
    wait_until(lambda: not any(pid_alive(p) for p in pids.values()), timeout=10, what="every child to exit")
    log = scripted_server.log()
    assert "Loading weights" in log  # a progress bar ran (its lock was a process-shared semaphore once)...
    assert "leaked semaphore" not in log  # ...and nothing was left for the resource tracker to warn about


def test_start_up_logs_one_line_per_phase_with_its_time_and_one_weights_bar(server):
    log = server.log()
    for phase in (
        r"\[launcher pid=\d+\] model \S+ \(\d+\.\d s\)",
        r"\[gpu_worker pid=\d+\] weights loaded: \d+M parameters, torch.float32 on cpu \(\d+\.\d s\)",
        r"\[gpu_worker pid=\d+\] KV store: 256 blocks of 16 tokens, [\d.]+ GiB \(\d+\.\d s\)",
        r"\[gpu_worker pid=\d+\] warmed up: .* \(\d+\.\d s\)",
        r"clearserve ready on .* \(started in \d+\.\d s\)",
    ):
        assert len(re.findall(phase, log)) == 1, phase
    assert log.count("Loading weights:   0%") == 1, "one progress bar for the weights"
