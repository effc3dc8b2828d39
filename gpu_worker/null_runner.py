"""A runner that computes nothing: every sampling chunk gets a placeholder token at once (`--load-format null`).

With it the server's whole path (HTTP, tokenizer workers, scheduler, sockets) runs at full speed while the
"GPU" costs nothing, so a serving benchmark against it measures the serving path's own ceiling, on any
machine. Tokens are a fixed function of (request, position) that never is an EOS id, so outputs are
repeatable and requests run to max_tokens.

$CLEARSERVE_NULL_STEP_S (seconds, default 0) makes every step take that long, the loop blocked as a real
device's step blocks it on a CPU: a slow device, or with a large value one that hangs, for tests of the
watchdog and of streams that stay open.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from common.config import EngineConfig
from common.messages import StepPlan, StepResult, StepTimings
from common.model_info import ModelInfo
from gpu_worker.limits import decide_limits

# KV blocks the scheduler may hand out when --num-kv-blocks is not given (nothing is allocated).
DEFAULT_NUM_KV_BLOCKS = 1 << 20
STEP_S_ENV = "CLEARSERVE_NULL_STEP_S"


@dataclass(slots=True)
class NullStep:
    step_id: int
    rids: list[int]
    token_ids: list[int]


class NullRunner:
    launches_async = False  # a step is done when launched
    device = "none"
    dtype = "none"

    def __init__(self, config: EngineConfig, info: ModelInfo):
        # No device: a CPU's limits where the flags leave them open.
        self.limits = decide_limits(config, info, False, config.num_kv_blocks or DEFAULT_NUM_KV_BLOCKS)
        self._eos = set(info.eos_token_ids)
        self._vocab_size = info.vocab_size
        self.step_s = float(os.environ.get(STEP_S_ENV, "0"))

    def token_at(self, rid: int, position: int) -> int:
        token = (rid * 7919 + position * 31) % self._vocab_size
        while token in self._eos:
            token = (token + 1) % self._vocab_size
        return token

    def launch(self, plan: StepPlan) -> NullStep:
        entries = zip(plan.rids, plan.starts, plan.num_tokens, plan.samples)
        sampling = [(rid, start + n) for rid, start, n, sample in entries if sample]
        tokens = [self.token_at(rid, position) for rid, position in sampling]
        if self.step_s:
            time.sleep(self.step_s)
        return NullStep(plan.step_id, [rid for rid, _ in sampling], tokens)

    @staticmethod
    def is_done(step: NullStep) -> bool:
        return True

    def finish(self, step: NullStep) -> StepResult:
        return StepResult(step.step_id, step.rids, step.token_ids, time.time(), StepTimings())
