"""Layers split across tensor-parallel ranks (the collectives and where they happen: gpu_worker/parallel.py).

Each layer is given the checkpoint's whole tensor (`load`) and reads only its rank's part, by indexing it
(models/weights.py: TensorSource); `full_shape` is that tensor's shape, so that random (dummy) weights are
drawn whole and split the same way: every tensor-parallel size then holds the same model. Each is the torch
layer it replaces (nn.Linear, nn.Embedding) with this rank's sizes, so code that looks for those finds them;
with one rank it is exactly that layer. The projections take FP8 weights when the engine quantizes them
(models/fp8.py: their `weight_scale`), and then their input quantized already where a fused kernel made it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.models import fp8
from gpu_worker.models.weights import TensorSource, padded_vocab_size
from gpu_worker.parallel import TensorParallel, UnreducedSum


def _check_shape(got: torch.Size, want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"checkpoint shape {tuple(got)} != model shape {tuple(want)}")


class ColumnParallelLinear(nn.Linear):
    """A projection whose outputs are split across ranks. Fused projections (q|k|v, gate|up) list their
    parts: each part is split on its own, so a rank holds [its q | its k | its v], whole heads of each."""

    def __init__(self, in_features: int, parts: list[int], tp: TensorParallel, bias: bool, what: str):
        local_parts = [tp.shard(p, what) for p in parts]
        super().__init__(in_features, sum(local_parts), bias=bias)
        self.tp = tp
        self.parts = parts
        self.local_parts = local_parts
        self.register_buffer("weight_scale", None)  # per output channel, once the weight is FP8
        self.weight_group = 0  # inputs per scale where a row has several (fp8.quantize_weights); 0: one a row

    def forward(self, x: fp8.Activation) -> torch.Tensor:
        return fp8.linear(x, self.weight, self.bias, self.weight_scale, self.weight_group)

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (sum(self.parts), self.in_features) if name == "weight" else (sum(self.parts),)

    def part_count(self, name: str) -> int:
        return len(self.parts)

    def load(self, name: str, full: TensorSource, part: int | None = None) -> None:
        """Copy this rank's rows of part `part` of the whole tensor (all parts, stacked, when None)."""
        param = getattr(self, name)
        indices = range(len(self.parts)) if part is None else [part]
        expected = sum(self.parts[i] for i in indices)
        _check_shape(full.shape, (expected, *param.shape[1:]))
        source = 0
        for i in indices:
            local = self.local_parts[i]
            target = sum(self.local_parts[:i])
            rows = full[source + self.tp.rank * local : source + (self.tp.rank + 1) * local]
            param.data[target : target + local].copy_(rows)
            source += self.parts[i]


class RowParallelLinear(nn.Linear):
    """A projection whose inputs are split across ranks (the outputs of a column-parallel one): each rank
    multiplies its share, one all-reduce sums them, then the bias is added once. A projection without a bias
    whose only reader is a residual norm (`sum_in_next_norm`, set by the layer that knows) returns its partial
    sum unreduced: the norm sums it in its own kernel."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, bias: bool, what: str):
        super().__init__(tp.shard(in_features, what), out_features, bias=bias)
        self.tp = tp
        self.full_in_features = in_features
        self.register_buffer("weight_scale", None)  # per output channel (of this rank's inputs), once FP8
        self.weight_group = 0  # inputs per scale where a row has several (fp8.quantize_weights); 0: one a row
        self.sum_in_next_norm = False

    def forward(self, x: fp8.Activation) -> torch.Tensor | UnreducedSum:
        if self.tp.size == 1:
            return fp8.linear(x, self.weight, self.bias, self.weight_scale, self.weight_group)
        partial = fp8.linear(x, self.weight, None, self.weight_scale, self.weight_group)
        if self.sum_in_next_norm and self.bias is None:
            return UnreducedSum(partial, self.tp)
        y = self.tp.all_reduce(partial)
        return y if self.bias is None else y + self.bias

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.out_features, self.full_in_features) if name == "weight" else (self.out_features,)

    def load(self, name: str, full: TensorSource, part: int | None = None) -> None:
        _check_shape(full.shape, self.full_shape(name))
        local = self.in_features
        mine = full[:, self.tp.rank * local : (self.tp.rank + 1) * local] if name == "weight" else full[...]
        getattr(self, name).data.copy_(mine)


class VocabParallelEmbedding(nn.Embedding):
    """Embedding rows (and, as a head, logits) split by vocabulary: rank r holds rows [r*n, (r+1)*n) of the
    vocabulary padded to a multiple of 64 x ranks. Padding rows are zero: never looked up (ids are checked
    against the real vocabulary upstream), and their logits are cut off before sampling."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel):
        rows = padded_vocab_size(vocab_size, tp.size) // tp.size
        super().__init__(rows, dim)
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows = rows
        self.start = tp.rank * rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside[:, None], 0.0))

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[n, vocab] logits, the same on every rank: float32, or a view of `out` (a logits_buffer's rows) in its
        dtype. On one rank, into a buffer of the weights' dtype, the product writes them itself: a decode graph
        launches no conversion (at 256 rows of a 50k vocabulary, ~46 us of an H200's step that only a sampling
        row needs; ModelRunner._draw converts those)."""
        if out is not None and self.tp.size == 1 and out.dtype == hidden.dtype:
            return torch.mm(hidden, self.weight.t(), out=out)[:, : self.vocab_size]
        gathered = self.tp.all_gather_columns(F.linear(hidden, self.weight))[:, : self.vocab_size]
        return gathered.float() if out is None else out[:, : self.vocab_size].copy_(gathered)

    def logits_buffer(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """Room for `rows` rows of logits(out=): every rank's columns, the vocabulary's padding included."""
        return torch.empty(rows, self.rows * self.tp.size, dtype=dtype, device=self.weight.device)

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.vocab_size, self.embedding_dim)

    def load(self, name: str, full: TensorSource, part: int | None = None) -> None:
        _check_shape(full.shape, self.full_shape(name))
        mine = full[self.start : self.start + self.rows]
        self.weight.data[: len(mine)].copy_(mine)
        self.weight.data[len(mine) :].zero_()
