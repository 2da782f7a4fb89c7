"""Hybrid offline/online scheduling: request classes, the latency budget, preemption order, the floor.

Deterministic: hand-built Requests through the core Scheduler with a fixed step-time predictor.
"""

from __future__ import annotations

import pytest

from threefold.config import SchedulerConfig, parse_duration
from threefold.core import hybrid
from threefold.core.hybrid import floor_tokens, step_cap, step_time_limit
from threefold.core.kv_cache_manager import KVCacheManager
from threefold.core.outputs import ModelRunnerOutput, SchedulerOutput
from threefold.core.request import Request, RequestStatus, check_request_class
from threefold.core.scheduler import Scheduler
from threefold.core.step_cost import BatchShape, LinearStepModel
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


def slow_fixed(shape) -> float:
    """A step-time model with a large fixed part (weights streamed once a step): 50 ms plus 1 ms a token."""
    return 0.050 + 0.001 * shape.num_tokens


@pytest.fixture
def ride_now(monkeypatch):
    """Offline may ride online decode steps at once (no busy spell of BUSY_STEPS_TO_RIDE steps first)."""
    monkeypatch.setattr(hybrid, "BUSY_STEPS_TO_RIDE", 0)


def test_offline_fills_only_the_predicted_budget_while_online_runs(ride_now):
    s = make(num_blocks=256, budget=64, predictor=slow_fixed)
    for i in range(4):
        s.add_request(req(f"on{i}", 8, max_tokens=12, arrival=i, start=10 * i + 1))
    for i in range(10):
        s.add_request(req(f"off{i}", 60, "offline", max_tokens=4, arrival=10 + i, start=200 + 60 * i))
    reserve = floor_tokens(s.config)  # ceil(5% of 64) = 4: the most offline's floor may owe
    saw_cut, saw_full, saw_ride = False, False, False
    while s.requests:
        online_before = {r.request_id: (r.num_tokens - r.num_computed_tokens, r.num_computed_tokens)
                         for r in s.running + s.waiting if not r.is_offline}
        out = s.schedule()
        online_ids = [rid for rid in out.num_scheduled_tokens if not s.requests[rid].is_offline]
        offline_tokens = tokens_of(s, out, offline=True)
        if online_ids:
            # Online work is never cut for offline.
            assert all(out.num_scheduled_tokens[rid] == online_before[rid][0] for rid in online_ids)
            if any(s.requests[rid].num_output_tokens == 0 for rid in online_ids):
                assert offline_tokens <= reserve  # an online prompt: offline's floor at most, never the budget
            else:
                # Online decodes: within 20% of their own predicted step (and the 100 ms cap), or the floor.
                alone = BatchShape()
                for rid in online_ids:
                    alone.add(1, online_before[rid][1])
                assert offline_tokens <= reserve or slow_fixed(s.last_shape) <= min(0.1, 1.2 * slow_fixed(alone))
                saw_ride |= offline_tokens > reserve
            saw_cut |= any(r.is_offline for r in s.waiting)  # held back
        else:
            # No online work: offline alone, cut at the cap too (an online arrival waits for this step).
            assert slow_fixed(s.last_shape) <= 0.1 + 1e-12
            saw_full |= offline_tokens == 50  # 50 ms + 50 x 1 ms = the 100 ms cap, of a 64-token budget
        sampled = {rid: [7] for rid, n in out.num_scheduled_tokens.items()
                   if s.requests[rid].num_computed_tokens + n >= s.requests[rid].num_tokens}
        s.update_from_output(out, ModelRunnerOutput(sampled))
    assert saw_cut and saw_full and saw_ride
    stats = s.stats()
    assert stats.num_preemptions == 0 and stats.offline_tokens == 10 * (60 + 3)  # each prompt and decode once


