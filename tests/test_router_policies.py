"""Routing policies on hand-built states whose right answer is known (no HTTP, no clock)."""

from __future__ import annotations

import math

import pytest

from threefold.errors import ThreefoldError
from threefold.router.config import RouterConfig
from threefold.router.dualmap import HIGH, NORMAL, DualMap
from threefold.router.hashring import HashRing
from threefold.router.policies import NoBackendError, RouteRequest, make_policy, policy_names
from threefold.router.radix import PrefixIndex, block_hashes

CFG = RouterConfig(block_size=4, key_tokens=8, tpct_s=0.01, slo_s=1.0)


def req(rid: str, tokens: list[int], arrival: float = 0.0, cfg: RouterConfig = CFG) -> RouteRequest:
    return RouteRequest.from_tokens(rid, tokens, cfg, arrival)


def test_registry_names_and_unknown_policy():
    assert policy_names() == ["cache_aware", "dualmap", "least_loaded", "prefix_hash", "round_robin"]
    with pytest.raises(ThreefoldError, match="unknown routing policy 'nope'"):
        make_policy("nope", ["a"])
    with pytest.raises(NoBackendError):
        make_policy("round_robin", []).submit(req("r", [1, 2, 3]), 0.0)
    with pytest.raises(ThreefoldError, match="block_size=0"):
        RouterConfig(block_size=0)


