"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k experts, whose gated MLPs'
outputs are summed, weighted by the router's probabilities.

    router     softmax over all experts' logits (float32), top-k, renormalized over the k (Mixtral always,
               Qwen3-MoE when norm_topk_prob), then kept in float32 (Mixtral) or cast to the model dtype
               (Qwen3-MoE), as transformers does each
    experts    MoEExperts: every expert's gate|up [E, 2I, H] and down [E, H, I] stacked; forward(x, ids,
               weights) runs them, fused or not (below)

Tensor parallelism splits every expert's intermediate width (gate|up by rows, down by columns, like the
dense MLP): the router runs whole on every rank, each rank sums its share of every expert, and one
all-reduce adds the shares.

With --quantization fp8 the experts are FP8 weight-only (models/fp8.py): each row is quantized as it loads,
scales [E, 2I] for gate|up and [E, H] for down (per expert and output channel), the activations stay in the
model dtype. A rank quantizes the rows it holds: gate|up's scales are the whole layer's rows of them; down's
are over the rank's share of the width, as a row-parallel projection's (its partial sums come scaled). From a
checkpoint saved with scales per block (use_weight_blocks, before loading) each expert matrix is quantized per
block instead, its scales [E, rows, groups of inputs]: the checkpoint's own values, as the dense layers keep them.

How the experts run:
- fused (the Triton path, CUDA; models/fused_moe.py): pairs sorted by expert, two grouped matmuls, only the
  picked experts' weights read; no host reads and fixed shapes, so CUDA graphs capture it;
- otherwise a loop over the experts, each on the tokens routed to it (exact work, but it finds those tokens on
  the host, so no graph can hold it): the CPU, and the reference the fused path is checked against.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.models import fp8
from gpu_worker.models.mlp import act_and_mul, activation_of
from gpu_worker.models.weights import TensorSource
from gpu_worker.parallel import TensorParallel


