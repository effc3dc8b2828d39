"""Per-request token counts on the device, for the penalties: how often each token is in the output so
far, and whether it is in the prompt.

    output[slot, token]     int32   incremented on the device right after each sample (no host round trip,
                                    so a step launched before the previous one's tokens reached the host
                                    still sees them)
    in_prompt[slot, token]  bool

Rows are the runner's mirror slots. Allocated on first use: a server whose requests never ask for a
penalty spends no memory on them ([slots, vocab] each).
"""

from __future__ import annotations

import torch


class TokenCounts:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device):
        self.output = torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
        self.device = device

    def reset(self, slot: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Start a slot from its request's tokens (a resumed request brings its outputs so far)."""
        self.output[slot].zero_()
        self.in_prompt[slot].zero_()
        if prompt_ids:
            self.in_prompt[slot, torch.tensor(prompt_ids, device=self.device)] = True
        if output_ids:
            ids = torch.tensor(output_ids, device=self.device)
            self.output[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def add(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count one sampled token per (slot, token) pair."""
        self.output.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
