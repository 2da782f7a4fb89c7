"""Simulator: an analytic queue (M/D/1), determinism, calibration files, prefix-cache accounting, policies."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random

import pytest

from threefold.core.block_pool import BlockPool
from threefold.engine.step_log import LoggedStep
from threefold.errors import ThreefoldError
from threefold.router.policies import policy_names
from threefold.sim.block_pool import SimBlockPool
from threefold.sim.delays import ACCEPT, ENGINE_TTFT, FIRST_TOKEN, Delays, Scrape, delays_between
from threefold.sim.engine_model import EngineModel, StepPoint, attention_pairs
from threefold.sim.instance import Instance, SimRequest
from threefold.sim.simulator import Simulator, simulate
from threefold.sim.sweep import effective_capacity, parse_seconds
from threefold.sim.traces import Trace, Turn, sessions_trace


def _single_turn_trace(num: int, prompt_len: int) -> Trace:
    return Trace("single", [[Turn(prompt_len, 1, (), (), k)] for k in range(num)], 0.0)


def test_md1_mean_wait_matches_pollaczek_khinchine():
    # One replica, one request per step (batch budget = one prompt), service exactly S: an M/D/1 queue.
    service, prompt = 0.1, 64
    model = EngineModel({prompt: service}, 0.0, max_num_batched_tokens=prompt)
    rate = 5.0  # rho = 0.5
    result = simulate(model, _single_turn_trace(20000, prompt), 1, "round_robin", rate, slo_s=10.0, seed=1)
    rho = rate * service
    expected_wait = rho * service / (2 * (1 - rho))
    assert result.num_requests == 20000
    assert result.ttft_mean - service == pytest.approx(expected_wait, rel=0.05)


def _conversations() -> list[list[tuple[int, int]]]:
    return [[(40 + 7 * i, 30), (25, 20 + i), (50, 10)] for i in range(12)]


def _model() -> EngineModel:
    return EngineModel({1: 0.01, 256: 0.03, 2048: 0.2}, 1e-6, num_blocks=512, max_num_batched_tokens=512)


def test_deterministic_for_a_seed():
    trace = sessions_trace(60, seed=3, conversations=_conversations())
    model = dataclasses.replace(_model(), dispatch_delay_s=0.01, report_delay_s=0.02)
    runs = [simulate(model, trace, 4, "dualmap", 6.0, 0.5, seed) for seed in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_calibration_fit_and_round_trip(tmp_path):
    per_token, per_context = 1e-4, 2e-7
    points = [StepPoint(p, 0, 0, 0.01 + per_token * p) for p in (16, 256, 1024)]
    points += [StepPoint(0, d, d * c, 0.01 + per_token * d + per_context * d * c) for d, c in ((16, 256), (256, 512))]
    per_pair = 3e-8  # a chunk's attention over a cached prefix: per (new token x cached token)
    points += [StepPoint(p, 0, c, 0.01 + per_token * p + per_pair * p * c) for p, c in ((64, 512), (256, 1024))]
    model = EngineModel.fit(points, block_size=16, num_blocks=1234, model="m", cpu="AVX2")
    assert model.per_context_s == pytest.approx(per_context, rel=0.05)
    assert model.per_prefill_context_s == pytest.approx(per_pair, rel=0.05)
    assert model.token_profile == {16: 0.01 + per_token * 16, 256: 0.01 + per_token * 256,
                                   1024: 0.01 + per_token * 1024}  # the prefixed points stay out of it
    assert model.step_seconds(256, 1000) == pytest.approx(0.01 + per_token * 256 + per_context * 1000, rel=0.02)
    path = tmp_path / "engine.json"
    model.save(path)
    again = EngineModel.load(path)
    assert again.to_dict() == model.to_dict()
    assert again.step_seconds(700, 5000) == model.step_seconds(700, 5000)
    with pytest.raises(ThreefoldError, match="not found"):
        EngineModel.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"per_context_s": 1}')
    with pytest.raises(ThreefoldError, match="not a threefold engine model"):
        EngineModel.load(tmp_path / "bad.json")


def _prefill_truth(*chunks: int) -> float:
    """A step's time when attention is quadratic: 10 ms + 3 ms per token + 1.5 us per attention pair."""
    return 0.01 + 3e-3 * sum(chunks) + 1.5e-6 * sum(attention_pairs(c) for c in chunks)


