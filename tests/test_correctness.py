"""Greedy outputs are token-identical to Hugging Face (float32, CPU), with 8 prompts of different
lengths (the block size divides none of them) decoded together in one batch: against generate for the
tiny models, against the same model's teacher-forced argmax for the real SmolLM2 weights. Every other
family (tiny_family) is checked the same way, and again through prefix-cache hits, chunked prefill and
preemption; the tiny models' sliding windows are shorter than the longest prompts."""

from __future__ import annotations

import functools

import pytest
import torch

from common.sampling_params import SamplingParams
from gpu_worker.model_loader import load_model
from offline import LLM
from tests.tiny_models import hf_greedy, hf_greedy_choices, random_prompts

PROMPT_LENGTHS = [5, 13, 17, 23, 31, 35, 47, 50]
NEW_TOKENS = 32
# SmolLM2's prompts are 5-17 tokens: 16 new tokens take every prompt across a block boundary while decoding.
SMOLLM2_NEW_TOKENS = 16


def generate_batched(folder, prompts: list[list[int]], new_tokens: int = NEW_TOKENS, **engine_args) -> list[list[int]]:
    llm = LLM(str(folder), device="cpu", dtype="float32", **engine_args)
    llm.record_plans = True
    outs = llm.generate(
        prompts,
        SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
        on_step=llm.scheduler.check_integrity,
    )
    first = llm.plans_executed[0]
    assert len(first.chunks) == len(prompts), "all prompts were prefilled in one forward"
    assert all(len(p.chunks) == len(prompts) for p in llm.plans_executed[1:]), "decoded as one batch"
    return [o.token_ids for o in outs]


def test_tiny_models_match_transformers(tiny_model):
    prompts = random_prompts(8, PROMPT_LENGTHS, vocab=512)
    ours = generate_batched(tiny_model, prompts, block_size=16)
    assert ours == hf_greedy(tiny_model, prompts, NEW_TOKENS)


def test_smollm2_real_weights_match_transformers(smollm2_folder, smollm2_hf_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder)
    texts = [
        "The capital of France is",
        "Once upon a time, there was a little girl who",
        "def fibonacci(n):",
        "1, 2, 3, 4,",
        "The quick brown fox jumps over the lazy dog. The",
        "In 1492, Columbus",
        "Water boils at a temperature of",
        "A haiku about the sea, written by a poet who has never seen it:",
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    assert len({len(p) for p in prompts}) > 4 and any(len(p) % 16 for p in prompts)
    # 64 KV blocks hold the batch; the default store (2 GiB on CPU) would cost more to allocate than to use.
    ours = generate_batched(smollm2_folder, prompts, SMOLLM2_NEW_TOKENS, block_size=16, num_kv_blocks=64)
    # Teacher-forced: one Hugging Face forward per prompt instead of one per generated token.
    assert ours == hf_greedy_choices(smollm2_hf_model, prompts, ours)


@pytest.mark.parametrize("block_size", [1, 7, 32])
def test_block_size_does_not_change_outputs(tiny_llama, block_size):
    prompts = random_prompts(4, [9, 30, 41, 3], vocab=512, seed=1)
    assert generate_batched(tiny_llama, prompts, block_size=block_size) == generate_batched(
        tiny_llama, prompts, block_size=16
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_written_into_a_given_buffer_are_the_fresh_ones(tiny_model, dtype):
    # The decode CUDA graphs share one logits buffer (gpu_worker/cuda_graphs.py), in the model's dtype: the same
    # numbers as the float32 logits every other path samples from, in place.
    model = load_model(str(tiny_model), "dummy", dtype, torch.device("cpu"), seed=1)
    hidden = torch.randn(3, next(model.parameters()).shape[-1], generator=torch.Generator().manual_seed(2)).to(dtype)
    buffer = model.logits_buffer(5).fill_(float("nan"))
    assert buffer.dtype == dtype and buffer.shape[1] >= model.vocab_size
    written = model.compute_logits(hidden, out=buffer[:3])
    assert written.data_ptr() == buffer.data_ptr() and written.shape == (3, model.vocab_size)
    assert torch.equal(written.float(), model.compute_logits(hidden)) and buffer[3:].isnan().all()


# Two prompts extend others' first blocks: prefix-cache hits within the batch.
def family_prompts() -> list[list[int]]:
    prompts = random_prompts(6, [5, 13, 23, 35, 47, 50], vocab=512, seed=2)
    return prompts + [prompts[4][:40] + [7, 8, 9], prompts[5][:33] + prompts[2]]


@functools.cache
def transformers_greedy(folder) -> list[list[int]]:
    return hf_greedy(folder, family_prompts(), NEW_TOKENS)


def test_every_family_matches_transformers_in_one_batch(tiny_family):
    ours = generate_batched(tiny_family, family_prompts(), block_size=16)
    assert ours == transformers_greedy(tiny_family)


ENGINE_MODES = {
    "prefix-cache-off": dict(block_size=16, enable_prefix_caching=False),
    "prefix-cache-hits": dict(block_size=16),
    "chunked-prefill": dict(block_size=16, max_num_batched_tokens=16, enable_prefix_caching=False),
    "preemption": dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_every_family_matches_transformers_however_the_engine_schedules(tiny_family, mode):
    llm = LLM(str(tiny_family), device="cpu", dtype="float32", **ENGINE_MODES[mode])
    llm.record_plans = True
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(family_prompts(), params, on_step=llm.scheduler.check_integrity)
    assert [o.token_ids for o in outs] == transformers_greedy(tiny_family)
    stats, plans = llm.scheduler.stats, llm.plans_executed
    if mode == "prefix-cache-hits":
        assert stats.cache_hit_tokens > 0
    if mode == "chunked-prefill":
        assert any(start > 0 and n > 1 for p in plans for start, n in zip(p.starts, p.num_tokens)), "a later chunk"
    if mode == "preemption":
        assert stats.preemptions > 0
