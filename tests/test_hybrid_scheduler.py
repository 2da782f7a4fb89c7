"""Hybrid offline/online scheduling: request classes, the latency budget, preemption order, the floor.

Deterministic: hand-built Requests through the core Scheduler with a fixed step-time predictor.
"""

from __future__ import annotations

import pytest

from threefold.config import SchedulerConfig, parse_duration
from threefold.core.kv_cache_manager import KVCacheManager
from threefold.core.outputs import ModelRunnerOutput, SchedulerOutput
from threefold.core.request import Request, check_request_class
from threefold.core.scheduler import Scheduler
from threefold.errors import ThreefoldError
from threefold.sample.params import SamplingParams

BLOCK = 4
EOS = 0


def make(num_blocks=64, budget=32, max_seqs=16, **config) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, "m")
    return Scheduler(SchedulerConfig(max_seqs, budget, **config), kv, max_model_len=128)


def req(request_id: str, num_tokens: int, cls="online", max_tokens=4, arrival=0.0, start=1) -> Request:
    return Request(request_id, list(range(start, start + num_tokens)), SamplingParams(max_tokens=max_tokens),
                   frozenset({EOS}), max_tokens, 0, arrival, cls)


def run_step(s: Scheduler, token=7) -> SchedulerOutput:
    out = s.schedule()
    sampled = {rid: [token] for rid, n in out.num_scheduled_tokens.items()
               if s.requests[rid].num_computed_tokens + n >= s.requests[rid].num_tokens}
    s.update_from_output(out, ModelRunnerOutput(sampled))
    return out


def test_request_class_is_validated():
    assert check_request_class("offline") == "offline"
    with pytest.raises(ThreefoldError, match="request_class must be one of"):
        check_request_class("batch")
    with pytest.raises(ThreefoldError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lottery")


def test_durations_parse():
    assert parse_duration("100ms") == pytest.approx(0.1)
    assert parse_duration("1s") == 1.0 and parse_duration(0.25) == 0.25 and parse_duration("2") == 2.0
    assert SchedulerConfig(online_itl_slo="50ms").online_itl_slo == pytest.approx(0.05)  # type: ignore[arg-type]
    for bad in ("fast", "-1s", "0"):
        with pytest.raises(ThreefoldError, match="duration"):
            parse_duration(bad, "online_itl_slo")


def test_offline_queue_limit():
    s = make(max_offline_queued_tokens=30)
    s.add_request(req("a", 10, "offline", max_tokens=10))  # 20 of 30
    with pytest.raises(ThreefoldError, match="offline queue is full") as info:
        s.add_request(req("b", 8, "offline", max_tokens=4))
    assert info.value.status_code == 429
    s.add_request(req("c", 100, "online", max_tokens=4))  # online work is not counted
    while "a" in s.requests:
        run_step(s)
    s.add_request(req("b", 8, "offline", max_tokens=4))  # room again once "a" finished
