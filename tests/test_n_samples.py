"""The n samples of a prompt compute it once: the first sample computes the prompt (and its prompt logprobs, with
echo and logprobs), the others find its full blocks in the prefix cache and take its prompt logprobs; every
choice is what the same request with n=1 and the sample's seed (seed + i) gives."""

from __future__ import annotations

import json

import pytest

from tests.tiny_models import random_prompts

BLOCK = 16  # the tiny server's block size
N = 4
ECHO_LOGPROBS = {"echo": True, "logprobs": 2}


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def completion(server, prompt: list[int], **fields) -> dict:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 100, **fields}
    with server.client() as c:
        response = c.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def prompt_tokens_computed(server) -> int:
    return server.stats()["scheduler"]["payload"]["prompt_tokens_computed"]


@pytest.mark.parametrize("fields", [{}, ECHO_LOGPROBS], ids=["plain", "echo_logprobs"])
def test_a_prompts_samples_compute_it_once(server, fields):
    [prompt] = random_prompts(1, [50], vocab=512, seed=31 + len(fields))
    before = prompt_tokens_computed(server)
    completion(server, prompt, n=N, **fields)
    last_block = len(prompt) - (len(prompt) - 1) // BLOCK * BLOCK  # what a prompt found in the cache computes
    assert prompt_tokens_computed(server) - before == len(prompt) + (N - 1) * last_block


@pytest.mark.parametrize("fields", [{}, ECHO_LOGPROBS], ids=["plain", "echo_logprobs"])
def test_each_sample_is_the_single_request_with_its_seed(server, fields):
    [prompt] = random_prompts(1, [50], vocab=512, seed=33 + len(fields))
    choices = completion(server, prompt, n=N, **fields)["choices"]
    for i, choice in enumerate(choices):
        alone = completion(server, prompt, seed=100 + i, **fields)["choices"][0]
        assert choice["text"] == alone["text"]
        if fields:
            assert choice["logprobs"]["tokens"] == alone["logprobs"]["tokens"]
            assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
                alone["logprobs"]["token_logprobs"][1:], abs=1e-4
            )


def test_streamed_samples_each_echo_the_prompt_with_its_logprobs(server):
    [prompt] = random_prompts(1, [40], vocab=512, seed=35)
    whole = completion(server, prompt, n=N, **ECHO_LOGPROBS)["choices"]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 100, "n": N, "stream": True}
    with server.client() as c:
        events = c.post("/v1/completions", json={**body, **ECHO_LOGPROBS}).text.split("\n\n")
    chunks = [json.loads(e[len("data: ") :]) for e in events if e.startswith("data: {")]
    for index in range(N):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == whole[index]["text"]
        tokens = [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]]
        assert tokens == whole[index]["logprobs"]["tokens"]
        first = mine[0]["logprobs"]
        assert first["token_logprobs"][0] is None and len(first["tokens"]) > len(prompt), "the prompt's, then more"
