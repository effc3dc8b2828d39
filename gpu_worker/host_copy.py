"""Host-to-device copies that never make the host wait.

`torch.tensor(values, device="cuda")` copies from pageable memory, which blocks the host until the
device has finished everything queued before it: with the next step launched while the previous one
runs, that would be a full stall per copy. Staged through pinned memory (torch's caching host
allocator keeps the buffer alive until the copy is done), the copy is queued and the host goes on.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values: np.ndarray | list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
