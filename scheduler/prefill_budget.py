"""The prompt tokens a step may compute: fixed (--max-num-batched-tokens N), or sized from measured step times so
that a step mixing prompts with decodes stays within an ITL target (--max-num-batched-tokens auto).

Every decode in a step waits for the whole step, so a step's time is its decodes' inter-token latency. Steps
are timed where the worker runs them back to back (the plan was sent before the previous step's tokens were
read), as the gap between the two steps' sampled times; idle gaps would read as slow steps. Over the last
WINDOW such steps a least-squares line

    step time ≈ fixed + per_token × prompt tokens

gives the budget that keeps a step at the target: (target - fixed - margin) / per_token, within [FLOOR, the
worker's ceiling] (its buffers and graphs are sized for the ceiling). The line predicts a step's mean time, and an
ITL target is met when nearly every step meets it (the SLO is a p99), so the margin is the fit's residual spread
times P99_Z, the 99th percentile were the residuals normal: steps that vary by a few ms around the line (the
decodes' contexts grow, graphs pad) leave that much room. Until the line is known (WINDOW steps, prompt
token counts that differ) the budget is the ceiling, as it is for a fixed budget.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WINDOW = 64  # steps the line is fitted over: a few hundred milliseconds on a GPU
REFIT_EVERY = 8  # results between fits (a fit is ~WINDOW multiply-adds of Python)
FLOOR = 256  # prompt tokens a step may always take: prompts keep moving when decodes alone fill the target
P99_Z = 2.33  # standard deviations of the residuals kept free: a normal's 99th percentile


@dataclass(slots=True)
class PrefillBudget:
    ceiling: int  # the worker's max_num_batched_tokens
    target_s: float | None = None  # None: the budget is the ceiling
    tokens: int = field(init=False)  # the budget now
    fixed_s: float = field(init=False, default=0.0)  # the line, once fitted
    per_token_s: float = field(init=False, default=0.0)
    # step_id: (prompt tokens, planned at), for the plans in flight
    _planned: dict[int, tuple[int, float]] = field(init=False, default_factory=dict)
    _last_sampled: float = field(init=False, default=0.0)
    _samples: deque[tuple[int, float]] = field(init=False, default_factory=lambda: deque(maxlen=WINDOW))
    _since_fit: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.tokens = self.ceiling

    def planned(self, step_id: int, prompt_tokens: int, now: float) -> None:
        if self.target_s is not None:
            self._planned[step_id] = (prompt_tokens, now)

    def on_result(self, step_id: int, sampled_time: float) -> None:
        if self.target_s is None:
            return
        entry = self._planned.pop(step_id, None)
        previous, self._last_sampled = self._last_sampled, sampled_time
        if entry is None or not previous:
            return
        prompt_tokens, planned_at = entry
        if planned_at > previous:
            return  # the worker waited for this plan: the gap is not the step's time
        self._samples.append((prompt_tokens, sampled_time - previous))
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY and len(self._samples) == WINDOW:
            self._since_fit = 0
            self._fit()

    def _fit(self) -> None:
        assert self.target_s is not None
        n = len(self._samples)
        mean_x = sum(x for x, _ in self._samples) / n
        mean_y = sum(y for _, y in self._samples) / n
        var_x = sum((x - mean_x) ** 2 for x, _ in self._samples)
        # Every step took as many prompt tokens (a backlog, each step at the budget): no slope to read, but the
        # fixed part (the decode batch) may have grown under the slope already known.
        slope = sum((x - mean_x) * (y - mean_y) for x, y in self._samples) / var_x if var_x else self.per_token_s
        if slope <= 0:
            return  # prompt tokens cost nothing measurable (noise), or no slope yet: keep what there is
        self.per_token_s, self.fixed_s = slope, mean_y - slope * mean_x
        squares = sum((y - self.fixed_s - slope * x) ** 2 for x, y in self._samples)
        spread_s = (squares / max(1, n - 2)) ** 0.5  # the residuals' standard deviation around the line
        budget = int((self.target_s - self.fixed_s - P99_Z * spread_s) / slope)
        self.tokens = max(min(FLOOR, self.ceiling), min(self.ceiling, budget))
