"""How many offline tokens one step may carry (HyGen-style SLO-aware budget, plain Python).

Online work is planned first. Offline tokens are then added, request by
request (decodes first: see Scheduler._schedule_hybrid), only while the
predicted time of the whole step stays within its limit, which depends on
what online work the step carries:

- none: the step is cut at the cap, `min(online_itl_slo, ARRIVAL_WAIT_SHARE *
  online_ttft_slo)`: an online request that arrives meanwhile waits for the step
  in flight, so the cap bounds what offline work adds to a TTFT. This is where
  offline prompts are prefilled;
- an online prompt (a first token or a recompute): no offline work past the
  floor. These steps are the online TTFT and the ITL tail (every running
  request's decode gap in such a step is a prompt's prefill long), so they run
  as online alone would;
- online decodes only: `1 + online_slowdown` times its predicted time without
  offline work (and the cap), but only while the machine has been busy for
  BUSY_STEPS_TO_RIDE steps, no offline-only step among them. A step reads the
  weights once, so offline decodes beside online ones are the cheapest offline
  tokens there are; but every millisecond added to a decode step lengthens each
  online request's life, so more of them are in flight when a long prompt runs
  and more decode gaps land in the tail. At low load, where the ITL p99 sits at
  the edge between decode gaps and prompt gaps, that moves the p99 even though
  each decode step stays far under it; idle gaps give offline its room there;
- online requests still waiting (the budget, the sequences or the KV ran out):
  the floor only, as every second offline takes is queueing added for online.

The floor: offline is owed `offline_min_share` of every token online computes
and is paid where it costs online least (floor_of_step), so it never starves;
tokens it gets in idle steps count toward it. Room for the floor is reserved
before online is planned.
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

BUSY_STEPS_TO_RIDE = 200
"""Steps with online work, none offline-only between them, before offline rides beside online decodes
(about 4-6 s of steps at 20-30 ms). Fewer let offline into decode steps at 30% load, where idle gaps
already give it room, and the ITL p99 moved by 1.2-2x in the scheduler simulated on this machine's step
times (BENCHMARKS.md, "Hybrid offline/online")."""


class OfflineBudget:
    """One step's offline allowance: built after online is planned, asked per offline request."""

    def __init__(self, config: SchedulerConfig, predictor: StepPredictor | None, shape: BatchShape,
                 online: list[Request], online_waiting: bool, owed: float = 0.0,
                 busy_steps: int | None = None) -> None:
        """owed: floor tokens carried from earlier steps (Scheduler.offline_owed); busy_steps: steps with
        online work since the last offline-only one (None: not counted, as if busy for long)."""
        self.predictor = predictor
        self.shape = shape
        self.online_present = bool(online) or online_waiting
        alone = predictor(shape) if predictor is not None and online else None
        self.limit = step_time_limit(config, online, online_waiting, alone, busy_steps)
        self.owed = owed + config.offline_min_share * shape.num_tokens
        """Floor tokens owed to offline, this step's share of online's tokens included."""
        self.floor = floor_of_step(config, self.owed, online, self.online_present)
        if not self.online_present:
            # Offline alone: the cap rules (an online arrival waits for this step). Only on a machine too
            # slow for one token within it does the floor, a share of the whole budget, keep offline moving.
            fits = predictor is None or self.limit is None or predictor(shape.plus(1, 0)) <= self.limit
            self.floor = 0 if fits else floor_tokens(config)
        self.num_tokens = 0
        """Offline tokens granted so far this step."""
        self.exhausted = False

    def still_owed(self, config: SchedulerConfig) -> float:
        """Floor tokens carried to the next step: owed (> 0) or, after offline ran ahead, credit (< 0), at
        most the reserve either way. Idle steps earn the credit, so at low load the floor costs online
        nothing; under constant online load offline still gets its share, at most a reserve late."""
        reserve = floor_tokens(config)
        return min(max(self.owed - self.num_tokens, -reserve), reserve)

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
    """Tokens held back from online planning so the floor always has room (also the most it may owe)."""
    return math.ceil(config.offline_min_share * config.max_num_batched_tokens)


def floor_of_step(config: SchedulerConfig, owed: float, online: list[Request], online_present: bool) -> int:
    """Offline tokens this step grants whatever its limit: the floor owed so far, paid in a step of
    online decodes (a token costs there what it costs anywhere, and adds no prompt's worth to a gap).
    A step carrying an online prompt pays only once the debt reaches the reserve, which happens only
    when online prompts leave no other step to pay in."""
    if config.offline_min_share <= 0 or not online_present or owed <= 0:
        return 0
    if any(_first_token_pending(r) for r in online):
        return math.ceil(owed) if owed >= floor_tokens(config) else 0
    return math.ceil(owed)


def step_cap(config: SchedulerConfig) -> float:
    """Seconds a step with offline work past the floor may take: one ITL, and a small share of a TTFT."""
    return min(config.online_itl_slo, ARRIVAL_WAIT_SHARE * config.online_ttft_slo)


def step_time_limit(config: SchedulerConfig, online: list[Request], online_waiting: bool,
                    alone: float | None, busy_steps: int | None = None) -> float | None:
    """Seconds the step may take with offline work in it (None: offline gets only the floor).

    alone: the predicted seconds of the step's online work (None: not calibrated, or no online work);
    busy_steps: steps with online work since the last offline-only one (None: not counted)."""
    if online_waiting:
        return None
    if not online:
        return step_cap(config)
    if alone is None:
        return None  # not calibrated yet: online latency comes first
    if any(_first_token_pending(r) for r in online):
        return None  # an online prompt: its TTFT and the ITL tail
    if busy_steps is not None and busy_steps < BUSY_STEPS_TO_RIDE:
        return None  # idle gaps come often enough: offline takes those
    return min((1 + config.online_slowdown) * alone, step_cap(config))


def _first_token_pending(request: Request) -> bool:
    """A prefill chunk (first token) or a recompute after preemption: more than a decode's one token."""
    return request.num_output_tokens == 0 or request.num_computed_tokens < request.num_tokens - 1
