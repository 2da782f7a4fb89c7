"""How many offline tokens one step may carry (HyGen-style SLO-aware budget, plain Python).

Online work is planned first. Offline tokens are then added, request by
request, only while the predicted time of the whole step stays within the
step cap, `min(online_itl_slo, ARRIVAL_WAIT_SHARE * online_ttft_slo)`:

- a step without online work is cut at the cap. An online request that
  arrives meanwhile waits for the step in flight, so the cap bounds what
  offline work adds to a TTFT;
- a step of online decodes is cut at the cap, and at `1 + ONLINE_SLOWDOWN`
  times its predicted time without offline work, whichever is shorter;
- a step carrying an online prefill chunk, or one planned while online
  requests still wait (the budget, the sequences or the KV ran out), gets only
  the floor: padding it would push those requests' first tokens back, and at
  high load every second offline takes there is queueing added for online.

Whatever the online load, offline gets at least `offline_min_share` of the
tokens online computes in the step (one token at least; room for it is
reserved before online is planned; of the whole budget in a step without
online work, even where one token already breaks the cap), so it never starves, and a step of a few
online decodes carries a floor of a token or two, not a fixed chunk that would
dwarf it.
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

ONLINE_SLOWDOWN = 0.1
"""Most the offline tokens riding in a step of online decodes may lengthen it, as a share of its
predicted time without them: online inter-token latency stays within 10% of running alone, and the
idle time online leaves comes back as offline-only steps (filling every online step up to the ITL
SLO instead made each online decode several times slower, so online requests overlapped and the
idle time disappeared)."""


class OfflineBudget:
    """One step's offline allowance: built after online is planned, asked per offline request."""

    def __init__(self, config: SchedulerConfig, predictor: StepPredictor | None, shape: BatchShape,
                 online: list[Request], online_waiting: bool) -> None:
        self.predictor = predictor
        self.shape = shape
        # The floor scales with the step: offline's share of the tokens online computes in it (at least
        # one), or of the whole budget when nothing online runs: on a machine too slow for the cap,
        # offline alone must not crawl at one token a step.
        share = config.offline_min_share
        self.floor = 0 if share <= 0 else max(1, math.ceil(share * shape.num_tokens))
        if not online and not online_waiting:
            self.floor = floor_tokens(config)
        self.num_tokens = 0
        """Offline tokens granted so far this step."""
        self.limit = step_time_limit(config, online, online_waiting)
        if self.limit is not None and online and predictor is not None:
            self.limit = min(self.limit, (1 + ONLINE_SLOWDOWN) * predictor(shape))
        self.exhausted = False
        self.online_present = bool(online) or online_waiting

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


def step_time_limit(config: SchedulerConfig, online: list[Request], online_waiting: bool) -> float | None:
    """Seconds the step may take with offline work in it (None: offline gets only the floor)."""
    if online_waiting or any(_first_token_pending(r) for r in online):
        return None
    return step_cap(config)


def _first_token_pending(request: Request) -> bool:
    """A prefill chunk (first token) or a recompute after preemption: more than a decode's one token."""
    return request.num_output_tokens == 0 or request.num_computed_tokens < request.num_tokens - 1
