"""The adaptive speculation length: cost model, acceptance EMA, and the goodput-optimal k."""

from __future__ import annotations

import itertools
import random

import pytest

from threefold.spec.adaptive import (
    AcceptanceTracker,
    AdaptiveController,
    StepCostModel,
    choose_num_drafts,
    expected_tokens,
    tail_weights,
)


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_cost_model_interpolates_extrapolates_and_stays_monotone():
    cost = StepCostModel({1: 0.010, 9: 0.018})
    assert cost(1) == 0.010 and cost(0) == 0.010
    assert cost(5) == pytest.approx(0.014)
    assert cost(17) == pytest.approx(0.026)  # the last segment's slope
    cost.observe(5, 0.005)  # a noisy fast step: more tokens must not look cheaper
    assert cost(5) == pytest.approx(0.010)
    cost.observe(9, 0.028)  # EMA at a known point
    assert cost(9) == pytest.approx(0.019)
    single = StepCostModel({4: 0.02})
    assert single(8) == pytest.approx(0.04) and single(2) == 0.02


def goodput(ks, rates, cost, base_tokens, base_emitted, draft_cost):
    emitted = base_emitted + sum(expected_tokens(r, k) - 1 for r, k in zip(rates, ks, strict=False))
    return emitted / (cost(base_tokens + sum(ks)) + draft_cost * sum(ks))


@pytest.mark.parametrize("seed", range(30))
def test_choice_is_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 3)
    rates = [rng.random() for _ in range(n)]
    max_drafts = [rng.randint(0, 4) for _ in range(n)]
    # A measured-looking profile: flat overhead, then compute-bound.
    knee, per_token = rng.randint(1, 16), rng.uniform(0.0005, 0.003)
    cost = StepCostModel({1: 0.01, knee + 1: 0.01 + rng.uniform(0, 0.002), 64: 0.01 + per_token * (64 - knee)})
    base_tokens, draft_cost = rng.randint(n, 3 * n), rng.choice([0.0, 0.001])
    ks = choose_num_drafts(rates, max_drafts, cost, base_tokens, n, draft_cost)
    assert all(0 <= k <= m for k, m in zip(ks, max_drafts, strict=False))
    best = max(goodput(c, rates, cost, base_tokens, n, draft_cost)
               for c in itertools.product(*[range(m + 1) for m in max_drafts]))
    assert goodput(ks, rates, cost, base_tokens, n, draft_cost) == pytest.approx(best, rel=1e-12)


def test_overhead_bound_speculates_fully_and_compute_bound_not_at_all():
    flat = StepCostModel({1: 0.01, 256: 0.0101})
    assert choose_num_drafts([0.8, 0.8], [5, 5], flat, 2, 2) == [5, 5]
    assert choose_num_drafts([0.8, 0.05], [5, 5], flat, 2, 2)[0] == 5
    # Each token costs the same (a big batch): a draft adds a < 1 tokens for one token's time.
    linear = StepCostModel({1: 0.001, 1024: 1.024})
    assert choose_num_drafts([0.9] * 32, [5] * 32, linear, 32, 32) == [0] * 32
    # Drafts whose acceptance is zero never pay.
    assert choose_num_drafts([0.0], [5], flat, 1, 1) == [0]


def test_acceptance_ema_recovers_the_rate_from_truncated_runs():
    rng = random.Random(0)
    tracker = AcceptanceTracker(ema_weight=0.02)
    for _ in range(4000):
        k = rng.randint(1, 5)
        accepted = 0
        while accepted < k and rng.random() < 0.7:
            accepted += 1
        tracker.observe("r", k, accepted)
    assert tracker.rate("r") == pytest.approx(0.7, abs=0.05)
    assert tracker.rate("new") == tracker.prior
    tracker.observe("r", 0, 0)  # a step without drafts says nothing
    tracker.remove("r")
    assert tracker.rate("r") == tracker.prior


def test_low_acceptance_drives_k_to_zero_with_rare_probes():
    controller = AdaptiveController(StepCostModel({1: 0.01, 64: 0.011}), max_drafts=5, probe_interval=16)
    drafted = []
    for _ in range(200):
        (k,) = controller.choose(["r"], base_tokens=1, base_emitted=1)
        controller.observe("r", k, 0)  # a proposer that is never right
        drafted.append(k)
    assert drafted[0] == 5
    late = drafted[50:]
    assert late.count(0) >= len(late) - len(late) // 16 and max(late) <= 1
    controller.remove("r")
    assert controller.choose(["r"], 1, 1) == [5]


