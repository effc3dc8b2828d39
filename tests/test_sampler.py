"""The sampler: greedy, top-k and top-p masks, temperature, and seeded determinism."""

from __future__ import annotations

import torch

from gpu_worker.host_copy import StagingRing
from gpu_worker.sampler import SamplingBatch, apply_top_k_top_p, exponential_noise, sample

VOCAB = 50


def batch(rows):
    return SamplingBatch.build(rows, VOCAB, StagingRing(torch.device("cpu"), 0).upload)


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
