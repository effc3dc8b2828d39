"""The sampler: greedy, top-k, top-p and min-p masks, temperature, seeded determinism; logit bias, min_tokens,
penalties and logprobs."""

from __future__ import annotations

import torch

from common.sampling_params import SamplingParams
from gpu_worker.host_copy import StagingRing
from gpu_worker.sampler import (
    SamplingBatch,
    apply_top_k_top_p,
    exponential_noise,
    process_logits,
    sample,
    sampled_logprobs,
)
from gpu_worker.token_counts import TokenCounts

VOCAB = 50


def batch(rows):
    """rows: (temperature, top_k, top_p, seed, output_index) per sampled request."""
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s) for t, k, p, s, _ in rows]
    return SamplingBatch.build(params, [r[4] for r in rows], VOCAB, StagingRing(torch.device("cpu"), 0).upload)


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = random_logits(4)
    tokens = sample(logits, batch([(0.0, 0, 1.0, 1, 0)] * 4))
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_top_k_one_is_greedy_whatever_the_temperature():
    logits = random_logits(3)
    tokens = sample(logits, batch([(5.0, 1, 1.0, s, 0) for s in range(3)]))
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_top_k_mask_keeps_exactly_the_k_largest():
    logits = random_logits(2)
    masked = apply_top_k_top_p(logits, torch.tensor([3, 7]), torch.tensor([1.0, 1.0]))
    for row, k in enumerate((3, 7)):
        kept = torch.isfinite(masked[row]).nonzero().flatten().tolist()
        assert sorted(kept) == sorted(logits[row].topk(k).indices.tolist())
        assert torch.equal(masked[row, kept], logits[row, kept])


def test_top_p_mask_keeps_the_smallest_nucleus_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)]))
    for p, expected in ((0.5, {0}), (0.6, {0, 1}), (0.8, {0, 1}), (0.81, {0, 1, 2}), (0.01, {0})):
        masked = apply_top_k_top_p(logits, torch.tensor([VOCAB]), torch.tensor([p]))
        assert set(torch.isfinite(masked[0]).nonzero().flatten().tolist()) == expected, p


def test_samples_stay_inside_the_top_k_and_top_p_sets():
    logits = random_logits(1).expand(200, VOCAB).contiguous()
    allowed_k = set(logits[0].topk(5).indices.tolist())
    tokens = sample(logits, batch([(1.0, 5, 1.0, seed, 0) for seed in range(200)]))
    assert set(tokens.tolist()) <= allowed_k
    assert len(set(tokens.tolist())) > 1, "sampling is not greedy"


def test_same_seed_and_index_give_the_same_token_in_any_batch():
    logits = random_logits(1)
    alone = sample(logits, batch([(1.0, 0, 1.0, 1234, 7)]))
    crowd_logits = torch.cat([random_logits(5, seed=9), logits])
    crowd = sample(crowd_logits, batch([(1.0, 0, 1.0, s, 0) for s in range(5)] + [(1.0, 0, 1.0, 1234, 7)]))
    assert crowd[-1].item() == alone.item()


def test_different_seeds_or_indices_give_different_draws():
    noise = exponential_noise(torch.tensor([1, 2, 1]), torch.tensor([0, 0, 1]), VOCAB)
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])


def test_sampling_frequencies_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (VOCAB - 3))
    logits = torch.log(probs.clamp_min(1e-12)).expand(4000, VOCAB).contiguous()
    tokens = sample(logits, batch([(1.0, 0, 1.0, seed, 0) for seed in range(4000)]))
    freq = torch.bincount(tokens, minlength=VOCAB)[:3].float() / 4000
    assert torch.allclose(freq, probs[:3], atol=0.03)


def test_exponential_noise_has_unit_mean():
    noise = exponential_noise(torch.arange(64), torch.zeros(64, dtype=torch.long), 1000)
    assert abs(noise.mean().item() - 1.0) < 0.02


