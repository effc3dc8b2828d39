"""The roofline of a run: the least time the GPU's memory bandwidth and arithmetic allow, to set a measured
time against.

A decode step must read every weight once and every running request's KV cache once, and write one token's
KV per request; it must do about 2 FLOPs per weight per token and 4 per cached (token, layer, head, dim) of
attention. Its floor adds two parts, each the larger of its bytes / HBM bandwidth and its FLOPs / peak rate: the
matrix products (the weights) and the attention (the KV cache). They add because their kernels run one after the
other: at 256 requests an 8B model's products are compute-bound (3.9 ms of bf16 FLOPs on an H200 against 3.1 ms
of weight reads) while its attention is memory-bound, and the larger of the whole step's bytes and FLOPs would
let one hide behind the other (H200: 5.9 ms where the kernels cannot beat 6.8). A prefill is bounded by its
FLOPs. The whole run's floor adds its steps' floors, with the requests decoding together (`seats` at a time)
as the engine runs them. A mixture of experts' step reads only the experts its tokens pick: for B tokens each
picking k of E experts uniformly, an expert is missed by all with probability (1 - k/E)^B, so the step is
expected to read that share of the experts less (random weights route about uniformly; a trained router that
favours some experts reads fewer). Figures are the vendors' datasheet peaks (dense, no sparsity), so a share of 100 % is
out of reach: the measured ceilings on these machines are about 90 % of the bandwidth (a device-to-device
copy) and 80 % of the bf16 rate (a large matrix product). The FLOP rates are quoted at a rated SM clock; under a
power limit the card holds a lower one (benchmarks/gpu_clocks.py), and `GpuPeak.at_sm_clock` gives the floor there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class GpuPeak:
    name: str
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    fp8_flops_per_s: float
    rated_sm_mhz: float  # the SM clock the FLOP rates are quoted at (nvidia-smi's maximum may be higher)

    def at_sm_clock(self, mhz: float) -> GpuPeak:
        """The same GPU with its SM clock at `mhz` (as a power limit holds it: benchmarks/gpu_clocks.py): the
        arithmetic rates scale with the clock, HBM's bandwidth (its own clock) does not."""
        scale = mhz / self.rated_sm_mhz
        bf16, fp8 = self.bf16_flops_per_s * scale, self.fp8_flops_per_s * scale
        return replace(self, bf16_flops_per_s=bf16, fp8_flops_per_s=fp8)


# Datasheet figures (SXM parts; dense). Matched by substring of torch.cuda.get_device_name(), first match wins.
# Hopper's 989 TFLOP/s is 4,096 bf16 FLOPs per clock on each of 132 SMs at 1,830 MHz; nvidia-smi says 1,980 at most.
GPU_PEAKS = (
    GpuPeak("H200", 4.8e12, 989e12, 1979e12, 1830),
    GpuPeak("H100", 3.35e12, 989e12, 1979e12, 1830),
    GpuPeak("A100", 2.04e12, 312e12, 0.0, 1410),
)


def gpu_peak(device_name: str) -> GpuPeak | None:
    for peak in GPU_PEAKS:
        if peak.name in device_name:
            return peak
    return None