def test_measured_draft_cost_can_turn_speculation_off():
    controller = AdaptiveController(StepCostModel({1: 0.01, 64: 0.011}), max_drafts=4)
    assert controller.choose(["r"], 1, 1) == [4]
    controller.observe_draft_cost(4, 0.04)  # one call is enough evidence to stop (no EMA from zero)
    assert controller.choose(["r"], 1, 1) == [0]
    for _ in range(100):  # a proposer costing a whole step per drafted token never pays at a = 0.5
        controller.observe_draft_cost(4, 0.04)
    assert controller.draft_seconds_per_token == pytest.approx(0.01, rel=1e-3)
    assert controller.choose(["r"], 1, 1) == [0]


def test_tree_levels_cost_every_node_they_add():
    """At batch 1 on a CPU where a verify step grows ~1.6x from 1 to 9 rows, a chain at a = 0.5 pays,
    while an 8-node-per-level tree at the same per-level rate does not: k falls to 0."""
    cost = StepCostModel({1: 0.010, 2: 0.011, 4: 0.012, 9: 0.016, 17: 0.024, 33: 0.040})
    assert choose_num_drafts([0.5], [4], cost, 1, 1)[0] >= 2
    wide = [0, 8, 16, 24, 32]  # tokens_for_depth: 8 nodes per level
    assert choose_num_drafts([0.5], [4], cost, 1, 1, tokens_for_depth=wide) == [0]
    assert choose_num_drafts([0.95], [4], cost, 1, 1, tokens_for_depth=wide)[0] > 0  # near-certain levels pay
    controller = AdaptiveController(cost, max_drafts=4, tokens_for_depth=wide)
    assert controller.choose(["r"], 1, 1) == [0]  # the prior rate (0.5) does not pay for 8 nodes a level


def test_config_counts_tree_nodes_by_depth():
    from threefold.spec.config import SpeculativeConfig

    medusa = SpeculativeConfig("medusa", 3, model="x", speculative_token_tree="[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]")
    assert medusa.tree_tokens_by_depth() == [0, 2, 4, 5]
    eagle = SpeculativeConfig("eagle", 3, model="x", tree_top_k=2, tree_total_tokens=5)
    assert eagle.tree_tokens_by_depth() == [0, 2, 5, 5]
    assert SpeculativeConfig("ngram", 3).tree_tokens_by_depth() is None


def test_measured_draft_rows_turn_speculation_off_under_load():
    """The profile says rows are nearly free at batch 32, but the measured steps with drafts cost
    more than the curve (verify logits, sampling): that surcharge must reach the choice."""
    cost = StepCostModel({1: 0.017, 8: 0.020, 32: 0.100, 64: 0.104, 160: 0.115})
    controller = AdaptiveController(cost, max_drafts=4)
    ids = [str(i) for i in range(32)]
    assert sum(controller.choose(ids, 32, 32, owed=[64] * 32, num_waiting=4)) > 0  # the curve alone: drafting pays
    for _ in range(60):
        controller.observe_step(32, 0.100)  # plain steps match the curve
        for rows in (64, 8):  # a verify step: 5 ms + 3 ms a draft row beyond the curve
            controller.observe_step(32 + rows, cost(32 + rows) + 0.005 + rows * 0.003, num_draft_rows=rows)
    assert cost.draft_row_seconds == pytest.approx(0.003, rel=0.01)
    assert cost.verify_seconds == pytest.approx(0.005, rel=0.01)
    assert cost.step(32, 64) == pytest.approx(cost(96) + 0.005 + 64 * 0.003, rel=0.01)
    assert controller.choose(ids, 32, 32, owed=[64] * 32, num_waiting=4) == [0] * 32
    # At batch 1, 5 ms + 3 ms a row beside a 17 ms step that emits one token: a short chain still pays.
    assert controller.choose(["solo"], 1, 1, owed=[64], num_waiting=0)[0] > 0


def test_a_negative_surcharge_never_makes_drafts_cheaper_than_none():
    cost = StepCostModel({1: 0.010, 64: 0.020})
    for _ in range(50):
        cost.observe(8, 0.001, num_draft_rows=4)  # noise: far faster than the curve
    assert cost.verify_seconds < 0
    assert cost.step(4, 4) == cost(8) > cost.step(4, 0) == cost(4)  # a draft row costs at least a plain token
    assert cost.tokens == [1, 64]  # steps with drafts do not move the curve


