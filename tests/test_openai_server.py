"""The OpenAI API's parameters through the real server on SmolLM2's real weights, with the official
openai client: each one's effect is asserted, logprobs against Hugging Face transformers' log_softmax on
the same weights (float32, CPU)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from pydantic import BaseModel

from tests.server_process import ServerProcess

MODEL = "smollm2"
TOLERANCE = 2e-3  # nats: float32, different kernels
USER = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


@pytest.fixture(scope="module")
def hf_model(smollm2_hf_model):
    return smollm2_hf_model


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is the distribution of the token after ids[: i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def tokenize(server: ServerProcess, **body) -> list[int]:
    with server.client() as c:
        return c.post("/tokenize", json=body).json()["tokens"]


def test_echo_with_logprobs_scores_a_list_of_token_prompts_like_transformers(server, client, hf_model):
    # lm-evaluation-harness's loglikelihood request: token-id prompts, echo, logprobs=1, max_tokens=1.
    prompts = [tokenize(server, prompt=text) for text in ("The capital of France is Paris", "1, 2, 3, 4, 5")]
    response = client.completions.create(
        model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    assert [c.index for c in response.choices] == [0, 1]
    for prompt, choice in zip(prompts, response.choices):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(prompt) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert "".join(lp.tokens) == choice.text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        generated = tokenize(server, prompt=choice.text, add_special_tokens=False)[len(prompt) :]
        ref = hf_logprobs(hf_model, prompt + generated)
        expected = [ref[i - 1, t].item() for i, t in enumerate(prompt + generated) if i > 0]
        assert lp.token_logprobs[1:] == pytest.approx(expected, abs=TOLERANCE)
        for i, top in enumerate(lp.top_logprobs[1:], start=1):
            assert len(top) == 1 and list(top.values())[0] == pytest.approx(ref[i - 1].max().item(), abs=TOLERANCE)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_and_top_logprobs_are_the_models(server, client, hf_model, stream):
    prompt = tokenize(server, messages=USER)
    kwargs = dict(model=MODEL, messages=USER, logprobs=True, top_logprobs=3, max_tokens=6, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        content = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, text = choice.logprobs.content, choice.message.content
    assert "".join(t.token for t in content) == text
    ids = tokenize(server, prompt=text, add_special_tokens=False)
    ref = hf_logprobs(hf_model, prompt + ids)
    for i, entry in enumerate(content):
        row = ref[len(prompt) - 1 + i]
        assert entry.logprob == pytest.approx(row.max().item(), abs=TOLERANCE), "greedy: the top token"
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row.topk(3).values.tolist(), abs=TOLERANCE)
        assert entry.bytes == list(entry.token.encode())


def test_n_samples_share_the_prompt_and_differ_by_seed(server, client):
    long_user = [{"role": "user", "content": "Tell me a story about a dragon and a knight. " * 6}]
    kwargs = dict(model=MODEL, messages=long_user, n=3, max_tokens=8, temperature=1.0, seed=11)
    before = server.stats()["scheduler"]["payload"]["cache_hit_tokens"]
    first = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len({c.message.content for c in first.choices}) > 1
    assert server.stats()["scheduler"]["payload"]["cache_hit_tokens"] - before >= 2 * 64, "prompt blocks reused"
    again = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in again.choices] == [c.message.content for c in first.choices]


def test_penalties_and_logit_bias_change_the_output(server, client):
    kwargs = dict(model=MODEL, prompt="one two one two one two one two", max_tokens=12, temperature=0)
    variants = [{}, {"extra_body": {"repetition_penalty": 5.0}}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}]
    # Sent together: decoded in one batch, a step costs what one request's does (float32 weights read once).
    with ThreadPoolExecutor(len(variants)) as pool:
        plain, *penalized = pool.map(lambda v: client.completions.create(**kwargs, **v).choices[0].text, variants)
    assert all(text != plain for text in penalized), (plain, penalized)
    [equals] = tokenize(server, prompt="=", add_special_tokens=False)
    biased = client.completions.create(**{**kwargs, "max_tokens": 3}, logit_bias={str(equals): 100}).choices[0]
    assert biased.text == "==="


def test_special_tokens_show_in_the_text_when_the_request_asks(server, client):
    # <|im_end|> is this model's end of turn, an EOS: ignored here, it is an output token like any other.
    [end] = tokenize(server, prompt="<|im_end|>", add_special_tokens=False)
    kwargs = dict(model=MODEL, prompt="hi", max_tokens=2, temperature=0, logit_bias={str(end): 100})
    with ThreadPoolExecutor(2) as pool:
        shown, dropped = pool.map(
            lambda extra: client.completions.create(**kwargs, extra_body={"ignore_eos": True, **extra}).choices[0],
            [{"skip_special_tokens": False}, {}],
        )
    assert (shown.text, dropped.text) == ("<|im_end|><|im_end|>", "")
    assert shown.finish_reason == dropped.finish_reason == "length"
    stopped = client.completions.create(**kwargs, extra_body={"skip_special_tokens": False}).choices[0]
    assert (stopped.text, stopped.finish_reason) == ("", "stop")  # the EOS it stopped on is not its text


def test_min_tokens_keeps_generating_past_eos(client):
    kwargs = dict(model=MODEL, messages=USER, temperature=0)
    short = client.chat.completions.create(**kwargs, max_tokens=100)
    assert short.choices[0].finish_reason == "stop"
    # Greedy again, EOS held back 5 tokens past where it came: exactly that many (not a longer free run after).
    wanted = short.usage.completion_tokens + 5
    longer = client.chat.completions.create(**kwargs, max_tokens=wanted, extra_body={"min_tokens": wanted})
    assert longer.usage.completion_tokens == wanted


class City(BaseModel):
    name: str
    country: str


def test_parse_with_a_pydantic_model_returns_a_parsed_object(client):
    response = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Give the capital of France as JSON with name and country."}],
        response_format=City,
        temperature=0,
        max_tokens=60,
    )
    city = response.choices[0].message.parsed
    assert isinstance(city, City) and city.name


def test_guided_choice_picks_one_of_the_choices(client):
    response = client.chat.completions.create(
        model=MODEL, messages=USER, temperature=1.0, seed=3, extra_body={"guided_choice": ["Paris", "Lyon"]}
    )
    assert response.choices[0].message.content in ("Paris", "Lyon")


def test_the_model_cards_root_is_the_folder_a_client_loads_the_tokenizer_from(server, smollm2_folder):
    # lm-eval's local-completions needs `tokenizer=`: the README finds it here, as with vLLM.
    from transformers import AutoTokenizer

    with server.client() as c:
        card = c.get("/v1/models/smollm2").json()
    assert card["root"] == str(smollm2_folder) and card["parent"] is None
    assert AutoTokenizer.from_pretrained(card["root"]).encode("Paris") == tokenize(
        server, prompt="Paris", add_special_tokens=False
    )


def test_tokenize_detokenize_and_version(server):
    with server.client() as c:
        ids = c.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
        assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == 1024
        assert c.post("/detokenize", json={"tokens": ids["tokens"]}).json() == {"prompt": "Hello world"}
        assert c.get("/version").json()["version"]


def test_unknown_and_unsupported_fields_are_refused_by_name(client):
    with pytest.raises(openai.BadRequestError, match="max_token"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"max_token": 5})
    with pytest.raises(openai.BadRequestError, match="function_call"):
        client.chat.completions.create(model=MODEL, messages=USER, function_call="auto")


def test_a_forced_tool_call_gives_arguments_that_follow_the_functions_schema(client):
    # Any model, a random tiny one too: the call's arguments are written under its parameters' grammar.
    city = {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": city}, "required": ["city"]},
        },
    }
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    kwargs = dict(model=MODEL, messages=USER, tools=[weather, clock], max_tokens=60, temperature=0)
    named = client.chat.completions.create(
        **kwargs, tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in city["enum"]
    required = client.chat.completions.create(**kwargs, tool_choice="required", parallel_tool_calls=False)
    assert required.choices[0].finish_reason == "tool_calls"
    [chosen] = required.choices[0].message.tool_calls
    assert chosen.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(chosen.function.arguments), dict)


def test_streamed_echo_and_logprobs_equal_the_whole_answer(client):
    kwargs = dict(model=MODEL, prompt="The capital of France is", echo=True, logprobs=2, max_tokens=5, temperature=0)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens] == whole.logprobs.tokens
    assert [v for lp in streamed for v in lp.token_logprobs] == whole.logprobs.token_logprobs
    assert [v for lp in streamed for v in lp.text_offset] == whole.logprobs.text_offset
    assert whole.text.startswith("The capital of France is")


def test_a_continued_final_message_is_counted_by_tokenize_as_chat_renders_it(server, client):
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    continued = tokenize(server, messages=messages, **options)
    closed = tokenize(server, messages=messages)  # the turn ended and a new assistant turn opened
    assert len(continued) < len(closed) and closed[: len(continued)] == continued
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, extra_body=options
    )
    assert response.usage.prompt_tokens == len(continued)
