"""What one forward needs besides the token ids: passed explicitly, layer to layer (no global state)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpu_worker.attention.base import AttentionBackend
from gpu_worker.kv_cache import PagedKVCache


@dataclass(slots=True)
class ForwardContext:
    attention: AttentionBackend
    attn_metadata: Any
    kv_cache: PagedKVCache