# ---------------------------------------------------------------- logits processing and logprobs


def processed(logits, params, output_index=None, counts=None, eos=()):
    staging = StagingRing(torch.device("cpu"), 0)
    index = output_index or [0] * len(params)
    b = SamplingBatch.build(params, index, VOCAB, staging.upload, list(range(len(params))), counts, list(eos))
    return process_logits(logits, b), b


def test_penalties_follow_the_openai_and_repetition_formulas():
    logits = random_logits(2)
    counts = TokenCounts(2, VOCAB, torch.device("cpu"))
    counts.reset(0, prompt_ids=[7, 8], output_ids=[1, 1, 1, 2])
    counts.reset(1, prompt_ids=[], output_ids=[3])
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0),
        SamplingParams(presence_penalty=-1.0),
    ]
    out, _ = processed(logits, params, counts=counts)
    expected = logits.clone()
    for token in (7, 8, 1, 2):  # prompt or output: divided (positive) or multiplied (negative) by 2
        value = expected[0, token]
        expected[0, token] = value / 2 if value > 0 else value * 2
    expected[0, 1] -= 3 * 0.25 + 0.5
    expected[0, 2] -= 1 * 0.25 + 0.5
    expected[1, 3] += 1.0
    assert torch.allclose(out, expected)


def test_token_counts_follow_the_samples_on_the_device():
    counts = TokenCounts(3, VOCAB, torch.device("cpu"))
    counts.reset(2, prompt_ids=[5], output_ids=[])
    counts.add(torch.tensor([2, 2, 0]), torch.tensor([4, 4, 9]))
    assert counts.output[2, 4].item() == 2 and counts.output[0, 9].item() == 1 and counts.in_prompt[2, 5]


def test_logit_bias_is_added_to_the_logits():
    logits = random_logits(1)
    weakest = logits[0].argmin().item()
    strongest = logits[0].argmax().item()
    out, b = processed(logits, [SamplingParams(temperature=0.0, logit_bias={weakest: 100.0, strongest: -100.0})])
    assert out[0, weakest] == logits[0, weakest] + 100 and out[0, strongest] == logits[0, strongest] - 100
    assert sample(out, b).item() == weakest


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = random_logits(2)
    eos, stop = logits[0].argmax().item(), 11
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop])] * 2
    out, _ = processed(logits, params, output_index=[1, 2], eos=[eos])
    assert out[0, eos] == float("-inf") and out[0, stop] == float("-inf")
    assert torch.equal(out[1], logits[1]), "the second row has its min_tokens already"


def test_min_p_keeps_only_tokens_at_least_min_p_times_the_most_likely():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08] + [0.0] * (VOCAB - 4))
    logits = torch.log(probs.clamp_min(1e-12)).expand(500, VOCAB).contiguous()
    params = [SamplingParams(min_p=0.2, seed=s) for s in range(500)]
    tokens = sample(*processed(logits, params))
    assert set(tokens.tolist()) == {0, 1, 2}, "0.08 < 0.2 * 0.5 is cut, 0.12 is kept"


def test_logprobs_are_the_log_softmax_at_the_rows_temperature():
    logits = random_logits(3)
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(),
        SamplingParams(temperature=0.5, logprobs=4),
    ]
    out, b = processed(logits, params)
    tokens = sample(out, b)
    lp = sampled_logprobs(out, b, tokens)
    assert lp.rows == [0, 2] and lp.top_ids.shape == (2, 4)
    expected = [torch.log_softmax(logits[0], -1), torch.log_softmax(logits[2] / 0.5, -1)]
    for k, (row, ref) in enumerate(zip([0, 2], expected)):
        assert torch.allclose(lp.sampled[k], ref[tokens[row]])
        assert lp.top_ids[k].tolist() == ref.topk(4).indices.tolist()
        assert torch.allclose(lp.top_logprobs[k], ref.topk(4).values)