def test_calibration_past_1024_tokens_predicts_a_2k_prefill_and_split_steps(tmp_path):
    single = [StepPoint(n, 0, 0, _prefill_truth(n)) for n in (16, 128, 512, 1024, 1536, 2048)]
    split = [StepPoint(2 * n, 0, 0, _prefill_truth(n, n), 2) for n in (512, 1024)]
    model = EngineModel.fit(single + split, block_size=16, num_blocks=100)
    assert model.prefill_attention_s == pytest.approx(1.5e-6, rel=1e-6)
    assert model.prefill_seconds(2000) == pytest.approx(_prefill_truth(2000), rel=1e-3)  # between grid points
    assert model.step_seconds(1400, 0, 0, attention_pairs(700) * 2) == pytest.approx(_prefill_truth(700, 700),
                                                                                     rel=1e-3)
    assert model.prefill_seconds_per_token() == pytest.approx(_prefill_truth(2048) / 2048)
    # The old grid (up to 1024, linear past it) under-predicts the 2k prefill by more than 10%.
    old = EngineModel.fit(single[:4], block_size=16, num_blocks=100)
    assert old.prefill_seconds(2000) < 0.9 * _prefill_truth(2000)
    path = tmp_path / "engine.json"
    model.save(path)
    again = EngineModel.load(path)
    assert again.to_dict() == model.to_dict() and again.points == model.points
    assert again.prefill_seconds(2000) == model.prefill_seconds(2000)


def test_an_older_calibration_file_loads_and_charges_as_before(tmp_path):
    path = tmp_path / "old.json"  # written before split steps: no prefill_attention_s, points without prompts
    path.write_text(json.dumps({"token_profile": {"16": 0.1, "1024": 4.0}, "per_context_s": 1e-6,
                                "per_prefill_context_s": 2e-7, "block_size": 16, "num_blocks": 364,
                                "points": [{"prefill_tokens": 16, "num_decodes": 0, "context": 0, "seconds": 0.1}]}))
    model = EngineModel.load(path)
    assert model.prefill_attention_s == 0.0 and model.points[0].prompts == 1
    assert model.step_seconds(520, 1000, 64) == pytest.approx(0.1 + 3.9 * 504 / 1008 + 1e-6 * 1000 + 2e-7 * 64)
    assert model.prefill_seconds(2048) == pytest.approx(4.0 + 3.9 * 1024 / 1008)  # linear past its last point


def test_a_step_of_two_prompts_pays_each_prompts_own_attention():
    model = EngineModel({16: 0.06, 1024: 4.6}, 0.0, prefill_attention_s=1e-6, num_blocks=256,
                        max_num_batched_tokens=2048)
    inst = Instance("i0", model)
    a, b = (SimRequest(name, 600, 1, (), (), 0, 0.0) for name in "ab")
    inst.waiting.extend((a, b))
    end = inst.start(0.0)
    assert inst.complete(end)[0] == [a, b]  # both prefilled in this one step
    assert end == pytest.approx(model.cost(1200) + 1e-6 * 2 * attention_pairs(600))
    assert end < model.prefill_seconds(1200)  # one 1,200-token prompt attends over twice the pairs


def _serve(instance: Instance, request: SimRequest, now: float) -> float:
    """Run one request alone on the instance to completion; returns the finish time."""
    end = instance.enqueue(request, now)
    while end is not None:
        instance.complete(end)
        now, end = end, instance.start(end)
    return now