def test_block_hashes_chain_and_prefix_match():
    a, b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4), block_hashes([1, 2, 3, 4, 0, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]  # the partial block is not hashed
    index = PrefixIndex(capacity_blocks=3)
    index.insert(a)
    assert index.match(a) == 2 and index.match(b) == 1
    index.insert(block_hashes(list(range(100, 108)), 4))  # 4 blocks > capacity 3: LRU drops a's tail
    assert index.match(a) == 1


def test_prefix_index_evicts_a_prefix_from_its_tail():
    """Like the engine (a finished request frees its blocks tail first), eviction shortens a cached
    prefix from its end; evicting its first block would leave every later one unmatchable."""
    index = PrefixIndex(capacity_blocks=6)
    long = block_hashes(list(range(24)), 4)  # 6 blocks
    index.insert(long)
    index.insert(block_hashes(list(range(100, 108)), 4))  # 2 more blocks: 2 of `long`'s must go
    assert index.match(long) == 4 and len(index) == 6
    index.insert(long[:2])  # a hit on the head refreshes the head only
    index.insert(block_hashes(list(range(200, 212)), 4))  # 3 more: the unrefreshed tail goes first
    assert index.match(long) == 2


def test_ring_join_moves_only_the_new_backends_arcs_and_leave_only_the_leavers():
    ring = HashRing(["a", "b", "c"], vnodes=50)
    keys = range(0, 1 << 64, (1 << 64) // 2000)
    before = {k: ring.lookup(k) for k in keys}
    ring.add("d")
    after = {k: ring.lookup(k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(after[k] == "d" for k in moved)
    assert 0.1 < len(moved) / len(before) < 0.4  # about a quarter of the keys
    ring.remove("d")
    assert {k: ring.lookup(k) for k in keys} == before
    ring.remove("b")
    assert all(ring.lookup(k) == before[k] for k in keys if before[k] != "b")


def test_ring_changed_without_lookups_between_equals_a_fresh_ring():
    """Points are sorted lazily (at the next lookup): adds and removes in a row must still give the ring
    that a fresh build over the same backends gives."""
    ring = HashRing(["a", "b"], vnodes=50)
    ring.add("c")
    ring.remove("a")
    ring.add("d")
    fresh = HashRing(["b", "c", "d"], vnodes=50)
    keys = range(0, 1 << 64, (1 << 64) // 500)
    assert [ring.lookup(k) for k in keys] == [fresh.lookup(k) for k in keys]


def test_prefix_hash_is_sticky_and_bounded():
    policy = make_policy("prefix_hash", ["a", "b", "c", "d"], CFG)
    same = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    for i in range(8):  # 8 requests with one key, none finishes
        policy.submit(req(f"r{i}", same), 0.0)
    placed = policy.dispatch(0.0)
    loads = {b: len(s.inflight) for b, s in policy.backends.items()}
    owner = policy.ring.lookup(req("k", same).key)
    assert placed[0].backend == owner
    # capacity ceil(1.25 * m / n) with m counting the new request: the hot key spills clockwise
    assert max(loads.values()) <= math.ceil(1.25 * 8 / 4) and len({a.backend for a in placed}) >= 3
    for i in range(8):
        policy.on_finished(f"r{i}", 0.0)
    policy.submit(req("again", same), 0.0)
    assert policy.dispatch(0.0)[0].backend == placed[0].backend  # back at the owner once it has room


def test_least_loaded_and_round_robin():
    rr = make_policy("round_robin", ["a", "b"], CFG)
    for i in range(3):
        rr.submit(req(f"r{i}", [i]), 0.0)
    assert [a.backend for a in rr.dispatch(0.0)] == ["a", "b", "a"]
    ll = make_policy("least_loaded", ["a", "b"], CFG)
    ll.observe_load("a", 5, 0.0)  # a is busy with another client's work
    ll.submit(req("x", [1]), 0.0)
    ll.submit(req("y", [2]), 0.0)
    assert [a.backend for a in ll.dispatch(0.0)] == ["b", "b"]


def cache_aware_with(loads: dict[str, int]):
    policy = make_policy("cache_aware", list(loads), CFG)
    for name, count in loads.items():
        policy.backends[name].inflight.update({f"{name}{i}": 1 for i in range(count)})
    return policy


def test_cache_aware_thresholds():
    prompt = list(range(16))  # 4 blocks
    policy = cache_aware_with({"a": 0, "b": 0})
    policy.backends["b"].cache.insert(block_hashes(prompt[:12], 4))  # 12/16 = 0.75 > 0.5
    policy.backends["a"].cache.insert(block_hashes(list(range(50, 90)), 4))  # a's tree is bigger
    policy.submit(req("hit", prompt), 0.0)
    assert policy.dispatch(0.0)[0].backend == "b"
    low = cache_aware_with({"a": 0, "b": 0})
    low.backends["a"].cache.insert(block_hashes(prompt[:8], 4))  # 8/16 = 0.5, not above
    low.backends["a"].cache.insert(block_hashes(list(range(50, 90)), 4))
    low.submit(req("miss", prompt), 0.0)
    assert low.dispatch(0.0)[0].backend == "b"  # the smaller tree
    # imbalance: max - min > 32 and max > 1.0001 * min -> shortest queue, whatever is cached
    busy = cache_aware_with({"a": 0, "b": 33})
    busy.backends["b"].cache.insert(block_hashes(prompt, 4))
    busy.submit(req("r", prompt), 0.0)
    assert busy.dispatch(0.0)[0].backend == "a"
    edge = cache_aware_with({"a": 1, "b": 33})  # difference 32 exactly: not imbalanced
    edge.backends["b"].cache.insert(block_hashes(prompt, 4))
    edge.submit(req("r", prompt), 0.0)
    assert edge.dispatch(0.0)[0].backend == "b"


def dualmap(n: int = 4, **kw) -> DualMap:
    policy = make_policy("dualmap", [f"i{k}" for k in range(n)],
                         RouterConfig(block_size=4, key_tokens=8, tpct_s=0.01, slo_s=1.0, **kw))
    assert isinstance(policy, DualMap)
    return policy


def test_dualmap_candidates_are_the_two_rings_owners():
    policy = dualmap()
    for i in range(50):
        r = req(f"r{i}", [i, i + 1, i + 2, i + 3, 9, 9, 9, 9])
        c1, c2 = policy.candidates(r)
        assert c1 == policy.rings[0].lookup(r.key) and c1 != c2
        if policy.rings[1].lookup(r.key) != c1:
            assert c2 == policy.rings[1].lookup(r.key)


def test_dualmap_prefers_the_cached_candidate_until_its_ttft_passes_half_the_slo():
    policy = dualmap()
    prompt = list(range(40))
    r = req("r", prompt)
    c1, c2 = policy.candidates(r)
    policy.backends[c2].cache.insert(r.block_hashes)  # c2 holds the whole prefix
    assert policy.choose(r, 0.0) == c2
    # 45 miss tokens prefilling at c2: TTFT_c2 = 0.01 * (45 + 1) = 0.46 <= 0.5: still affinity
    policy.backends[c2].prefilling["busy"] = 45
    assert policy.choose(r, 0.0) == c2
    # 60 tokens: 0.61 > SLO/2 -> argmin TTFT: c1 costs 0.01 * 40 = 0.40 < 0.61
    policy.backends[c2].prefilling["busy"] = 60
    assert policy.choose(r, 0.0) == c1
    policy.backends[c1].prefilling["busy2"] = 100  # c1 now worse (1.40): back to c2 ...
    for name in set(policy.backends) - {c1, c2}:
        policy.backends[name].prefilling["busy"] = 100  # ... when no other instance has room (else: spill)
    assert policy.choose(r, 0.0) == c2


def test_dualmap_queue_order_is_priority_then_hit_then_arrival():
    policy = dualmap(n=1)
    policy.backends["i0"].prefilling["blocker"] = 1  # busy, so nothing is pulled yet
    policy.backends["i0"].cache.insert(block_hashes(list(range(8)), 4))
    policy.submit(req("late-miss", [50] * 8, arrival=0.0), 0.0)
    policy.submit(req("hit", [*range(8), 7], arrival=1.0), 1.0)
    policy.submit(req("early-miss", [60] * 8, arrival=-1.0), 1.0)
    policy._push("i0", req("urgent", [70] * 8, arrival=5.0), HIGH)
    order = [entry.request.request_id for entry in policy.queues["i0"].entries()]
    assert order == ["urgent", "hit", "early-miss", "late-miss"]
    assert policy._priority(10.0) == NORMAL  # no TTFTs observed yet
    policy.ttfts.extend([0.1] * 100)
    assert policy._priority(0.2) == HIGH and policy._priority(0.05) == NORMAL


def test_dualmap_late_binding():
    policy = dualmap(n=1)
    policy.submit(req("a", [1] * 8), 0.0)
    policy.submit(req("b", [2] * 8), 0.0)
    assert [x.request_id for x in policy.dispatch(0.0)] == ["a", "b"]  # idle: one pull takes both
    policy.submit(req("c", [3] * 8), 0.1)
    policy.submit(req("d", [4] * 8), 0.1)
    assert policy.dispatch(0.1) == []  # two prefilling: wait
    policy.on_first_token("a", 0.5)
    assert [x.request_id for x in policy.dispatch(0.6)] == ["c", "d"]  # <= 1 prefilling, recent prefill
    policy.submit(req("e", [5] * 8), 0.7)
    policy.on_first_token("c", 0.8)
    policy.on_first_token("d", 0.8)
    assert policy.dispatch(3.5) == []  # "b" still prefilling and the last prefill ended 2.7 s ago
    policy.on_first_token("b", 3.6)
    assert [x.request_id for x in policy.dispatch(3.6)] == ["e"]


def test_dualmap_rebalances_a_hotspot_to_other_candidates():
    policy = dualmap(n=3)
    hot = "i0"
    policy.backends[hot].prefilling["running"] = 80  # 0.8 s of prefill already running there
    queued = []
    for i in range(200):
        r = req(f"r{i}", [i, i, i, i, 1, 2, 3, 4, 5, 6, 7, 8])
        if hot in policy.candidates(r):
            policy._push(hot, r, NORMAL)
            queued.append(r.request_id)
        if len(queued) == 6:
            break
    pending = policy.pending_tokens(hot)  # 80 + 6 * 12 = 152 tokens -> 1.52 s > SLO
    assert pending == 152 and policy._is_hotspot(hot, 0.0)
    moved = policy.rebalance(hot, 0.0)
    # each move costs TTFT_target - TTFT_source < 0; it stops once >= 152 - 100 tokens moved
    assert moved == math.ceil((152 - 100) / 12) == 5
    assert policy.pending_tokens(hot) == 152 - 5 * 12
    assert sum(len(q) for q in policy.queues.values()) == 6 and policy.migrations[hot] == 5
    for name in ("i1", "i2"):
        for entry in policy.queues[name].entries():
            assert name in policy.candidates(entry.request) or name == "i1"  # other candidate or next


def test_dualmap_wait_triggers_hotspot_and_leaving_backend_requeues():
    policy = dualmap(n=2)
    policy.backends["i0"].prefilling["x"] = 1
    policy.backends["i1"].prefilling["y"] = 1
    policy._push("i0", req("old", [1] * 8, arrival=0.0), NORMAL)
    assert not policy._is_hotspot("i0", 2.9) and policy._is_hotspot("i0", 3.0)
    policy.remove_backend("i0", 3.0)
    assert [e.request.request_id for e in policy.queues["i1"].entries()] == ["old"]


def two_replicas(adapt: bool) -> DualMap:
    policy = make_policy("dualmap", ["a", "b"], RouterConfig(block_size=16, key_tokens=32, tpct_s=0.0005,
                                                             slo_s=5.0, adapt_tpct=adapt))
    assert isinstance(policy, DualMap)
    return policy


def chat_prompt(i: int, length: int = 300) -> list[int]:
    return [7] * 16 + [1000 + i] * (length - 16)  # one shared block (a chat template's), then the session's own


def test_dualmap_at_two_replicas_spreads_once_tpct_matches_the_machine():
    # The real 2-replica run: every prompt shares the chat template's first block, the configured
    # tpct (0.5 ms/token) is 10x below this CPU's. The replica that served the template first is
    # the affine candidate of every request, and 8 queued prompts (2,400 tokens -> 1.2 s predicted)
    # never pass SLO/2, so all 8 land on it.
    stuck = two_replicas(adapt=False)
    for i in range(8):  # as the proxy does: dispatch after every submit
        stuck.submit(req(f"r{i}", chat_prompt(i), cfg=stuck.config), 0.0)
        stuck.dispatch(0.0)
    placed = sorted(len(s.inflight) + len(q) for s, q in zip(stuck.backends.values(), stuck.queues.values(),
                                                             strict=True))
    assert placed == [0, 8]
    # Adapting: 8 requests served alone, each TTFT = 5 ms x its miss tokens, teach it tpct = 5 ms.
    policy = two_replicas(adapt=True)
    now = 0.0
    for i in range(8):
        policy.submit(req(f"w{i}", [500 + i] * 200, arrival=now, cfg=policy.config), now)
        (bound,) = policy.dispatch(now)
        now += 0.005 * 200
        policy.on_first_token(bound.request_id, now)
        policy.on_finished(bound.request_id, now)
    assert policy.tpct.value == pytest.approx(0.005)
    policy.submit(req("whole", [600] * 200, arrival=now, cfg=policy.config), now)
    policy.dispatch(now)
    policy.on_first_token("whole", now + 30.0, measured=False)  # a non-streamed answer: decode time inside
    assert policy.tpct.value == pytest.approx(0.005) and len(policy.ttfts) == 8
    for i in range(8):
        policy.submit(req(f"r{i}", chat_prompt(i), arrival=now, cfg=policy.config), now)
        policy.dispatch(now)
    placed = {name: len(s.inflight) + len(policy.queues[name]) for name, s in policy.backends.items()}
    assert min(placed.values()) >= 3  # past SLO/2 (2.5 s = 500 tokens ahead) it takes the cheaper candidate


def test_tpct_estimate_is_the_least_squares_slope_and_waits_for_points():
    from threefold.router.dualmap_queue import TpctEstimate

    est = TpctEstimate(0.001, window=4, adapt=True, min_points=3)
    est.observe(100, 0.3)
    est.observe(200, 0.6)
    assert est.value == 0.001  # two points: not yet
    est.observe(300, 0.9)
    assert est.value == pytest.approx(0.003)
    for _ in range(4):  # the window forgets the old points
        est.observe(100, 0.1)
    assert est.value == pytest.approx(0.001)
    frozen = TpctEstimate(0.001, window=4, adapt=False)
    for _ in range(10):
        frozen.observe(100, 5.0)
    assert frozen.value == 0.001


def test_dualmap_a_migrated_request_never_moves_back():
    policy = dualmap(n=2)
    policy.backends["i0"].prefilling["running"] = 80
    policy.backends["i1"].prefilling["running"] = 1
    for i in range(4):
        policy._push("i0", req(f"r{i}", [i] * 12), NORMAL)
    assert policy._is_hotspot("i0", 0.0)  # 128 tokens pending > SLO / tpct = 100
    assert policy.rebalance("i0", 0.0) == 3  # until >= 128 - 100 tokens moved: three 12-token prompts
    moved = {e.request.request_id for e in policy.queues["i1"].entries()}
    assert len(moved) == 3 and all(e.left == ("i0",) for e in policy.queues["i1"].entries())
    # now i1 is the hotspot and i0 idle: moving them back would pay, but they never go back
    policy.backends["i0"].prefilling.clear()
    policy.backends["i1"].prefilling["running"] = 200
    policy._push("i1", req("fresh", [9] * 12), NORMAL)
    assert policy._is_hotspot("i1", 0.0)
    assert policy.rebalance("i1", 0.0) == 1  # only the request that never moved
    assert {e.request.request_id for e in policy.queues["i0"].entries()} == {"r0", "r1", "r2", "r3", "fresh"} - moved
    assert {e.request.request_id for e in policy.queues["i1"].entries()} == moved


def test_instance_queue_matches_a_plain_list_under_random_operations():
    import random as stdlib_random

    from threefold.router.dualmap_queue import InstanceQueue, Queued

    rng = stdlib_random.Random(5)
    queue, plain = InstanceQueue(), []
    for seq in range(3000):
        op = rng.random()
        if op < 0.5 or not plain:
            entry = Queued(rng.choice([HIGH, NORMAL]), -rng.randrange(50), rng.random() * 100, seq,
                           req(f"r{seq}", [1]), rng.randrange(1, 40))
            queue.push(entry)
            plain.append(entry)
        elif op < 0.75:
            assert queue.pop() == min(plain)
            plain.remove(min(plain))
        else:
            victim = rng.choice(plain)
            queue.remove(victim)
            plain.remove(victim)
        assert len(queue) == len(plain) and queue.tokens == sum(e.miss for e in plain)
        assert queue.oldest_arrival() == (min(e.arrival for e in plain) if plain else None)
    assert queue.entries() == sorted(plain)


def test_adding_a_backend_moves_only_keys_onto_it():
    keys = [req(f"k{i}", [i, i * 7, 3, 4, 5, 6, 7, 8]) for i in range(400)]
    dual, ph = dualmap(n=4), make_policy("prefix_hash", [f"i{k}" for k in range(4)], CFG)
    before = {r.request_id: (dual.candidates(r), ph.ring.lookup(r.key)) for r in keys}
    dual.add_backend("i4", 0.0)
    ph.add_backend("i4", 0.0)
    moved = 0
    for r in keys:
        pair, owner = before[r.request_id]
        if dual.candidates(r) != pair:
            moved += 1
            assert "i4" in dual.candidates(r)
        assert ph.ring.lookup(r.key) in (owner, "i4")
    assert 0 < moved < 0.6 * len(keys)  # about 2/5 of the pairs involve the newcomer


def test_dualmap_spills_past_overloaded_neighbours_to_the_first_with_room():
    policy = dualmap(n=5)
    r = next(r for i in range(200) if "i0" in policy.candidates(r := req(f"r{i}", [i] * 12)))
    other = next(c for c in policy.candidates(r) if c != "i0")
    overloaded = {"i0", other, "i1", "i2"}
    for name in overloaded:
        policy.backends[name].prefilling["busy"] = 200  # 2 s pending > the 1 s SLO
    policy._push("i0", r, NORMAL)
    expected = next(n for n in ("i1", "i2", "i3", "i4") if n not in overloaded)
    assert policy.rebalance("i0", 0.0) == 1
    assert [e.request.request_id for e in policy.queues[expected].entries()] == [r.request_id]


def test_dualmap_spills_a_new_request_along_its_ring_when_both_candidates_are_overloaded():
    policy = dualmap(n=6)
    r = req("hot", [7] * 12)
    c1, c2 = policy.candidates(r)
    walk = [n for n in policy.rings[0].walk(r.key) if n not in (c1, c2)]
    policy.backends[c1].prefilling["busy"] = 200  # 2 s pending > the 1 s SLO
    assert policy.choose(r, 0.0) != c1  # one candidate overloaded: DualMap's own choice (the other)
    policy.backends[c2].prefilling["busy"] = 200
    policy.backends[walk[0]].prefilling["busy"] = 200
    assert policy.choose(r, 0.0) == walk[1]  # both past SLO/2: the first with room along the key's ring
    for name in walk:
        policy.backends[name].prefilling["busy"] = 200
    assert policy.choose(r, 0.0) in (c1, c2)  # nowhere with room: queue at a candidate, as before
