"""A step's forward run op by op: where no CUDA graph runs it (a CPU, --enforce-eager, a step that asks for prompt
logprobs, or one larger than every graph). It computes what a mixed graph's replay computes (mixed_graphs.py), from
the same StepInputs, with the same results: the logits of the sampling rows.

    inputs ─ upload ─▶ [ids (pending rows gathered from the last-token slots), positions, attention metadata]
           ─ model ─▶ hidden states ─ LM head over the sampling rows ─▶ logits      (and prompt rows' hidden states)

On CUDA the step is padded to a few token counts (input_batch.eager_bucket), its sampling rows too: cuBLAS
picks a matmul's kernel per shape it has not seen, at a cost each eager step would pay anew.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.attention import AttentionBackend
from gpu_worker.host_copy import StagingRing
from gpu_worker.input_batch import StepInputs, eager_bucket, pad_batch
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.models.forward_context import ForwardContext


class EagerForward:
    def __init__(
        self,
        model: torch.nn.Module,
        attention: AttentionBackend,
        kv_cache: PagedKVCache,
        staging: StagingRing,
        last_tokens: torch.Tensor,
        scratch_block: int,
    ):
        """last_tokens: the worker's last sampled token of each slot; scratch_block: the KV block no request owns,
        which padding tokens write."""
        self.model = model
        self.attention = attention
        self.kv_cache = kv_cache
        self.staging = staging
        self.last_tokens = last_tokens
        self.scratch_block = scratch_block
        self.pad = kv_cache.data.device.type == "cuda"  # on a CPU, padding gains nothing

    def run(self, inputs: StepInputs, prompt_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits of the sampling rows (inputs.logit_rows) [R, V], and the hidden states of `prompt_rows`
        (flat token rows) when given."""
        upload = self.staging.upload
        # Inputs only the device knows (tokens sampled by a step whose result is not read yet), gathered there.
        pending = None
        if len(inputs.pending_rows):
            pending = (
                upload(inputs.pending_rows, torch.long),
                self.last_tokens[upload(inputs.pending_slots, torch.long)],
            )
        input_ids, positions, slot_mapping, layout = (
            inputs.input_ids,
            inputs.positions,
            inputs.slot_mapping,
            inputs.layout,
        )
        logit_rows = inputs.logit_rows
        num_logit_rows = len(logit_rows)
        if self.pad:
            input_ids, positions, slot_mapping, layout = pad_batch(
                input_ids,
                positions,
                slot_mapping,
                layout,
                eager_bucket(len(input_ids)),
                self.scratch_block,
                self.kv_cache.block_size,
            )
            if len(logit_rows):
                logit_rows = np.pad(logit_rows, (0, eager_bucket(len(logit_rows)) - len(logit_rows)), mode="edge")
        ctx = ForwardContext(self.attention, self.attention.build_metadata(layout, slot_mapping, upload), self.kv_cache)
        ids = upload(input_ids, torch.long)
        if pending is not None:
            ids[pending[0]] = pending[1]
        hidden = self.model(ids, upload(positions, torch.long), ctx)
        prompt_hidden = hidden[upload(prompt_rows, torch.long)] if prompt_rows else None
        if not len(logit_rows):
            return hidden.new_empty(0, 0), prompt_hidden
        logits = self.model.compute_logits(hidden[upload(logit_rows, torch.long)])
        return logits[:num_logit_rows], prompt_hidden
