"""API fuzzing: schemathesis generates requests from the server's own OpenAPI schema (request bodies
included, integer bounds and all: frontend/app.py) and sends them to a real server. Whatever it sends,
the answer is never a 5xx, and the server is healthy afterwards. Beside it, Hypothesis draws what the schema's
draws seldom combine: structured output of every kind and field, well formed or not, with n > 1, streamed or not;
every answer is a 200 whose n choices all end, or a 4xx.

The server is the session's guarded_server (tests/conftest.py): its engine runs no model (--load-format
null: placeholder tokens at once), so a generated request for n=128 choices of thousands of tokens costs
milliseconds, not minutes."""

from __future__ import annotations

import json
from collections import Counter

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

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


# Structured output and n > 1 drawn together, which the schema's own draws seldom combine: grammars of every kind,
# well formed or not, by each field that carries one, on both endpoints, streamed or not.
GRAMMAR_TEXT = st.text(alphabet='ab()[]{}|*+?.^$\\:=" 0123', max_size=16)
JSON_SCHEMAS = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "boolean", "null", "foo", 5])}),
    lambda inner: st.fixed_dictionaries(
        {"type": st.sampled_from(["object", "array"]), "properties": st.dictionaries(st.sampled_from("abc"), inner)}
    ),
    max_leaves=4,
)
STRUCTURED = st.one_of(
    st.builds(lambda c: {"structured_outputs": {"choice": c}}, st.lists(GRAMMAR_TEXT, min_size=1, max_size=4)),
    st.builds(lambda r: {"structured_outputs": {"regex": r}}, GRAMMAR_TEXT),
    st.builds(lambda g: {"structured_outputs": {"grammar": f"root ::= {g}"}}, GRAMMAR_TEXT),
    st.builds(lambda s: {"structured_outputs": {"json": s}}, JSON_SCHEMAS),
    st.builds(lambda r: {"guided_regex": r}, GRAMMAR_TEXT),
    st.builds(lambda c: {"guided_choice": c}, st.lists(GRAMMAR_TEXT, min_size=1, max_size=4)),
    st.builds(
        lambda s: {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": s}}}, JSON_SCHEMAS
    ),
    st.just({"response_format": {"type": "json_object"}}),
)


@given(
    structured=STRUCTURED,
    n=st.integers(1, 6),
    stream=st.booleans(),
    chat=st.booleans(),
    max_tokens=st.integers(1, 12),
)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_structured_output_with_n_samples_gets_no_server_error_and_every_choice_ends(
    guarded_server, structured, n, stream, chat, max_tokens
):
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    body = {**prompt, **structured, "n": n, "stream": stream, "max_tokens": max_tokens}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with guarded_server.client() as c:
        if not stream:
            response = c.post(path, json=body)
            event(f"HTTP {response.status_code}")  # (--hypothesis-show-statistics)
            assert response.status_code < 500, response.text
            if response.status_code == 200:
                choices = response.json()["choices"]
                assert sorted(choice["index"] for choice in choices) == list(range(n))
                assert all(choice["finish_reason"] for choice in choices)
            return
        with c.stream("POST", path, json=body) as response:
            lines = list(response.iter_lines())
    event(f"HTTP {response.status_code}")
    assert response.status_code < 500, lines
    if response.status_code == 200:
        events = [json.loads(line[5:]) for line in lines if line.startswith("data:") and "[DONE]" not in line]
        assert any(line == "data: [DONE]" for line in lines), lines[-3:]
        assert not any("error" in event for event in events), events
        finished = {c["index"] for event in events for c in event.get("choices", []) if c.get("finish_reason")}
        assert finished == set(range(n))


def test_the_server_is_healthy_after_the_fuzzing(fuzz_server):
    with fuzz_server.client() as c:
        assert c.get("/health").status_code == 200
        scheduler = c.get("/stats").json()["replies"]["scheduler"]["payload"]
        assert scheduler["num_running"] == 0 and scheduler["num_waiting"] == 0
    assert "Traceback" not in fuzz_server.log()
