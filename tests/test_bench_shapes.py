"""The benchmark shapes are the published models' sizes, and the roofline orders steps as bandwidth does."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.offline import describe_roofline
from benchmarks.roofline import GPU_PEAKS, ModelCost, decode_step_floor, decode_step_parts, gpu_peak, run_floor
from benchmarks.shapes import write_shape
from common.model_info import ModelInfo

# Parameters of the published checkpoints (their model cards), with their vocabularies.
PUBLISHED_PARAMETERS = {
    "llama-3.2-1b": (1.24e9, 128256),
    "llama-3-8b": (8.03e9, 128256),
    "llama-3-70b": (70.6e9, 128256),
    "qwen3-30b-a3b": (30.5e9, 151936),
    "mixtral-8x7b": (46.7e9, 32000),
}


def tokenizer_folder(tmp_path, vocab_size: int):
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"vocab_size": vocab_size, "bos_token_id": 1, "eos_token_id": 2}))
    (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.mark.parametrize("shape", sorted(PUBLISHED_PARAMETERS))
def test_shape_has_the_published_parameter_count(shape, tmp_path):
    published, vocab_size = PUBLISHED_PARAMETERS[shape]
    out = write_shape(shape, tmp_path / shape, tokenizer_folder(tmp_path, vocab_size))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out))
    parameters = sum(p.numel() for p in model.parameters())
    assert parameters == pytest.approx(published, rel=0.01)
    assert (out / "tokenizer.json").is_file()
    assert ModelInfo.from_folder(out).eos_token_ids == [2]


def test_decode_floor_adds_the_products_floor_and_the_attentions_each_bound_by_bytes_or_flops():
    """An 8B model at 256 requests: its products are compute-bound, its attention memory-bound, and the two
    kernels' floors add (neither hides behind the other)."""
    peak = GPU_PEAKS[0]
    cost = ModelCost(
        weight_bytes=16 * 2**30,
        matmul_params=8 * 10**9,
        kv_bytes_per_token=131072,
        attention_flops_per_context_token=4 * 32 * 32 * 128,
    )
    contexts = [400] * 256
    products = 2 * cost.matmul_params * 256 / peak.bf16_flops_per_s
    assert products > cost.weight_bytes / peak.hbm_bytes_per_s, "compute-bound"
    attention = cost.kv_bytes_per_token * (sum(contexts) + len(contexts)) / peak.hbm_bytes_per_s
    assert attention > cost.attention_flops_per_context_token * sum(contexts) / peak.bf16_flops_per_s
    assert decode_step_floor(cost, contexts, peak) == pytest.approx(products + attention)
    # One request: both parts memory-bound, the floor all bytes.
    one = (cost.weight_bytes + cost.kv_bytes_per_token * 401) / peak.hbm_bytes_per_s
    assert decode_step_floor(cost, [400], peak) == pytest.approx(one)
    assert decode_step_floor(cost, [800] * 256, peak) > decode_step_floor(cost, contexts, peak)


def test_a_lower_sm_clock_lengthens_the_compute_bound_part_only():
    """A power limit holds the SM clock down (benchmarks/gpu_clocks.py): the 8B's compute-bound products take longer
    in proportion, its memory-bound attention does not; the report says both floors."""
    peak = gpu_peak("NVIDIA H200")
    assert peak is not None and peak.at_sm_clock(peak.rated_sm_mhz) == peak
    held = peak.at_sm_clock(peak.rated_sm_mhz / 2)
    assert held.hbm_bytes_per_s == peak.hbm_bytes_per_s and held.bf16_flops_per_s == peak.bf16_flops_per_s / 2
    cost = ModelCost(
        weight_bytes=16 * 2**30, matmul_params=8 * 10**9, kv_bytes_per_token=131072, attention_flops_per_context_token=4
    )
    contexts = [400] * 256
    rated, slowed = (decode_step_parts(cost, contexts, p) for p in (peak, held))
    assert slowed["matmul"] == pytest.approx(2 * rated["matmul"]) and slowed["attention"] == rated["attention"]
    figures = {
        "floor_s": 3.0,
        "run_share": 0.6,
        "decode_step_floor_ms": 6.65,
        "decode_step_ms": 10.0,
        "decode_share": 0.665,
    }
    held_figures = {**figures, "sm_mhz": 1550.0, "decode_step_floor_ms": 7.5, "decode_share": 0.75}
    lines = describe_roofline({"gpu": "H200", **figures, "held_clock": held_figures})
    assert len(lines) == 2 and "6.65 ms (66%)" in lines[0]
    assert "held (1550 MHz; the datasheet's FLOP rates are at 1830)" in lines[1] and "7.50 ms (75%)" in lines[1]
    assert len(describe_roofline({"gpu": "H200", **figures})) == 1


def test_run_floor_adds_a_decode_step_per_output_token_per_wave():
    peak = gpu_peak("NVIDIA H200")
    assert peak is not None and gpu_peak("cpu") is None
    cost = ModelCost(
        weight_bytes=10**9, matmul_params=5 * 10**8, kv_bytes_per_token=1000, attention_flops_per_context_token=1000
    )
    one_wave = run_floor(cost, [100] * 8, output_len=10, seats=8, peak=peak)
    two_waves = run_floor(cost, [100] * 8, output_len=10, seats=4, peak=peak)
    # Memory bound: each step reads the weights once, so two waves of half the batch read them twice as often.
    assert two_waves["decode_s"] > 1.9 * one_wave["decode_s"]
    assert one_wave["seconds"] == pytest.approx(one_wave["prefill_s"] + one_wave["decode_s"])


def test_a_moe_decode_step_reads_the_experts_its_tokens_pick():
    """One token reads its k of E experts; a large batch picks nearly all of them."""
    peak = gpu_peak("NVIDIA H200")
    assert peak is not None
    cost = ModelCost(
        weight_bytes=10**9,
        matmul_params=10**9,
        kv_bytes_per_token=0,
        attention_flops_per_context_token=0,
        expert_bytes=64 * 10**9,
        num_experts=128,
        experts_per_token=8,
    )
    one = decode_step_floor(cost, [0], peak) * peak.hbm_bytes_per_s
    assert one == pytest.approx(10**9 + 64 * 10**9 * 8 / 128)
    many = decode_step_floor(cost, [0] * 256, peak) * peak.hbm_bytes_per_s
    assert many == pytest.approx(65 * 10**9, rel=1e-6)


def test_a_moe_models_cost_counts_its_experts_apart(tmp_path):
    """Every step reads the weights outside the experts; each token multiplies k of E experts (float32: 4 bytes)."""
    from gpu_worker.model_loader import load_model
    from tests.tiny_models import build_model

    model = load_model(str(build_model("mixtral", tmp_path / "mixtral")), "auto", torch.float32, torch.device("cpu"))
    params = {name: p.numel() for name, p in model.named_parameters() if name != "embed_tokens.weight"}
    matrices = {name for name, p in model.named_parameters() if p.dim() >= 2}
    experts = sum(n for name, n in params.items() if ".experts." in name)
    cost = ModelCost.of(model, num_heads=4)
    assert (cost.num_experts, cost.experts_per_token) == (4, 2)
    assert cost.expert_bytes == 4 * experts
    assert cost.weight_bytes == 4 * (sum(params.values()) - experts)
    dense_matrices = sum(n for name, n in params.items() if name in matrices and ".experts." not in name)
    assert cost.matmul_params == dense_matrices + experts * 2 // 4
