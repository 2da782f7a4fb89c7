"""How many offline tokens one step may carry (HyGen-style SLO-aware budget, plain Python).

Online work is planned first. Offline tokens are then added, request by
request (decodes first: see Scheduler._schedule_hybrid), only while the
predicted time of the whole step stays within its limit:

- a step without online work is cut at the cap, `min(online_itl_slo,
  ARRIVAL_WAIT_SHARE * online_ttft_slo)`: an online request that arrives
  meanwhile waits for the step in flight, so the cap bounds what offline work
  adds to a TTFT. Its floor applies only where one token already breaks the cap;
- a step carrying online work may grow to `1 + online_slowdown` times its
  predicted time without offline work (SchedulerConfig.online_slowdown, 10% by
  default), and a step of online decodes no further than the cap: every online
  decode gap and prefill chunk stays within that share of running alone;
- a step planned while online requests still wait (the budget, the sequences or
  the KV ran out) gets only the floor: at that load every second offline takes
  is queueing added for online.

On a CPU the slack is the weights: a step reads them once whatever it carries,
so a few offline decodes beside online ones cost a token's arithmetic each,
while alone they would pay a whole step (the predictor's fixed cost). Idle time
comes back as capped offline-only steps, where offline prompts are prefilled.

Whatever the online load, offline gets at least `offline_min_share` of the
tokens online computes in the step (one token at least; room for it is
reserved before online is planned), so it never starves.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from threefold.config import SchedulerConfig
from threefold.core.request import Request
from threefold.core.step_cost import BatchShape

StepPredictor = Callable[[BatchShape], float]
"""Predicted seconds of a step of this shape (LinearStepModel, or a fixed function in tests)."""

ARRIVAL_WAIT_SHARE = 0.1
"""Most of online_ttft_slo an online arrival may wait for a step that carries offline work (its cap)."""


class OfflineBudget:
    """One step's offline allowance: built after online is planned, asked per offline request."""

    def __init__(self, config: SchedulerConfig, predictor: StepPredictor | None, shape: BatchShape,
                 online: list[Request], online_waiting: bool) -> None:
        self.predictor = predictor
        self.shape = shape
        self.online_present = bool(online) or online_waiting
        alone = predictor(shape) if predictor is not None and online else None
        self.limit = step_time_limit(config, online, online_waiting, alone)
        # The floor scales with the step: offline's share of the tokens online computes in it (at least one).
        share = config.offline_min_share
        self.floor = 0 if share <= 0 else max(1, math.ceil(share * shape.num_tokens))
        if not self.online_present:
            # Offline alone: the cap rules (an online arrival waits for this step). Only on a machine too
            # slow for one token within it does the floor, a share of the whole budget, keep offline moving.
            fits = predictor is None or self.limit is None or predictor(shape.plus(1, 0)) <= self.limit
            self.floor = 0 if fits else floor_tokens(config)
        self.num_tokens = 0
        """Offline tokens granted so far this step."""
        self.exhausted = False

    def grant(self, request: Request, num_new: int) -> int:
        """How many of the num_new tokens this offline request may compute this step (0: stop asking)."""
        if self.exhausted or num_new <= 0:
            return 0
        granted = self._fit(request, num_new)
        if granted == 0:
            granted = min(num_new, self.floor - self.num_tokens)
        if granted <= 0:
            self.exhausted = True
            return 0
        self.num_tokens += granted
        self.shape.add(granted, request.num_computed_tokens)
        return granted

    def _fit(self, request: Request, num_new: int) -> int:
        """Largest x <= num_new whose step still meets the limit (the prediction grows with x)."""
        if self.limit is None:
            return 0  # floor only
        if self.predictor is None:
            return 0 if self.online_present else num_new  # uncalibrated: online latency comes first
        computed = request.num_computed_tokens
        low, high = 0, num_new
        while low < high:
            mid = (low + high + 1) // 2
            if self.predictor(self.shape.plus(mid, computed)) <= self.limit:
                low = mid
            else:
                high = mid - 1
        return low


def floor_tokens(config: SchedulerConfig) -> int:
    """Tokens held back from online planning so the floor always has room."""
    return math.ceil(config.offline_min_share * config.max_num_batched_tokens)


def step_cap(config: SchedulerConfig) -> float:
    """Seconds a step with offline work past the floor may take: one ITL, and a small share of a TTFT."""
    return min(config.online_itl_slo, ARRIVAL_WAIT_SHARE * config.online_ttft_slo)


def step_time_limit(config: SchedulerConfig, online: list[Request], online_waiting: bool,
                    alone: float | None) -> float | None:
    """Seconds the step may take with offline work in it (None: offline gets only the floor).

    alone: the predicted seconds of the step's online work (None: not calibrated, or no online work)."""
    if online_waiting:
        return None
    if not online:
        return step_cap(config)
    if alone is None:
        return None  # not calibrated yet: online latency comes first
    limit = (1 + config.online_slowdown) * alone
    if any(_first_token_pending(r) for r in online):
        return limit  # a prefill chunk: its first token (and the decodes beside it) stretch by the share at most
    return min(limit, step_cap(config))


def _first_token_pending(request: Request) -> bool:
    """A prefill chunk (first token) or a recompute after preemption: more than a decode's one token."""
    return request.num_output_tokens == 0 or request.num_computed_tokens < request.num_tokens - 1