@dataclass(frozen=True, slots=True)
class ModelCost:
    """What one token costs the model, from the model as loaded (any family, any dtype)."""

    weight_bytes: int  # every weight each forward reads, the experts aside (embedding rows are gathered, not read)
    matmul_params: int  # weights multiplied by each token (2 FLOPs each): of the experts, its top-k only
    kv_bytes_per_token: int  # one token's K and V over all layers
    attention_flops_per_context_token: int  # 4 * layers * query heads * head_dim
    expert_bytes: int = 0  # every expert of every MoE layer, of which a step reads those its tokens pick
    num_experts: int = 0
    experts_per_token: int = 0

    def routed_expert_bytes(self, num_tokens: int) -> float:
        """The experts' bytes a step of `num_tokens` tokens is expected to read (uniform routing)."""
        if not self.expert_bytes:
            return 0.0
        missed = (1.0 - self.experts_per_token / self.num_experts) ** num_tokens
        return self.expert_bytes * (1.0 - missed)

    @classmethod
    def of(cls, model, num_heads: int, kv_itemsize: int | None = None) -> ModelCost:
        """`model`: one of ours (gpu_worker/models/), as loaded; `num_heads`: its query heads. Its embedding tables
        (any parameter named *embed*, or wte/wpe) are looked up, not multiplied, unless the lm-head shares them
        (tied): then they are read once, as the head. Its MoE layers' experts are counted apart (expert_bytes).
        `kv_itemsize`: the KV store's bytes per element (None: the weights' dtype's)."""
        from gpu_worker.models.moe import SparseMoE

        weight_bytes = matmul = expert_bytes = num_experts = top_k = 0
        experts: set[int] = set()  # the ids of the experts' parameters
        for layer in model.modules():
            if isinstance(layer, SparseMoE):
                num_experts, top_k = layer.experts.num_experts, layer.top_k  # the same in every MoE layer
                for param in layer.experts.parameters():
                    experts.add(id(param))
                    expert_bytes += param.numel() * param.element_size()
                    matmul += param.numel() * top_k // num_experts
        tied = _tied_head(model)
        for name, param in model.named_parameters():
            looked_up = "embed" in name or name.endswith(("wte.weight", "wpe.weight"))
            if id(param) in experts or (looked_up and not (tied is not None and param is tied)):
                continue
            weight_bytes += param.numel() * param.element_size()
            if param.dim() >= 2:
                matmul += param.numel()
        layers, kv_heads, head_dim = model.kv_shape
        if kv_itemsize is None:
            kv_itemsize = next(
                p for p in model.parameters() if p.is_floating_point() and p.element_size() > 1
            ).element_size()
        return cls(
            weight_bytes,
            matmul,
            layers * 2 * kv_heads * head_dim * kv_itemsize,
            4 * layers * num_heads * head_dim,
            expert_bytes,
            num_experts,
            top_k,
        )


def _tied_head(model):
    head = getattr(model, "lm_head", None)
    return getattr(head, "weight", None)


def decode_step_floor(cost: ModelCost, contexts: list[int], peak: GpuPeak, fp8: bool = False) -> float:
    """Seconds one decode step of these requests (each `contexts[i]` tokens cached) cannot beat: the matrix
    products' floor plus the attention's (fp8: the products at the fp8 rate; attention computes in bf16)."""
    return sum(decode_step_parts(cost, contexts, peak, fp8).values())


def decode_step_parts(cost: ModelCost, contexts: list[int], peak: GpuPeak, fp8: bool = False) -> dict[str, float]:
    """The floor's two parts, seconds: {"matmul": ..., "attention": ...}."""
    bandwidth = peak.hbm_bytes_per_s
    weights = cost.weight_bytes + cost.routed_expert_bytes(len(contexts))
    product_flops = 2 * cost.matmul_params * len(contexts)
    kv_bytes = cost.kv_bytes_per_token * (sum(contexts) + len(contexts))  # read every context, write a token each
    attention_flops = cost.attention_flops_per_context_token * sum(contexts)
    return {
        "matmul": max(weights / bandwidth, product_flops / (peak.fp8_flops_per_s if fp8 else peak.bf16_flops_per_s)),
        "attention": max(kv_bytes / bandwidth, attention_flops / peak.bf16_flops_per_s),
    }


def prefill_floor(cost: ModelCost, prompt_lens: list[int], peak: GpuPeak, fp8: bool = False) -> float:
    """Seconds computing these prompts cannot beat: their FLOPs (causal attention: half the square)."""
    flops = sum(
        2 * cost.matmul_params * n + cost.attention_flops_per_context_token * n * (n + 1) // 2 for n in prompt_lens
    )
    return flops / (peak.fp8_flops_per_s if fp8 else peak.bf16_flops_per_s)


def run_floor(
    cost: ModelCost, prompt_lens: list[int], output_len: int, seats: int, peak: GpuPeak, fp8: bool = False
) -> dict:
    """The run's floor: the prompts' prefill, then their decode steps, `seats` requests at a time in arrival
    order (a wave of requests decodes together; the next wave starts when it ends, as with equal outputs).
    Returns the floor's seconds, its decode part, and the floor of the first wave's median decode step."""
    prefill_s = prefill_floor(cost, prompt_lens, peak, fp8)
    decode_s = 0.0
    middle_step_s = None
    for start in range(0, len(prompt_lens), seats):
        wave = prompt_lens[start : start + seats]
        for t in range(output_len - 1):  # the first token comes with the prefill
            step_s = decode_step_floor(cost, [n + t for n in wave], peak, fp8)
            decode_s += step_s
            if start == 0 and t == output_len // 2:
                middle_step_s = step_s
    return {
        "seconds": prefill_s + decode_s,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "middle_step_s": middle_step_s,
    }
