"""vLLM's load generator, guidellm, against the server: the README's command (Benchmarks, "guidellm") with a
few requests, on the shared tiny server. Its tokenizer is the model card's `root` (GET /v1/models).

guidellm is not in the test extra: it pins click 8.4 (this project's venv has 8.5), its sanic pins multidict
below 7, and it brings a torch of its own. Install it in a venv of its own and name its CLI in GUIDELLM
(`GUIDELLM=/path/to/venv/bin/guidellm`), or have `guidellm` importable here or on PATH."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.util import find_spec

import pytest

REQUESTS = 3
PROMPT_TOKENS = 16
OUTPUT_TOKENS = 8
RUN_TIMEOUT_S = 600  # the CLI imports torch and transformers; on a loaded 2-core machine that takes a while


def guidellm_command() -> list[str] | None:
    if os.environ.get("GUIDELLM"):
        return [os.environ["GUIDELLM"]]
    if find_spec("guidellm") is not None:
        return [sys.executable, "-m", "guidellm"]
    found = shutil.which("guidellm")
    return [found] if found else None


GUIDELLM = guidellm_command()
pytestmark = pytest.mark.skipif(
    GUIDELLM is None,
    reason="guidellm is not installed (not importable, not on PATH, GUIDELLM unset): it is kept out of the test "
    "extra, whose pins it breaks; see this module's docstring",
)


def test_guidellm_reports_every_request_successful(tiny_server, tmp_path):
    with tiny_server.client() as client:
        root = client.get("/v1/models").json()["data"][0]["root"]
    report = tmp_path / "guidellm.json"
    command = [
        *GUIDELLM,
        "run",
        f"--backend=kind=openai_http,target={tiny_server.url},request_format=/v1/completions",
        f"--tokenizer=kind=huggingface_auto,model={root}",
        f"--data=kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--profile=kind=synchronous",
        f"--constraint=kind=max_requests,count={REQUESTS}",
        f"--output=kind=json,path={report}",
        "--disable-progress",
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    benchmark = json.loads(report.read_text())["benchmarks"][0]
    assert benchmark["metrics"]["request_totals"] == {
        "successful": REQUESTS,
        "errored": 0,
        "incomplete": 0,
        "total": REQUESTS,
    }
    successful = benchmark["requests"]["successful"]
    assert [r["output_tokens"] for r in successful] == [OUTPUT_TOKENS] * REQUESTS
    assert all(r["prompt_tokens"] == PROMPT_TOKENS for r in successful)
