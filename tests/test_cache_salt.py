"""vLLM's cache_salt: a prompt's prefix-cache entries are shared only among requests of the same salt, so a
client cannot learn from cached_tokens (or from timing) what another client sent; outputs never change."""

from __future__ import annotations

import pytest

from common.sampling_params import InvalidParameter, SamplingParams
from offline import LLM
from tests.tiny_models import random_prompts

SAMPLED = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), device="cpu", dtype="float32", block_size=16)


def cached_tokens(llm: LLM, prompt: list[int], salt: str | None) -> int:
    before = llm.scheduler.stats.cache_hit_tokens
    llm.generate([prompt], SAMPLED, on_step=llm.scheduler.check_integrity, cache_salt=[salt])
    return llm.scheduler.stats.cache_hit_tokens - before


def test_a_prompt_is_served_from_the_cache_only_under_its_own_salt(llm):
    [prompt] = random_prompts(1, [50], vocab=512, seed=21)
    assert cached_tokens(llm, prompt, "a") == 0
    assert cached_tokens(llm, prompt, "b") == 0, "another salt does not see it"
    assert cached_tokens(llm, prompt, None) == 0, "nor does a request without a salt"
    assert cached_tokens(llm, prompt, "a") == 48, "its own salt does: the full blocks but the last token's"
    assert cached_tokens(llm, prompt, None) == 48, "requests without a salt share among themselves"


def test_a_salt_leaves_the_tokens_unchanged(llm):
    [prompt] = random_prompts(1, [40], vocab=512, seed=22)
    plain = llm.generate([prompt], SAMPLED)[0].token_ids
    salted = llm.generate([prompt, prompt], SAMPLED, cache_salt=["a", "a"])  # the second one from the cache
    assert [o.token_ids for o in salted] == [plain, plain]


def test_an_empty_salt_is_refused_naming_it(llm):
    with pytest.raises(InvalidParameter) as refused:
        llm.generate([[1, 2, 3]], SAMPLED, cache_salt=[""])
    assert refused.value.field == "cache_salt"


# ---------------------------------------------------------------- through the server


def usage_and_text(server, prompt: list[int], **fields) -> tuple[int, str]:
    with server.client() as c:
        body = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0, **fields}).json()
    return body["usage"]["prompt_tokens_details"]["cached_tokens"], body["choices"][0]["text"]


def test_cached_tokens_never_show_another_clients_salted_prompt(tiny_server):
    [prompt] = random_prompts(1, [50], vocab=512, seed=23)
    first = usage_and_text(tiny_server, prompt, cache_salt="client-a")
    other = usage_and_text(tiny_server, prompt, cache_salt="client-b")
    unsalted = usage_and_text(tiny_server, prompt)
    again = usage_and_text(tiny_server, prompt, cache_salt="client-a")
    assert [first[0], other[0], unsalted[0], again[0]] == [0, 0, 0, 48]
    assert first[1] == other[1] == unsalted[1] == again[1]


def test_chat_takes_a_cache_salt_too(tiny_server):
    messages = [{"role": "user", "content": "salted chat " * 12}]
    body = {"messages": messages, "max_tokens": 2, "temperature": 0, "cache_salt": "client-c"}
    with tiny_server.client() as c:
        first, again = (c.post("/v1/chat/completions", json=body).json()["usage"] for _ in range(2))
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["prompt_tokens_details"]["cached_tokens"] > 0