class MoEExperts(nn.Module):
    """Parameter names are transformers 5's (experts.gate_up_proj, experts.down_proj); checkpoints that
    store one tensor per expert load into their rows (`load` with part (expert, 0 gate | 1 up | None))."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        tp: TensorParallel,
        hidden_act: str,
        fused: bool,
        quantization: str | None = None,
    ):
        """quantization "fp8": the stacked weights are float8 from the start (never whole in the model dtype),
        each row quantized by `load`."""
        super().__init__()
        self.tp = tp
        self.fused = fused
        self.num_experts = num_experts
        self.hidden = hidden
        self.intermediate = intermediate  # whole, before the split
        self.local = tp.shard(intermediate, "expert MLP features (moe_intermediate_size)")
        self.activation = activation_of(hidden_act)
        self.dtype = torch.get_default_dtype()  # the model dtype: the loader builds the model under it
        weight_dtype = fp8.FP8 if quantization == "fp8" else self.dtype
        gate_up = torch.empty(num_experts, 2 * self.local, hidden, dtype=weight_dtype)
        down = torch.empty(num_experts, hidden, self.local, dtype=weight_dtype)
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(down, requires_grad=False)
        quantized = weight_dtype == fp8.FP8
        # Per expert and output channel, float32 (use_weight_blocks: and group of inputs); None: the weights are in
        # the model dtype.
        self.register_buffer("gate_up_proj_scale", torch.empty(gate_up.shape[:2]) if quantized else None)
        self.register_buffer("down_proj_scale", torch.empty(down.shape[:2]) if quantized else None)
        self.weight_block: tuple[int, int] | None = None

    @property
    def weight_group(self) -> int:
        """Inputs per scale along K (0: one scale per output channel)."""
        return 0 if self.weight_block is None else self.weight_block[1]

    def use_weight_blocks(self, block: tuple[int, int]) -> None:
        """Quantize each expert matrix per block of block[0] rows by block[1] inputs as it loads, as a checkpoint
        saved so holds it (fp8.quantize_blocks: its own values and scales again, where the rank's parts are whole
        blocks, as real models' are), the scales kept per row and group of inputs [E, rows, ceil(K / block[1])].
        Before any weight loads."""
        if self.gate_up_proj_scale is None:
            raise ValueError("block scales are for FP8 experts (quantization fp8)")
        self.weight_block = block
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(self, name)
            groups = -(-weight.shape[2] // block[1])
            setattr(self, f"{name}_scale", torch.empty(*weight.shape[:2], groups, device=weight.device))

    def full_shape(self, name: str) -> tuple[int, ...]:
        e, h, i = self.num_experts, self.hidden, self.intermediate
        return (e, 2 * i, h) if name == "gate_up_proj" else (e, h, i)

    def part_count(self, name: str) -> int:
        return self.num_experts * (2 if name == "gate_up_proj" else 1)

    def load(self, name: str, full: TensorSource, part: tuple[int, int | None] | None = None) -> None:
        """Whole stacked tensors (part None), or one expert's gate (part (e, 0)), up ((e, 1)) or down ((e, None)).
        Reads only this rank's rows of gate and up, its columns of down."""
        r, n, i = self.tp.rank, self.local, self.intermediate
        if part is None:
            _check(full.shape, self.full_shape(name))
            if name == "gate_up_proj":
                for which in (0, 1):  # gate rows, then up rows
                    start = which * i + r * n
                    self._store(name, (slice(None), slice(which * n, (which + 1) * n)), full[:, start : start + n])
            else:
                self._store(name, (slice(None),), full[:, :, r * n : (r + 1) * n])
            return
        expert, which = part
        if name == "gate_up_proj":
            _check(full.shape, (i, self.hidden))
            self._store(name, (expert, slice(which * n, (which + 1) * n)), full[r * n : (r + 1) * n])
        else:
            _check(full.shape, (self.hidden, i))
            self._store(name, (expert,), full[:, r * n : (r + 1) * n])

    def _store(self, name: str, at: tuple, rows: torch.Tensor) -> None:
        """Copy `rows` (output channels along the second-last dimension) into weight `name`[at]; FP8 weights take
        them rounded to the model dtype first, as the unquantized model holds them, then quantized row by row, or
        per block of each expert's matrix (use_weight_blocks)."""
        scale = getattr(self, f"{name}_scale")
        if scale is None:
            getattr(self, name).data[at].copy_(rows)
            return
        rows = rows.to(self.dtype)
        if self.weight_block is None:
            q, scales = fp8.quantize_rows(rows.reshape(-1, rows.shape[-1]))
            scales = scales.view(rows.shape[:-1])
        else:  # each expert's matrix its own blocks
            block = self.weight_block
            parts = [fp8.quantize_blocks(m, block) for m in rows.reshape(-1, *rows.shape[-2:])]
            q = torch.stack([values for values, _ in parts])
            scales = torch.stack([group_scales for _, group_scales in parts]).view(*rows.shape[:-1], -1)
        getattr(self, name).data[at].copy_(q.view(rows.shape))
        scale[at].copy_(scales)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; ids, weights [T, k]: each token's experts and their weights. Returns this rank's share of
        sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), in x's dtype (before the all-reduce)."""
        if self.fused:
            from gpu_worker.models.fused_moe import fused_experts

            return fused_experts(
                x,
                self.gate_up_proj,
                self.down_proj,
                ids,
                weights,
                self.activation,
                gate_up_scale=self.gate_up_proj_scale,
                down_scale=self.down_proj_scale,
                group=self.weight_group,
            )
        return self._routed_tokens(x, ids, weights)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up_scale = None if self.gate_up_proj_scale is None else self.gate_up_proj_scale[e]
        down_scale = None if self.down_proj_scale is None else self.down_proj_scale[e]
        group = self.weight_group
        h = act_and_mul(fp8.weight_only_linear(x, self.gate_up_proj[e], gate_up_scale, group), self.activation, False)
        return fp8.weight_only_linear(h, self.down_proj[e], down_scale, group)

    def _routed_tokens(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tokens, slot = torch.where(ids == e)
            if tokens.numel():
                y = self._expert(e, x[tokens]) * weights[tokens, slot, None]
                out.index_add_(0, tokens, y.to(out.dtype))
        return out


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        tp: TensorParallel,
        hidden_act: str,
        *,
        fused: bool,
        renormalize: bool,
        weights_in_model_dtype: bool,
        quantization: str | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_in_model_dtype = weights_in_model_dtype
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router, whole on every rank, never FP8
        self.experts = MoEExperts(num_experts, hidden, intermediate, tp, hidden_act, fused, quantization)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, k] expert ids and weights."""
        logits = self.gate(x)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = self.experts(x, ids, weights)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)


def _check(got: torch.Size, want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"checkpoint shape {tuple(got)} != model shape {tuple(want)}")
