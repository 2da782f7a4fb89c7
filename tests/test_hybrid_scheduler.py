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


def make(num_blocks=64, budget=32, max_seqs=16, predictor=None, **config) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, "m")
    return Scheduler(SchedulerConfig(max_seqs, budget, **config), kv, max_model_len=128, predictor=predictor)


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


def cost(shape) -> float:
    """A fixed step-time model: 10 ms plus 2 ms a token (an ITL SLO of 100 ms fits 45 tokens)."""
    return 0.010 + 0.002 * shape.num_tokens


def tokens_of(s: Scheduler, out: SchedulerOutput, offline: bool) -> int:
    return sum(n for rid, n in out.num_scheduled_tokens.items() if s.requests[rid].is_offline == offline)


def test_offline_fills_only_the_predicted_budget_while_online_runs():
    s = make(num_blocks=256, budget=64, predictor=cost)  # floor: ceil(0.05 * 64) = 4 tokens
    for i in range(4):
        s.add_request(req(f"on{i}", 8, max_tokens=12, arrival=i, start=10 * i + 1))
    for i in range(10):
        s.add_request(req(f"off{i}", 60, "offline", max_tokens=4, arrival=10 + i, start=200 + 60 * i))
    saw_cut, saw_full = False, False
    while s.requests:
        online_before = {r.request_id: r.num_tokens - r.num_computed_tokens
                         for r in s.running + s.waiting if not r.is_offline}
        out = s.schedule()
        online_ids = [rid for rid in out.num_scheduled_tokens if not s.requests[rid].is_offline]
        offline_tokens = tokens_of(s, out, offline=True)
        if online_ids:
            decoding = any(s.requests[rid].num_output_tokens > 0 for rid in online_ids)
            limit = 0.1 if decoding else 1.0
            # Online work is never cut for offline; offline past its floor keeps the step within the SLO.
            assert all(out.num_scheduled_tokens[rid] == online_before[rid] for rid in online_ids)
            if offline_tokens > 4:
                assert cost(s.last_shape) <= limit + 1e-12
            saw_cut |= decoding and offline_tokens > 4 and any(r.is_offline for r in s.waiting)  # held back
        elif offline_tokens > 45:
            saw_full = True  # no online work: offline takes the whole budget, past the SLO's 45 tokens
        sampled = {rid: [7] for rid, n in out.num_scheduled_tokens.items()
                   if s.requests[rid].num_computed_tokens + n >= s.requests[rid].num_tokens}
        s.update_from_output(out, ModelRunnerOutput(sampled))
    assert saw_cut and saw_full
    stats = s.stats()
    assert stats.num_preemptions == 0 and stats.offline_tokens == 10 * (60 + 3)  # each prompt and decode once


def test_fcfs_mixes_offline_in_like_online():
    s = make(budget=64, predictor=cost, scheduling_policy="fcfs")
    s.add_request(req("off", 40, "offline", arrival=0))
    s.add_request(req("on", 40, arrival=1, start=100))
    out = run_step(s)
    assert out.num_scheduled_tokens == {"off": 40, "on": 24}  # arrival order, offline first
    h = make(budget=64, predictor=cost)
    h.add_request(req("off", 40, "offline", arrival=0))
    h.add_request(req("on", 40, arrival=1, start=100))
    assert run_step(h).num_scheduled_tokens["on"] == 40  # hybrid: online first


def grow_until_preemption(s: Scheduler) -> SchedulerOutput:
    for _ in range(100):
        out = run_step(s)
        if out.preempted_req_ids:
            return out
    raise AssertionError("no preemption")


def test_offline_is_preempted_before_online_and_resumes_from_the_prefix_cache():
    s = make(num_blocks=16, budget=64, predictor=cost)  # 15 usable blocks of 4 tokens
    s.add_request(req("off", 12, "offline", max_tokens=30, arrival=0))
    s.add_request(req("on", 12, max_tokens=30, arrival=1, start=100))
    out = grow_until_preemption(s)
    assert out.preempted_req_ids == {"off"}
    computed_when_preempted = s.requests["off"].num_tokens - 1
    assert s.stats().num_preemptions_offline == 1 and s.stats().num_preemptions_online == 0
    resumed = []
    while not resumed:
        resumed = [c for c in run_step(s).scheduled_cached_reqs if c.resumed_from_preemption]
    assert resumed[0].request_id == "off"
    # Its full blocks came back from the prefix cache, but those the online request took since.
    assert 0 < resumed[0].num_computed_tokens < computed_when_preempted
    while s.requests:
        run_step(s)
    assert s.stats().num_preemptions_online == 0
    # The contrast: under fcfs the later request (here the online one) is the one preempted.
    f = make(num_blocks=16, budget=64, scheduling_policy="fcfs")
    f.add_request(req("off", 12, "offline", max_tokens=30, arrival=0))
    f.add_request(req("on", 12, max_tokens=30, arrival=1, start=100))
    assert grow_until_preemption(f).preempted_req_ids == {"on"}


def test_offline_gets_its_floor_under_constant_online_load():
    def slow(shape) -> float:
        return 10.0  # every step is over the SLO: only the floor is left for offline

    for share, progresses in ((0.05, True), (0.0, False)):
        s = make(budget=40, predictor=slow, offline_min_share=share)  # floor: 2 tokens a step
        s.add_request(req("off", 10, "offline", max_tokens=4, start=500))
        for step in range(40):
            s.add_request(req(f"on{step}", 40, max_tokens=1, arrival=step, start=1 + step))
            out = run_step(s)
            assert out.num_scheduled_tokens.get("off", 0) <= (2 if share else 0)
        assert ("off" not in s.requests) is progresses  # finished (10 prompt + 4 decode tokens) only with the floor


def test_offline_waiting_order_groups_shared_prefixes():
    prefix_a, prefix_b = list(range(1, 5)), list(range(50, 54))
    arrivals = [("a1", prefix_a), ("b1", prefix_b), ("a2", prefix_a), ("b2", prefix_b), ("a3", prefix_a)]

    def order(policy: str) -> list[str]:
        s = make(scheduling_policy=policy)
        for t, (rid, prefix) in enumerate(arrivals):
            s.add_request(Request(rid, [*prefix, 90 + t, 91], SamplingParams(max_tokens=2), frozenset({EOS}), 2,
                                  0, float(t), "offline"))
        s.add_request(req("online", 6, arrival=9.0, start=70))
        return [r.request_id for r in s.waiting]

    assert order("hybrid") == ["online", "a1", "a2", "a3", "b1", "b2"]
    assert order("fcfs") == ["a1", "b1", "a2", "b2", "a3", "online"]