def test_offline_rides_online_decode_steps_only_after_a_busy_spell(monkeypatch):
    """4 online decodes alone: 54 ms predicted. Offline may bring the step to 64.8 ms (10 tokens at the
    default 20%), not the 100 ms cap, and only once online work has kept the machine busy for a while:
    while idle steps come often, a decode step carries only offline's floor."""
    monkeypatch.setattr(hybrid, "BUSY_STEPS_TO_RIDE", 3)
    s = make(num_blocks=256, budget=64, predictor=slow_fixed)
    for i in range(4):
        s.add_request(req(f"on{i}", 4, max_tokens=40, start=10 * i + 1))
    run_step(s)  # the online prefills (offline not yet queued)
    s.add_request(req("off", 60, "offline", max_tokens=4, start=200))
    riding = [tokens_of(s, run_step(s), offline=True) for _ in range(5)]
    # Busy steps 0, 1, 2: the floor (5% of 4 online tokens a step, owed: one token, then 0.8 of credit).
    assert riding == [1, 0, 0, 10, 10]
    s.finish_requests([f"on{i}" for i in range(4)], RequestStatus.FINISHED_ABORTED)
    assert tokens_of(s, run_step(s), offline=True) == 39  # offline alone: the rest of its prompt (the cap fits 50)
    s.add_request(req("on9", 4, max_tokens=40, start=100))
    run_step(s)  # the online prompt: no offline
    assert tokens_of(s, run_step(s), offline=True) == 0  # after an idle step: no riding, the floor is in credit


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


def test_offline_is_preempted_before_online_and_resumes_from_the_prefix_cache(ride_now):
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
        s = make(budget=40, predictor=slow, offline_min_share=share)  # floor: ceil(5% of 38 online tokens) = 2
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