def test_instance_admits_on_free_blocks_and_evicts_only_unheld_ones():
    model = EngineModel({1: 0.01, 64: 0.05}, 0.0, block_size=4, num_blocks=4, max_num_batched_tokens=64)
    inst = Instance("i0", model)

    def request(name: str, prompt_len: int, output_len: int, hashes: tuple[int, ...], now: float) -> SimRequest:
        return SimRequest(name, prompt_len, output_len, hashes[:prompt_len // 4], hashes, 0, now)

    long = request("long", 8, 5, (1, 2, 3), 0.0)  # 2 prompt blocks, then 1 more for its output
    end = inst.enqueue(long, 0.0)
    inst.complete(end)
    assert long.blocks == [1, 2, -3] and inst.pool.num_free == 1
    short = request("short", 4, 1, (9,), end)
    assert inst.enqueue(short, end) is not None  # cuts long's decode stretch; 1 free block is enough
    waiting = request("waiting", 8, 1, (5, 6), end)
    inst.enqueue(waiting, end)
    now = end
    while long.finish is None:
        now = inst.end
        _, finished = inst.complete(now)
        for r in finished:
            r.finish = now
        assert waiting.remaining == -1 or long.finish is not None  # no blocks for it while long runs
        inst.start(now)
    # long's output block was published at its finish (12 computed tokens: blocks 1, 2, 3) and freed
    # tail first, after short's: the free queue is 9, 3, 2, 1. waiting takes the two oldest (9, 3).
    while inst.end is not None:
        now = inst.end
        inst.complete(now)
        inst.start(now)
    assert waiting.remaining == 0 and waiting.hit_tokens == 0
    assert [h for h in (1, 2, 3, 5, 6, 9) if h in inst.pool] == [1, 2, 5, 6]
    again = request("again", 12, 1, (1, 2, 3), now)
    _serve(inst, again, now)
    assert again.hit_tokens == 8  # (12 - 1) // 4 blocks at most: the last token is always computed


def test_sim_block_pool_frees_tail_first_and_never_evicts_held_blocks():
    pool = SimBlockPool(4)
    a: list[int] = []
    pool.allocate(a, 3)
    pool.publish(a, (1, 2, 3))
    pool.free(a)  # free queue: (never used), 3, 2, 1
    b: list[int] = []
    pool.touch(b, (1, 2))
    pool.allocate(b, 2)  # the never-used block, then 3 (the least recently freed)
    pool.publish(b, (1, 2, 7, 8), 2)
    assert b == [1, 2, 7, 8] and pool.match((1, 2, 3)) == 2 and pool.num_free == 0
    c: list[int] = []
    pool.allocate(c, 1)  # nothing free: beyond capacity (the simulator does not preempt)
    assert pool.over_capacity == 1 and len(pool) == 4
    pool.free(b)  # its tail block (8) is the one dropped to get back to 4 blocks
    assert pool.over_capacity == 0 and pool.match((1, 2, 7, 8)) == 3
    pool.free(c)
    d: list[int] = []
    pool.allocate(d, 2)  # evicts 7 then 2: the chain's head (1) outlives its tail
    assert pool.match((1, 2)) == 1 and len(pool) == 1


def test_sim_block_pool_matches_the_engines_block_pool_op_for_op():
    rng = random.Random(0)
    num_blocks = 24
    sim, real = SimBlockPool(num_blocks), BlockPool(num_blocks + 1)  # the engine's block 0 is the null block
    active: dict[int, tuple[list[int], list]] = {}
    seen: set[int] = set()
    fresh = itertools.count(10_000)
    for op in range(600):
        if active and (rng.random() < 0.45 or len(active) > 5):
            sim_held, real_blocks = active.pop(rng.choice(sorted(active)))
            sim.free(sim_held)
            real.free_blocks(reversed(real_blocks))
        else:
            family, shared, length = rng.randrange(4), rng.randrange(6), rng.randrange(1, 7)
            hashes = tuple(family * 100 + i if i < shared else next(fresh) for i in range(length))
            seen.update(hashes)
            hits = []
            for h in hashes:
                block = real.get_cached_block(h.to_bytes(8, "big"), None)
                if block is None:
                    break
                hits.append(block)
            assert sim.match(hashes) == len(hits)
            num_new = length - len(hits)
            revived = sum(1 for b in hits if b.ref_cnt == 0)
            fits = num_new <= real.num_free_blocks - revived
            assert sim.fits(hashes[:len(hits)], num_new) == fits
            if not fits:
                continue
            held: list[int] = []
            sim.touch(held, hashes[:len(hits)])
            sim.allocate(held, num_new)
            sim.publish(held, hashes, len(hits))
            real.touch(hits)
            blocks = hits + real.get_new_blocks(num_new)
            for block, h in zip(blocks[len(hits):], hashes[len(hits):], strict=True):
                real.cache_block(block, h.to_bytes(8, "big"), None)
            active[op] = (held, blocks)
        assert {h for h in seen if h in sim} == {int.from_bytes(k, "big") for k in real.cached}, op
        assert sim.num_free == real.num_free_blocks


def test_a_chunk_after_a_cached_prefix_pays_for_attending_to_it():
    model = EngineModel({1: 0.01, 64: 0.05}, 0.0, 1e-6, block_size=4, num_blocks=64, max_num_batched_tokens=64)
    inst = Instance("i0", model)
    _serve(inst, SimRequest("cold", 40, 1, tuple(range(10)), tuple(range(10)), 0, 0.0), 0.0)
    warm = SimRequest("warm", 48, 1, tuple(range(12)), tuple(range(12)), 0, 10.0)
    start = 10.0
    end = inst.enqueue(warm, start)
    assert warm.hit_tokens == 40  # 8 new tokens after 40 cached
    assert end - start == pytest.approx(model.cost(8) + 1e-6 * 8 * 40)


def test_decode_stretch_cut_matches_step_by_step():
    # A request decoding alone, cut by an arrival mid-stretch, finishes when its steps say it does.
    model = EngineModel({1: 0.01, 64: 0.05}, 1e-5, max_num_batched_tokens=64)
    inst = Instance("i0", model)
    long = SimRequest("long", 16, 11, (), (), 0, 0.0)
    end = inst.enqueue(long, 0.0)
    inst.complete(end)  # its prefill: first token at `end`
    first = end
    end = inst.start(end)  # a stretch of 10 decode steps
    cut = inst.enqueue(SimRequest("new", 16, 1, (), (), 0, first + 0.025), first + 0.025)
    assert cut < end
    contexts = [16 + 1 + j for j in range(10)]
    step_ends = [first]
    for c in contexts[:3]:
        step_ends.append(step_ends[-1] + model.step_seconds(1, c))
    assert cut == pytest.approx(step_ends[3])  # step 3 was in progress at +25 ms


def test_every_policy_plugs_in_by_name_and_affinity_pays():
    trace = sessions_trace(80, seed=0, conversations=_conversations())
    results = {name: Simulator(_model(), 4, name, 0.5, 0).run(trace, 4.0) for name in policy_names()}
    assert set(results) >= {"round_robin", "least_loaded", "prefix_hash", "cache_aware", "dualmap"}
    assert all(r.num_requests == trace.num_requests for r in results.values())
    assert results["prefix_hash"].hit_rate > results["round_robin"].hit_rate
    assert results["dualmap"].hit_rate > results["round_robin"].hit_rate
    with pytest.raises(ThreefoldError, match="unknown routing policy"):
        Simulator(_model(), 2, "fastest")


def test_effective_capacity_bisects_the_90_percent_crossing():
    class Fake:  # reports a total rate (x 8 instances), as simulate does: capacity stays per instance
        def __init__(self, rate):
            self.rate, self.slo_attainment = 8 * rate, 1.0 if rate <= 2.7 else 0.5

    capacity, runs = effective_capacity(Fake, [1, 2, 4, 8], bisect_steps=4)
    assert 2.5 <= capacity <= 2.7
    assert len(runs) == 7  # 1, 2, 4 (fails: 8 is not run), then four halvings
    assert effective_capacity(lambda r: Fake(r * 10), [1, 2], 3)[0] == 0.0
    assert parse_seconds("500ms") == 0.5 and parse_seconds("1s") == 1.0
    with pytest.raises(ThreefoldError):
        parse_seconds("soon")


@pytest.mark.parametrize("policy", ["round_robin", "dualmap"])
def test_dispatch_and_report_delays_shift_ttft_exactly(policy):
    # Two one-token requests at t = 1 ms on one replica, each prefill 0.1 s. Immediate binding: the
    # second queues behind the first in the replica, so each TTFT grows by d + r once. Late binding
    # (DualMap pulls one prompt per SLO/tpct = 64 tokens): the second is sent only when the first's
    # token is reported, so its TTFT grows by d + r twice.
    d, r = 0.03, 0.02
    trace = dataclasses.replace(_single_turn_trace(2, 64), arrival_times=[[0.001], [0.001]])

    def ttfts(dispatch: float, report: float) -> list[float]:
        model = EngineModel({64: 0.1}, 0.0, max_num_batched_tokens=64, dispatch_delay_s=dispatch,
                            report_delay_s=report)
        sim = Simulator(model, 1, policy, slo_s=0.1)
        sim.run(trace, 1.0)
        return [q.first_token - q.arrival for q in sorted(sim.done, key=lambda q: q.request_id)]  # type: ignore

    base, delayed = ttfts(0.0, 0.0), ttfts(d, r)
    shifts = [1, 1] if policy == "round_robin" else [1, 2]
    assert delayed == pytest.approx([t + k * (d + r) for t, k in zip(base, shifts, strict=True)], abs=1e-9)
    assert base[0] == pytest.approx(0.1 if policy == "round_robin" else 0.1 + 0.002)  # + the dispatch quantum


def test_http_delays_from_two_scrapes():
    before = Scrape({ACCEPT: (1.0, 10), FIRST_TOKEN: (20.0, 10), ENGINE_TTFT: (15.0, 10)})
    after = Scrape({ACCEPT: (1.5, 20), FIRST_TOKEN: (26.0, 20), ENGINE_TTFT: (20.0, 20)})
    delays = delays_between(before, after)
    assert delays == Delays(dispatch_s=pytest.approx(0.05), report_s=pytest.approx(0.05), requests=10)
    model = delays.apply(_model())
    assert (model.dispatch_delay_s, model.report_delay_s) == (delays.dispatch_s, delays.report_s)
    assert delays_between(after, after) is None
    late_headers = Scrape({ACCEPT: (3.0, 20), FIRST_TOKEN: (26.0, 20), ENGINE_TTFT: (20.0, 20)})
    assert delays_between(before, late_headers) == Delays(pytest.approx(0.1), pytest.approx(0.0), 10)


def test_simulate_saves_each_run_as_it_ends_and_the_plots_merge_them(tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    import threefold.sim.sweep as sweep
    from threefold.cli import main as cli_main

    _model().save(tmp_path / "model.json")
    args = ["simulate", "--calibration", str(tmp_path / "model.json"), "--trace", "mooncake", "--rates", "0.05,0.1",
            "--requests-per-instance", "6", "--bisect-steps", "0", "--ttft-slo", "60s"]
    real, calls = sweep.simulate, []

    def second_run_dies(*a, **k):  # a sweep stopped part way (killed, out of time) after its first run
        calls.append(a[4])
        if len(calls) == 2:
            raise RuntimeError("stopped")
        return real(*a, **k)

    monkeypatch.setattr(sweep, "simulate", second_run_dies)
    with pytest.raises(RuntimeError, match="stopped"):
        cli_main([*args, "--instances", "2", "--policy", "round_robin", "--out", str(tmp_path / "stopped")])
    stopped = json.loads((tmp_path / "stopped" / "results.json").read_text())
    assert [r["rate"] for r in stopped["runs"]] == [0.1] and stopped["capacity"] == []  # 0.05 x 2 instances
    monkeypatch.setattr(sweep, "simulate", real)
    assert cli_main([*args, "--instances", "4", "--policy", "dualmap", "--out", str(tmp_path / "done")]) == 0
    done = json.loads((tmp_path / "done" / "results.json").read_text())
    assert [(r["instances"], r["rate"]) for r in done["runs"]] == [(4, 0.2), (4, 0.4)] and len(done["capacity"]) == 1

    path = Path(__file__).parents[1] / "benchmarks" / "slo_plots.py"
    spec = importlib.util.spec_from_file_location("slo_plots", path)
    slo_plots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(slo_plots)
    traces = slo_plots.merge([stopped, done])
    curves = traces["mooncake"]["curves"]
    assert traces["mooncake"]["slo"] == 60.0 and set(curves) == {(2, "round_robin"), (4, "dualmap")}
    assert [rate for rate, _ in curves[4, "dualmap"]] == [0.05, 0.1]  # per instance, in rate order
    with pytest.raises(SystemExit, match="do not belong in one plot"):
        slo_plots.merge([stopped, {**done, "ttft_slo_s": 20.0}])
    pytest.importorskip("matplotlib")
    slo_plots.plot_trace("mooncake", traces["mooncake"], tmp_path / "slo.svg")
    svg = (tmp_path / "slo.svg").read_text()
    assert "4 instances" in svg and "dualmap" in svg and len(svg) < 200_000  # text kept as text


def test_drift_prices_logged_steps_as_the_simulator_does():
    model = dataclasses.replace(_model(), per_prefill_context_s=1e-7, prefill_attention_s=1e-8)
    chunk, decodes = ((600, 64),), ((1, 300), (1, 500))
    # a mixed step: one 600-token chunk after 64 cached tokens beside two decodes
    mixed = model.step_seconds(602, 800, 600 * 64, attention_pairs(600))
    assert model.shape_seconds(chunk + decodes) == pytest.approx(mixed)
    decode = model.step_seconds(2, 800)
    steps = [LoggedStep(0.0, 1.2 * mixed, chunk + decodes), LoggedStep(1.0, 0.9 * decode, decodes),
             LoggedStep(2.0, 0.9 * decode, decodes)]
    drift = model.drift(steps)
    assert drift["prefill >= 512"]["ratio"] == pytest.approx(1.2)
    assert drift["decode only"] == {"steps": 2, "measured_s": pytest.approx(1.8 * decode),
                                    "modelled_s": pytest.approx(2 * decode), "ratio": pytest.approx(0.9)}
    assert drift["all"]["ratio"] == pytest.approx((1.2 * mixed + 1.8 * decode) / (mixed + 2 * decode))
    assert "prefill < 512" not in drift
