"""The engine's sampling parameters end to end (scheduler, plans, model runner), against Hugging Face
transformers on the same weights (float32, CPU): logprobs and prompt logprobs are its log_softmax,
penalties change the distribution as their formulas say, and a seeded request with penalties, bias and
min-p gives the same tokens alone, batched, chunked and preempted."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace

import pytest
import torch

from common.sampling_params import SamplingParams
from gpu_worker import logprobs
from offline import LLM
from tests.tiny_models import random_prompts

TOLERANCE = 1e-4  # nats, float32


def make_llm(folder, **args) -> LLM:
    return LLM(str(folder), device="cpu", dtype="float32", **args)


def generate(llm: LLM, prompts, params):
    return llm.generate(prompts, params, on_step=llm.scheduler.check_integrity)


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_logprobs_and_prompt_logprobs_are_the_models_log_softmax(tiny_llama, hf_model, monkeypatch):
    # Prompt logits are made a few rows at a time: 3 here, so that a chunk takes several slices.
    monkeypatch.setattr(logprobs, "PROMPT_LOGPROBS_ROWS", 3)
    prompts = random_prompts(3, [13, 6, 21], vocab=512, seed=5)
    # A small prompt budget chunks the prompts: prompt logprobs arrive over several steps.
    llm = make_llm(tiny_llama, block_size=4, max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    for prompt, out in zip(prompts, generate(llm, prompts, params)):
        ids = prompt + out.token_ids
        ref = torch.log_softmax(hf_logits(hf_model, ids), dim=-1)
        scored = out.prompt_logprobs
        assert scored.start == 0 and scored.token_ids == prompt
        assert math.isnan(scored.logprobs[0]) and scored.top_ids[0] == [], "the first token has no logprob"
        expected = [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
        assert scored.logprobs[1:] == pytest.approx(expected, abs=TOLERANCE)
        assert [len(top) for top in scored.top_ids[1:]] == [2] * (len(prompt) - 1)
        assert scored.top_ids[1] == ref[0].topk(2).indices.tolist()
        generated = out.logprobs
        assert generated.token_ids == out.token_ids
        rows = [len(prompt) - 1 + i for i in range(len(out.token_ids))]
        assert generated.logprobs == pytest.approx(
            [ref[r, t].item() for r, t in zip(rows, ids[len(prompt) :])], abs=TOLERANCE
        )
        for r, top_ids, top_lps in zip(rows, generated.top_ids, generated.top_logprobs):
            assert top_ids == ref[r].topk(3).indices.tolist()
            assert top_lps == pytest.approx(ref[r].topk(3).values.tolist(), abs=TOLERANCE)


def test_logprobs_follow_the_temperature_and_the_penalties(tiny_llama, hf_model):
    [prompt] = random_prompts(1, [9], vocab=512, seed=6)
    params = SamplingParams(
        max_tokens=8,
        temperature=0.7,
        seed=3,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        ignore_eos=True,
        logprobs=1,
    )
    [out] = generate(make_llm(tiny_llama), [prompt], params)
    for i, token in enumerate(out.token_ids):
        logits = hf_logits(hf_model, prompt + out.token_ids[:i])[-1]
        previous = out.token_ids[:i]
        for t in set(prompt + previous):
            logits[t] = logits[t] / 1.3 if logits[t] > 0 else logits[t] * 1.3
        for t in set(previous):
            logits[t] -= 0.5 * previous.count(t) + 1.5
        expected = torch.log_softmax(logits / 0.7, dim=-1)[token].item()
        assert out.logprobs.logprobs[i] == pytest.approx(expected, abs=TOLERANCE)


def test_repetition_and_frequency_penalties_stop_greedy_repetition(tiny_llama):
    prompts = random_prompts(4, [5, 9, 14, 7], vocab=512, seed=7)
    plain = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    penalized = SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, frequency_penalty=2.0, repetition_penalty=5.0
    )
    llm = make_llm(tiny_llama)
    repeats = [len(o.token_ids) - len(set(o.token_ids)) for o in generate(llm, prompts, plain)]
    fewer = [len(o.token_ids) - len(set(o.token_ids)) for o in generate(llm, prompts, penalized)]
    assert sum(fewer) < sum(repeats)


def test_min_tokens_holds_eos_back_and_logit_bias_steers(tiny_llama):
    [prompt] = random_prompts(1, [8], vocab=512, seed=8)
    llm = make_llm(tiny_llama)
    eos_now = SamplingParams(max_tokens=10, temperature=0.0, logit_bias={0: 100.0})  # 0 is the tiny models' EOS
    [out] = generate(llm, [prompt], eos_now)
    assert out.token_ids == [0] and out.finish_reason == "stop"
    [out] = generate(llm, [prompt], SamplingParams(max_tokens=10, temperature=0.0, logit_bias={0: 100.0}, min_tokens=4))
    assert len(out.token_ids) == 5 and 0 not in out.token_ids[:4] and out.token_ids[4] == 0


def test_seeded_penalties_bias_and_min_p_survive_batching_chunking_and_preemption(tiny_llama):
    prompts = random_prompts(5, [20, 33, 7, 41, 15], vocab=512, seed=12)
    params = [
        SamplingParams(
            max_tokens=20,
            temperature=0.9,
            min_p=0.05,
            seed=100 + i,
            ignore_eos=True,
            presence_penalty=0.5 * i / 4,
            frequency_penalty=0.3,
            repetition_penalty=1.0 + 0.1 * i,
            logit_bias={5: 3.0, 6: -3.0},
            logprobs=2,
        )
        for i in range(len(prompts))
    ]
    alone = [generate(make_llm(tiny_llama), [p], [sp])[0] for p, sp in zip(prompts, params)]
    tight = make_llm(tiny_llama, block_size=4, num_kv_blocks=24, max_num_batched_tokens=16)
    crowded = generate(tight, prompts, params)
    assert tight.scheduler.stats.preemptions > 0
    assert [o.token_ids for o in crowded] == [o.token_ids for o in alone]
    for a, b in zip(crowded, alone):
        assert a.logprobs.logprobs == pytest.approx(b.logprobs.logprobs, abs=TOLERANCE)


def test_generate_without_sampling_params_uses_the_models_generation_defaults(tiny_llama, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "top_k": 7}))
    llm = LLM(str(model), device="cpu", dtype="float32", num_kv_blocks=32)
    defaults = llm.default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.0, 7, SamplingParams().top_p)
    prompts = random_prompts(2, [5, 9], vocab=512, seed=5)
    greedy = SamplingParams(max_tokens=defaults.max_tokens, temperature=0.0, top_k=7)
    assert [o.token_ids for o in llm.generate(prompts)] == [o.token_ids for o in llm.generate(prompts, greedy)]


def test_chat_renders_each_conversation_as_the_server_does_and_generates_it(tiny_llama):
    from common.messages import ChatTemplateOptions
    from tokenizer_worker.tokenizer import Tokenizer

    conversations = [
        [{"role": "user", "content": "hello"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "well"}],
    ]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    continued = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True)
    renderer = Tokenizer.load(tiny_llama)
    with LLM(str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=32) as llm:
        one = llm.chat(conversations[0], greedy)
        both = llm.chat(conversations, greedy)
        last = llm.chat(conversations[1], greedy, continued)
        expected = llm.generate([renderer.render_chat(conversations[1], continued)], greedy)
    assert one[0].prompt_token_ids == renderer.render_chat(conversations[0]) == both[0].prompt_token_ids
    assert one[0].token_ids == both[0].token_ids
    assert one[0].text == renderer.hf.decode(one[0].token_ids, skip_special_tokens=True)
    assert last[0].prompt_token_ids != both[1].prompt_token_ids  # left open, not a new assistant turn
    assert last[0].token_ids == expected[0].token_ids


def test_output_text_shows_special_tokens_as_asked_and_not_the_token_that_stopped_it(tiny_llama):
    # As the server's tokenizer workers make it (and vLLM): the token the engine stopped on stays in token_ids only.
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=32) as llm:
        end = llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
        forced = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logit_bias={end: 100.0})
        shown, dropped = llm.generate(["hi", "hi"], [replace(forced, skip_special_tokens=False), forced])
        free = llm.generate(["hi"], greedy)[0]
        stop = free.token_ids[1]
        stopped = llm.generate(["hi"], replace(greedy, stop_token_ids=[stop]))[0]
    assert shown.token_ids == dropped.token_ids == [end] * 3
    assert (shown.text, dropped.text) == ("<|im_end|>" * 3, "")
    kept = free.token_ids[: free.token_ids.index(stop)]
    assert (stopped.token_ids, stopped.finish_reason, stopped.stop_reason) == (kept + [stop], "stop", stop)
    assert stopped.text == llm.tokenizer.decode(kept, skip_special_tokens=True)


def test_a_stop_string_ends_generation_and_the_text_before_it(tiny_llama):
    """As the server's tokenizer workers do (and vLLM's LLM.generate): generation stops at the first stop
    string, which is left out of the text unless include_stop_str_in_output; prompts of token ids too."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=32) as llm:
        free = llm.generate(["hi"], greedy)[0]
        cut = len(llm.tokenizer.decode(free.token_ids[:3], skip_special_tokens=True))
        stop = free.text[cut - 2 : cut]  # ends with the third token's text, or runs into it
        assert stop and stop not in free.text[: cut - 2]
        prompt_ids = free.prompt_token_ids
        dropped, kept = llm.generate(
            [prompt_ids, "hi"],
            [replace(greedy, stop=[stop]), replace(greedy, stop=[stop], include_stop_str_in_output=True)],
        )
    assert (dropped.text, dropped.finish_reason, dropped.stop_reason) == (free.text[: cut - 2], "stop", stop)
    assert kept.text == free.text[:cut] and kept.finish_reason == "stop"
    # Generation ended soon after the match (the detokenizer may hold a token's text back until the next one).
    assert dropped.token_ids == free.token_ids[: len(dropped.token_ids)] and len(dropped.token_ids) < 12


def test_chat_hands_the_tools_to_the_chat_template(tiny_llama):
    tool_names = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
    template = tool_names + "{% for m in messages %}{{ m.content }}{% endfor %}"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=32) as llm:
        llm.tokenizer.chat_template = template
        [with_tools] = llm.chat([{"role": "user", "content": "hi"}], greedy, tools=[tool])
        [without] = llm.chat([{"role": "user", "content": "hi"}], greedy)
    assert llm.tokenizer.decode(with_tools.prompt_token_ids) == "[get_weather]hi"
    assert llm.tokenizer.decode(without.prompt_token_ids) == "hi"
