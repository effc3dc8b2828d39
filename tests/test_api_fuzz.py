"""API fuzzing: schemathesis generates requests from the server's own OpenAPI schema (request bodies
included, integer bounds and all: frontend/app.py) and sends them to a real server. Whatever it sends,
the answer is never a 5xx, and the server is healthy afterwards.

The server is the session's guarded_server (tests/conftest.py): its engine runs no model (--load-format
null: placeholder tokens at once), so a generated request for n=128 choices of thousands of tokens costs
milliseconds, not minutes."""

from __future__ import annotations

from collections import Counter

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

# Per operation and mode (18 runs): Hypothesis draws the simplest case first and weights integers towards their
# bounds, so the edges come early (40 cost twice the CPU).
EXAMPLES_PER_OPERATION = 20
BODIES = {"/v1/completions", "/v1/chat/completions", "/generate", "/tokenize", "/detokenize"}


@pytest.fixture
def fuzz_server(guarded_server):
    return guarded_server


def test_no_generated_request_gets_a_server_error(fuzz_server):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= BODIES
    failures = []
    statuses: Counter = Counter()
    # Bodies in the schema, and (for the operations that take one) bodies outside it: wrong types, integers
    # past their bounds, missing fields.
    runs = [(op, schemathesis.GenerationMode.POSITIVE) for op in operations]
    runs += [(op, schemathesis.GenerationMode.NEGATIVE) for op in operations if op.path in BODIES]
    for operation, mode in runs:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck))
        def call(case) -> None:
            response = case.call(base_url=fuzz_server.url, timeout=60)
            statuses[(case.path, response.status_code)] += 1
            if response.status_code >= 500:
                failures.append((case.method, case.path, case.body, response.status_code, response.text[:300]))

        call()
    assert failures == []
    assert statuses  # every operation was called


def test_the_server_is_healthy_after_the_fuzzing(fuzz_server):
    with fuzz_server.client() as c:
        assert c.get("/health").status_code == 200
        scheduler = c.get("/stats").json()["replies"]["scheduler"]["payload"]
        assert scheduler["num_running"] == 0 and scheduler["num_waiting"] == 0
    assert "Traceback" not in fuzz_server.log()