def test_with_nobody_waiting_only_the_batch_tail_drafts():
    """Nothing waits for a slot: a request done long before the longest one gains nothing by drafting."""
    flat = StepCostModel({1: 0.010, 256: 0.0101})
    controller = AdaptiveController(flat, max_drafts=4)
    ids, owed = ["a", "b", "c"], [60, 10, 3]
    assert controller.choose(ids, 3, 3, owed=owed, num_waiting=2) == [4, 4, 4]  # a refilled slot: every token pays
    assert controller.choose(ids, 3, 3, owed=owed, num_waiting=0) == [4, 0, 0]
    assert choose_num_drafts([0.5] * 3, [4] * 3, flat, 3, 3, weights=[1.0, 0.0, 0.0]) == [4, 0, 0]
    # Horizon: the longest request at its best speculation (0.5, k=4: 1.9375 tokens a step) needs 31 steps.
    assert tail_weights([60, 40, 30], [0.5] * 3, [4] * 3) == [1.0, 1.0, 0.0]
    assert tail_weights([60], [0.0], [4]) == [0.0]  # a request that cannot speed up gains nothing either


def test_probes_stop_where_a_certain_draft_cannot_pay():
    """Each token costs the same (a big batch): even an always-accepted draft adds less than its row costs."""
    linear = StepCostModel({1: 0.001, 1024: 1.024})
    controller = AdaptiveController(linear, max_drafts=4, probe_interval=4)
    ids = [str(i) for i in range(32)]
    drafted = sum(sum(controller.choose(ids, 32, 32, owed=[64] * 32, num_waiting=1)) for _ in range(40))
    assert drafted == 0
    cheap = AdaptiveController(StepCostModel({1: 0.01, 64: 0.011}), max_drafts=4, probe_interval=4)
    for _ in range(40):
        cheap.choose(["r"], 1, 1)
        cheap.observe("r", 4, 0)
    assert max(cheap.choose(["r"], 1, 1) for _ in range(4)) == [1]  # where drafts can pay, probes go on


def test_a_fixed_verify_cost_stops_lone_drafts_under_load():
    """Steps with one draft cost 6 ms more than the curve whatever their rows (a second LM-head call,
    the sampler): at batch 32 a lone probe's 1/32 more tokens cannot pay that, at batch 1 a chain can."""
    cost = StepCostModel({1: 0.017, 8: 0.020, 32: 0.100, 64: 0.104})
    controller = AdaptiveController(cost, max_drafts=4, probe_interval=2)
    for _ in range(40):
        cost.observe(33, cost(33) + 0.006, num_draft_rows=1)
    assert cost.verify_seconds == pytest.approx(0.006, rel=0.02) and cost.draft_row_seconds == 0.0
    ids = [str(i) for i in range(32)]
    for rid in ids:
        for _ in range(30):
            controller.observe(rid, 4, 0)  # acceptance near 0: k = 0, then (old rule) probes every 2 steps
    assert sum(sum(controller.choose(ids, 32, 32, owed=[64] * 32)) for _ in range(6)) == 0
    assert controller.choose(["solo"], 1, 1, owed=[64], num_waiting=0)[0] > 0


def test_draft_cost_is_profiled_warm_and_calls_refine_it():
    """A proposer whose first call is cold (a draft model's first kernels) is priced by its warm calls,
    and a profiled price moves by the EMA, not by the next call alone."""
    import time

    from threefold.spec.decoder import profile_draft_cost
    from threefold.spec.proposer import Draft, Proposer

    class ColdFirstCall(Proposer):
        calls = 0

        @classmethod
        def from_config(cls, config, target=None):
            return cls()

        def propose(self, requests):
            self.calls += 1
            time.sleep(0.2 if self.calls == 1 else 0.004)
            return [Draft([0] * r.num_drafts) for r in requests]

    seconds = profile_draft_cost(ColdFirstCall(), num_drafts=4)
    assert 0.001 <= seconds < 0.01  # 4 ms / 4 drafts, not the cold call's 50 ms a draft
    controller = AdaptiveController(StepCostModel({1: 0.01, 64: 0.011}), max_drafts=4,
                                    draft_seconds_per_token=seconds)
    assert controller.choose(["r"], 1, 1)[0] > 0
    cold = AdaptiveController(StepCostModel({1: 0.01, 64: 0.011}), max_drafts=4, draft_seconds_per_token=0.05)
    assert cold.choose(["r"], 1, 1) == [0]  # priced by the cold call, it would never draft
    controller.observe_draft_cost(4, 0.2)  # one slow call
    assert controller.draft_seconds_per_token == pytest.approx(seconds + 0.1 * (0.05 - seconds))