def test_linear_step_model_recovers_a_linear_cost():
    # seconds: fixed, per token, per sequence, per prefill chunk (its own attention call), per attention pair
    true = (0.004, 0.0003, 0.0002, 0.003, 2e-8)

    def seconds(shape: BatchShape) -> float:
        return (true[0] + true[1] * shape.num_tokens + true[2] * shape.num_seqs + true[3] * shape.num_chunks
                + true[4] * shape.attention_pairs)

    model = LinearStepModel()
    for tokens, seqs, ctx in ((1, 1, 10), (64, 1, 0), (512, 1, 0), (32, 32, 500), (128, 8, 2000), (256, 2, 100),
                              (8, 8, 100)):
        shape = BatchShape()
        for i in range(seqs):
            shape.add(tokens // seqs, ctx + i)
        model.observe(shape, seconds(shape))
    probe = BatchShape()
    for _ in range(16):
        probe.add(1, 1000)  # decodes: no chunk
    probe.add(4, 300)  # one small prompt chunk beside them
    assert (probe.num_seqs, probe.num_chunks) == (17, 1)
    assert model(probe) == pytest.approx(seconds(probe), rel=0.05)


def test_linear_step_model_does_not_overcharge_when_a_coefficient_would_be_negative():
    # One-prompt forwards of 1, 64 and 256 tokens (the engine's calibration): the fit wants a negative
    # per-chunk cost. Clamping it to zero after the solve predicted the 64-token step 23% high (every
    # residual positive); re-solving without that feature keeps the fit unbiased.
    profile = {1: 0.030, 64: 0.050, 256: 0.150}
    model = LinearStepModel.from_profile(profile)
    shapes = {n: BatchShape() for n in profile}
    for n, shape in shapes.items():
        shape.add(n, 0)
    residuals = [model(shapes[n]) - seconds for n, seconds in profile.items()]
    assert min(model.coefficients) >= 0.0
    assert abs(sum(residuals)) < 1e-3 and min(residuals) < 0  # over and under, not always over
    assert model(shapes[64]) == pytest.approx(0.050, rel=0.1)


def test_engine_offline_greedy_outputs_equal_online(make_llm):
    llm = make_llm(kv_cache_memory=16 << 20, max_model_len=256)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(max_tokens=8, temperature=0)
    online = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    offline = [o.outputs[0].token_ids for o in llm.generate(prompts, params, request_class="offline")]
    assert offline == online
    engine = llm.engine
    assert engine.core.scheduler.predictor is not None  # calibrated when the first offline request came
    for i, prompt in enumerate(prompts):  # both classes in the same steps
        engine.add_request(f"mix{i}", prompt, params, request_class="offline" if i % 2 else "online")
    mixed: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        mixed.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert [mixed[f"mix{i}"] for i in range(3)] == online
    stats = engine.get_stats()
    assert stats.offline_tokens > 0 and stats.num_running_offline == stats.num_waiting_offline == 0
    with pytest.raises(ThreefoldError, match="request_class"):
        llm.generate(prompts[:1], params, request_class="batch")


def test_metrics_report_queues_tokens_and_preemptions_by_class(ride_now):
    from threefold.server.metrics import ServerMetrics
    s = make(num_blocks=16, budget=64, predictor=cost)
    s.add_request(req("off", 12, "offline", max_tokens=30, arrival=0))
    s.add_request(req("on", 12, max_tokens=30, arrival=1, start=100))
    s.add_request(req("off2", 12, "offline", max_tokens=30, arrival=2, start=300))
    grow_until_preemption(s)
    metrics = ServerMetrics("m")
    metrics.on_step(s.stats(), [], 0.0)
    text = metrics.render().decode()
    stats = s.stats()
    # Offline rides the online decode steps (one token each: 12 ms alone, 14.4 at 20%), so off2 never started.
    assert (stats.num_running, stats.num_running_offline, stats.num_waiting_offline) == (1, 0, 2)
    assert 'threefold:num_requests_running_by_class{model_name="m",request_class="online"} 1.0' in text
    assert 'threefold:num_requests_waiting_by_class{model_name="m",request_class="offline"} 2.0' in text
    assert 'threefold:num_requests_waiting_by_class{model_name="m",request_class="online"} 0.0' in text
    assert f'threefold:offline_tokens_total{{model_name="m"}} {float(stats.offline_tokens)}' in text
    assert 'threefold:num_preemptions_by_class_total{model_name="m",request_class="offline"} 1.0' in text
    assert 'threefold:num_preemptions_by_class_total{model_name="m",request_class="online"} 0.0' in text


def test_offline_alone_keeps_steps_short_enough_for_an_online_arrival():
    # The cap: min(ITL SLO, 10% of the TTFT SLO). 100 ms fits 45 tokens, 20 ms fits 5.
    for ttft, itl, expected in ((1.0, 0.1, 45), (5.0, 0.1, 45), (0.2, 0.1, 5), (1.0, 0.02, 5)):
        s = make(num_blocks=128, budget=64, predictor=cost, online_ttft_slo=ttft, online_itl_slo=itl)
        assert step_cap(s.config) == pytest.approx(min(itl, ttft / 10))
        s.add_request(req("off", 100, "offline"))
        assert run_step(s).num_scheduled_tokens == {"off": expected}
    slow = make(num_blocks=128, budget=64, predictor=lambda shape: 10.0)  # one token already breaks the cap
    slow.add_request(req("off", 100, "offline"))
    assert run_step(slow).num_scheduled_tokens == {"off": 4}  # the floor: ceil(5% of the 64-token budget)
    u = make(num_blocks=128, budget=64)  # not calibrated and nothing online: all of it
    u.add_request(req("off", 100, "offline"))
    assert run_step(u).num_scheduled_tokens == {"off": 64}


def test_a_step_with_an_online_prompt_carries_no_offline_work(ride_now):
    """The prompt steps are the online TTFT and the ITL tail: offline adds nothing there, whatever the slowdown."""
    for slowdown, riders in ((0.1, 0), (0.5, 3), (0.0, 0)):
        s = make(num_blocks=256, budget=64, predictor=cost, online_slowdown=slowdown)
        for i in range(3):
            s.add_request(req(f"off{i}", 30, "offline", max_tokens=20, arrival=i, start=100 + 40 * i))
        run_step(s)  # offline alone: 45 tokens (the cap): off0's prompt and 15 of off1's
        s.add_request(req("on", 20, max_tokens=8, arrival=9, start=500))
        out = run_step(s)
        # The online prompt (20 tokens, 50 ms alone) goes whole and alone, though 100 ms would fit 25 more.
        assert out.num_scheduled_tokens == {"on": 20}
        out = run_step(s)  # now the online request decodes (12 ms alone): offline rides within the share
        assert out.num_scheduled_tokens["on"] == 1
        # 50%: 18 ms, 3 tokens (off0's decode first, then 2 of off1's prompt); 10%: 13.2 ms, none; and no
        # floor either, as the offline-only step above earned offline its credit.
        assert tokens_of(s, out, offline=True) == riders
        if riders:
            assert out.num_scheduled_tokens["off0"] == 1


def test_the_floor_owed_in_a_prompt_step_is_paid_in_the_next_decode_step():
    s = make(num_blocks=256, budget=64, predictor=cost)
    s.add_request(req("off", 30, "offline", max_tokens=20, start=100))
    s.add_request(req("on0", 4, max_tokens=20, start=1))
    run_step(s)  # the first online prompt; offline waits (owed 0.2)
    s.add_request(req("on1", 40, max_tokens=20, start=300))
    out = run_step(s)  # on1's prompt and on0's decode: 41 online tokens
    assert out.num_scheduled_tokens == {"on0": 1, "on1": 40}  # owed 0.2 + 2.05 = 2.25, under the reserve (4)
    out = run_step(s)  # two online decodes: the debt is paid here
    assert out.num_scheduled_tokens == {"on0": 1, "on1": 1, "off": 3}  # ceil(2.25 + 0.1)
    assert s.offline_owed == pytest.approx(2.35 - 3)  # ahead by 0.65: the next steps owe nothing until it is spent
    assert "off" not in run_step(s).num_scheduled_tokens


def test_step_time_limit_by_step_kind():
    config = SchedulerConfig(online_ttft_slo=2.0, online_itl_slo=0.05, online_slowdown=0.2)  # type: ignore[arg-type]
    prefill = req("p", 10)
    decode = req("d", 10)
    decode.num_computed_tokens = 10
    decode.append_output_token(5)  # 11 tokens, 10 computed: the next step is one decode
    recompute = req("r", 10)
    recompute.append_output_token(5)  # preempted (nothing computed): a recompute, not a decode
    assert step_time_limit(config, [], False, None) == pytest.approx(0.05)  # offline alone: the cap
    assert step_time_limit(config, [decode], False, 0.03) == pytest.approx(0.036)  # 1.2 x alone
    assert step_time_limit(config, [decode], False, 0.045) == pytest.approx(0.05)  # ... within the cap
    assert step_time_limit(config, [decode, prefill], False, 0.5) is None  # an online prompt: the floor only
    assert step_time_limit(config, [recompute], False, 0.5) is None
    assert step_time_limit(config, [decode], False, None) is None  # not calibrated: floor only
    assert step_time_limit(config, [decode], True, 0.03) is None  # online queued: floor only
    assert step_time_limit(config, [], True, None) is None
    busy = hybrid.BUSY_STEPS_TO_RIDE
    assert step_time_limit(config, [decode], False, 0.03, busy_steps=busy - 1) is None  # idle steps came lately
    assert step_time_limit(config, [decode], False, 0.03, busy_steps=busy) == pytest.approx(0.036)
    assert step_time_limit(config, [], False, None, busy_steps=0) == pytest.approx(0.05)


def test_online_slowdown_is_a_validated_knob():
    assert SchedulerConfig().online_slowdown == pytest.approx(0.2)
    for bad in (-0.1, 11.0, float("nan")):
        with pytest.raises(ThreefoldError, match="online_slowdown must be within"):
            SchedulerConfig(online_slowdown=bad)
    from threefold.cli import build_parser, engine_args_from
    ns = build_parser().parse_args(["serve", "--online-slowdown", "0.3"])
    assert engine_args_from(ns).configs()[2].online_slowdown == pytest.approx(0.3)


def test_cli_reads_the_slos_as_durations():
    from threefold.cli import build_parser, engine_args_from
    ns = build_parser().parse_args(["serve", "--online-ttft-slo", "1.5s", "--online-itl-slo", "80ms",
                                    "--scheduling-policy", "fcfs", "--offline-min-share", "0.1"])
    sched = engine_args_from(ns).configs()[2]
    assert (sched.online_ttft_slo, sched.scheduling_policy, sched.offline_min_share) == (1.5, "fcfs", 0.1)
    assert sched.online_itl_slo == pytest.approx(0.08)


def test_a_waiting_offline_request_never_preempts_a_running_one():
    s = make(num_blocks=8, budget=64, predictor=cost)  # 7 usable blocks
    s.add_request(req("late-group", 20, "offline", max_tokens=8, arrival=5, start=300))
    run_step(s)  # 5 blocks held, 2 free
    s.add_request(req("early", 12, "offline", arrival=0))  # sorts ahead (earlier group), needs 3 blocks
    assert s.waiting[0].sort_key() < s.running[-1].sort_key()
    for _ in range(3):
        out = run_step(s)
        assert not out.preempted_req_ids and "early" not in out.num_scheduled_tokens
    s.add_request(req("online", 12, arrival=9))  # online work does take the room
    assert run_step(s).preempted_req_ids == {"late-group"}


def test_offline_alone_is_cut_at_the_cap_even_across_requests():
    """The floor (5% of a 2,048-token budget: 103 tokens, 216 ms here) no longer tops a step up past the cap."""
    s = make(num_blocks=512, budget=2048, predictor=cost)
    for i in range(6):
        s.add_request(req(f"off{i}", 30, "offline", max_tokens=8, arrival=i, start=100 + 40 * i))
    for _ in range(12):
        out = run_step(s)
        assert cost(s.last_shape) <= 0.1 + 1e-12 and 0 < out.total_num_scheduled_tokens <= 45


def weights_bound(shape) -> float:
    """A CPU-like step: 40 ms to read the weights once, 1 ms a token of arithmetic."""
    return 0.040 + 0.001 * shape.num_tokens


def test_offline_decodes_ride_along_online_decodes_within_the_slowdown(ride_now):
    for slowdown, riders in ((0.1, 4), (0.5, 8)):
        s = make(num_blocks=512, budget=256, predictor=weights_bound, online_slowdown=slowdown)
        for i in range(8):
            s.add_request(req(f"off{i}", 12, "offline", max_tokens=40, arrival=i, start=100 + 20 * i))
        s.add_request(req("long", 200, "offline", max_tokens=4, arrival=20, start=400))  # a prompt left waiting
        while any(r.num_output_tokens == 0 for r in s.running if r.request_id != "long") or len(s.running) < 8:
            run_step(s)  # offline alone prefills the 8 short prompts (capped steps)
        for i in range(4):
            s.add_request(req(f"on{i}", 8, max_tokens=20, arrival=30 + i, start=700 + 10 * i))
        run_step(s)  # the online prompts: 72 ms alone, and no offline beside them
        for _ in range(5):
            out = run_step(s)
            assert tokens_of(s, out, offline=False) == 4  # 4 online decodes: 44 ms alone
            offline = {rid: n for rid, n in out.num_scheduled_tokens.items() if s.requests[rid].is_offline}
            # 10%: 4.4 ms = 4 tokens; 50%: 22 ms fits 22, but only 8 offline requests decode: the rest of
            # the time goes to the waiting prompt. Offline decodes first, one token each.
            assert sum(1 for n in offline.values() if n == 1) == riders
            assert weights_bound(s.last_shape) <= (1 + slowdown) * 0.044 + 1e-12
            if slowdown == 0.5:
                assert offline.get("long", 0) == 22 - riders


def test_preemption_under_kv_pressure_never_takes_a_request_scheduled_in_the_same_step():
    import random
    rng = random.Random(0)
    s = make(num_blocks=24, budget=48, predictor=weights_bound, online_slowdown=1.0)
    for i in range(12):
        s.add_request(req(f"off{i}", rng.randint(3, 20), "offline", max_tokens=rng.randint(2, 12), arrival=i,
                          start=100 + 30 * i))
    for step in range(400):
        if step % 7 == 0 and step < 100:
            s.add_request(req(f"on{step}", rng.randint(3, 12), max_tokens=rng.randint(2, 8), arrival=50 + step,
                              start=600 + 15 * step))
        out = run_step(s)
        assert not set(out.num_scheduled_tokens) & out.preempted_req_ids
        if not s.requests:
            break
    assert not s.requests and s.kv.pool.num_free_blocks == 23  # everything finished, every block back
