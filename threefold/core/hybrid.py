"""How many offline tokens one step may carry (HyGen-style SLO-aware budget, plain Python).

Online work is planned first. Offline tokens are then added, request by
request, only while the predicted time of the whole step stays within the
latency the step's online requests can afford:

- a step with online decodes is one inter-token gap for each: `online_itl_slo`;
- a step with only online prefill chunks spends a share of their TTFT: each of
  the ceil(prompt / token budget) chunks a prompt needs gets an equal share of
  `online_ttft_slo`.

A step without online work gives offline the whole token budget. Whatever the
online load, offline gets `offline_min_share` of the budget (reserved before
online is planned), so it never starves.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from threefold.config import SchedulerConfig
from threefold.core.request import Request
from threefold.core.step_cost import BatchShape

StepPredictor = Callable[[BatchShape], float]
"""Predicted seconds of a step of this shape (LinearStepModel, or a fixed function in tests)."""


class OfflineBudget:
    """One step's offline allowance: built after online is planned, asked per offline request."""

    def __init__(self, config: SchedulerConfig, predictor: StepPredictor | None, shape: BatchShape,
                 online: list[Request], online_waiting: bool) -> None:
        self.predictor = predictor
        self.shape = shape
        self.floor = floor_tokens(config)
        self.num_tokens = 0
        """Offline tokens granted so far this step."""
        self.limit = step_time_limit(config, online)
        self.unlimited = not online and not online_waiting
        self.exhausted = False

    def grant(self, request: Request, num_new: int) -> int:
        """How many of the num_new tokens this offline request may compute this step (0: stop asking)."""
        if self.exhausted or num_new <= 0:
            return 0
        granted = num_new if self.unlimited else self._fit(request, num_new)
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
        if self.predictor is None or self.limit is None:
            return 0  # uncalibrated: only the floor, online latency comes first
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
    return math.ceil(config.offline_min_share * config.max_num_batched_tokens)


def step_time_limit(config: SchedulerConfig, online: list[Request]) -> float | None:
    """Seconds the step may take for the online requests in it (None: there are none)."""
    limit = None
    for request in online:
        if request.num_output_tokens > 0 or request.num_computed_tokens >= request.num_prompt_tokens:
            share = config.online_itl_slo
        else:
            share = config.online_ttft_slo / math.ceil(request.num_prompt_tokens / config.max_num_batched_tokens)
        limit = share if limit is None else min(limit, share)
    return limit
