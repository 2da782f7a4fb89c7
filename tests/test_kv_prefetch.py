"""Prefetching tier reads while the engine steps on, and swap-or-recompute preemption (issue 12).

The tier under test is a real host-memory tier whose reads count as I/O and wait on a gate the test
holds, so "a load is pending" is a state the test controls, not a race. One fp32 SmolLM2 (conftest's),
a 20-block pool, greedy outputs compared with an engine without offload."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from threefold.core.request import RequestStatus
from threefold.kv.paged import PagedKVCache
from threefold.kv.registry import make_codec
from threefold.kvstore import Namespace, OffloadConfig, TieredKVStore
from threefold.kvstore.memory import MemoryTier
from threefold.kvstore.metrics import KVOffloadCollector
from threefold.kvstore.tier import Tier, TierFault
from threefold.sample.params import SamplingParams
from threefold.spec.adaptive import StepCostModel
from threefold.worker.kv_offload import BlockCodec, KVOffload

BLOCK_BYTES_FP32 = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2: 30 layers, 3 KV heads of 64, fp32
POOL = {"max_model_len": 256, "kv_cache_memory": 20 * BLOCK_BYTES_FP32}  # 20 blocks of 16 tokens
GREEDY = SamplingParams(max_tokens=4, temperature=0)


class GatedTier(MemoryTier):
    """Host memory whose reads are I/O to the engine (prefetched) and wait while `gate` is clear;
    reads past `fail_after` raise the fault a dead medium would."""

    name = "gated"
    io_reads = True

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.gate = threading.Event()
        self.gate.set()
        self.fail_after: int | None = None
        self.num_reads = 0

    get_many = Tier.get_many  # block by block through get(), past the gate (not MemoryTier's one lock)

    def get(self, key: bytes) -> bytes | None:
        assert self.gate.wait(timeout=60), "the test never opened the gate"
        self.num_reads += 1
        if self.fail_after is not None and self.num_reads > self.fail_after:
            raise TierFault("read", "injected by the test")
        return super().get(key)


def prompts() -> dict[str, list[int]]:
    rng = random.Random(11)
    return {name: [rng.randrange(100, 40000) for _ in range(length)]
            for name, length in (("a", 150), ("b", 100), ("long", 180))}


def run(engine, limit: int = 200) -> dict[str, list[int]]:
    """Step until every request is done; -> token ids by request id."""
    done = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return done
        done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    raise AssertionError("the engine did not finish its requests")


@pytest.fixture(scope="module")
def baseline(make_llm):
    """Each prompt alone on an engine without offload."""
    llm = make_llm(**POOL)
    return {name: llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=8, temperature=0))[0]
            .outputs[0].token_ids for name, p in prompts().items()}


@pytest.fixture(scope="module")
def gated(make_llm):
    """An engine whose only tier is a GatedTier, with prompt "a" written through to it."""
    llm = make_llm(kv_offload=OffloadConfig(cpu_bytes=64 * BLOCK_BYTES_FP32), **POOL)
    offload = llm.engine.core.offload
    offload.store.close()
    tier = GatedTier(64 * BLOCK_BYTES_FP32)
    offload.store = offload.prefetch.store = TieredKVStore(offload.store.config, offload.store.namespace, [tier])
    offload.store.set_bandwidth("gated", 1e12)  # loading always beats recompute here: the test is the async path
    llm.engine.add_request("warm", prompts()["a"], GREEDY)
    run(llm.engine)
    yield llm, tier
    tier.gate.set()
    llm.close()


def forget_l1(core) -> None:
    """Empty the pool's prefix cache, so the next request finds its prefix only in the tier."""
    assert not core.kv.req_to_blocks
    core.kv.reset_prefix_cache()


def test_a_pending_load_does_not_stall_other_requests(gated, baseline):
    llm, tier = gated
    engine, core = llm.engine, llm.engine.core
    forget_l1(core)
    tier.gate.clear()
    engine.add_request("a", prompts()["a"], SamplingParams(max_tokens=8, temperature=0))
    engine.add_request("b", prompts()["b"], SamplingParams(max_tokens=8, temperature=0))
    done = {}
    for _ in range(9):  # b prefills and decodes all 8 tokens while a's read is held at the gate
        done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    assert done == {"b": baseline["b"]}
    a = core.scheduler.requests["a"]
    assert a.status == RequestStatus.WAITING_FOR_KV and a.num_computed_tokens == 0
    assert core.offload.engine_stats().loading_requests == 1
    tier.gate.set()
    done = run(engine)
    assert done == {"a": baseline["a"]}
    assert a.cached_tokens_by_tier == {"gated": 144}  # 9 full blocks; the last token is always computed
    counts = core.offload.engine_stats()
    assert counts.prefetched_requests >= 1 and counts.load_fallbacks == 0 and counts.loading_requests == 0


def test_abort_while_loading_frees_every_block(gated):
    llm, tier = gated
    engine, core = llm.engine, llm.engine.core
    forget_l1(core)
    engine.add_request("head", prompts()["a"][:70], GREEDY)  # 4 blocks of a's prefix back in L1
    run(engine)
    tier.gate.clear()
    engine.add_request("c", prompts()["a"], GREEDY)
    engine.step()
    pool = core.kv.pool
    held = core.kv.req_to_blocks["c"]
    assert core.scheduler.requests["c"].status == RequestStatus.WAITING_FOR_KV
    assert len(held) == 9 and [b.ref_cnt for b in held] == [1] * 9  # 4 L1 hits revived + 5 to load
    assert pool.num_free_blocks == pool.num_blocks - 1 - 9
    reads = tier.num_reads
    engine.abort_request(["c"])
    assert pool.num_free_blocks == pool.num_blocks - 1 and not core.kv.req_to_blocks
    assert not core.scheduler.loads.loading and not core.scheduler.requests
    tier.gate.set()
    for _ in range(500):  # the dropped read still runs to its end on its thread: let it, then check
        if tier.num_reads == reads + 5:
            break
        time.sleep(0.01)
    engine.step()  # the dropped read's result, if it came in, is ignored
    assert not core.offload.staged and not core.offload.to_copy and core.offload.prefetch.num_pending == 0
    assert pool.num_free_blocks == pool.num_blocks - 1 and all(b.ref_cnt == 0 for b in pool.blocks)


def test_a_failing_read_falls_back_to_recompute(gated, baseline):
    llm, tier = gated
    engine, core = llm.engine, llm.engine.core
    forget_l1(core)
    faults_before = core.offload.store.stats().tiers["gated"].faults.get("read", 0)
    tier.fail_after = tier.num_reads + 3  # three blocks come in, the fourth read fails
    engine.add_request("d", prompts()["a"], SamplingParams(max_tokens=8, temperature=0))
    request = core.scheduler.requests["d"]
    try:
        assert run(engine) == {"d": baseline["a"]}
    finally:
        tier.fail_after = None
    assert request.cached_tokens_by_tier == {"gated": 48}
    assert core.offload.engine_stats().load_fallbacks == 1
    assert core.offload.store.stats().tiers["gated"].faults["read"] == faults_before + 1


def test_loaded_requests_holding_the_pool_do_not_deadlock(gated, baseline):
    llm, tier = gated
    engine, core = llm.engine, llm.engine.core
    engine.add_request("warm-long", prompts()["long"], GREEDY)
    run(engine)
    forget_l1(core)
    tier.gate.clear()
    # "long" loads 11 blocks and "a" 9: the 20-block pool is all held, and "long" needs one more to run.
    engine.add_request("long", prompts()["long"], SamplingParams(max_tokens=8, temperature=0))
    engine.add_request("a", prompts()["a"], SamplingParams(max_tokens=8, temperature=0))
    engine.step()
    assert core.kv.pool.num_free_blocks == 0 and len(core.scheduler.loads.loading) == 2
    tier.gate.set()
    # The last loaded request lets its (cached) blocks go, "long" runs, then "a" finds them again.
    assert run(engine) == {"long": baseline["long"], "a": baseline["a"]}
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks - 1


def preempt_by_priority(engine, core) -> None:
    """"a" (low priority) runs; "long" (high) arrives and the pool cannot hold both: "a" is preempted."""
    engine.add_request("a", prompts()["a"], SamplingParams(max_tokens=8, temperature=0), priority=1)
    engine.step()
    engine.step()
    engine.add_request("long", prompts()["long"], SamplingParams(max_tokens=8, temperature=0))
    engine.step()
    assert core.scheduler.requests["a"].num_preemptions == 1


@pytest.mark.parametrize("slow_tier", [False, True])
def test_preemption_swaps_to_host_memory_or_recomputes_by_cost(make_llm, baseline, slow_tier):
    llm = make_llm(kv_offload=OffloadConfig(cpu_bytes=64 * BLOCK_BYTES_FP32), **POOL)
    engine, core = llm.engine, llm.engine.core
    offload = core.offload
    if slow_tier:  # 1 kB/s: bringing 9 blocks back takes hours, recomputing 150 tokens a fraction of a second
        offload.store.set_bandwidth("cpu", 1e3)
    preempt_by_priority(engine, core)
    assert run(engine) == {"a": baseline["a"], "long": baseline["long"]}
    counts = offload.engine_stats()
    if slow_tier:
        assert counts.preemptions == {("recompute", "cheaper"): 1} and counts.swapped_blocks == 0
        assert offload.num_loaded == 0  # and admission did not load from the slow tier either
    else:
        assert counts.preemptions == {("swap", "cheaper"): 1} and counts.swapped_blocks == 9
        assert offload.num_loaded >= 1  # what "long" evicted from L1 came back from host memory
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks - 1
    llm.close()


def test_swap_rule_and_copy_out_on_a_small_cache():
    torch.manual_seed(0)
    codec = make_codec("auto", 2, 8, torch.float32)
    cache = PagedKVCache(codec, 3, 8, 4, torch.device("cpu"))
    for layer in range(3):
        cache.write(layer, torch.arange(32), torch.randn(32, 2, 8), torch.randn(32, 2, 8))
    block_codec = BlockCodec(cache, codec)
    store = TieredKVStore(OffloadConfig(cpu_bytes=4 * block_codec.payload_bytes), Namespace("fp", "auto", 4))
    offload = KVOffload(store, block_codec, 4)
    blocks = [(2, b"h2"), (3, b"h3"), (5, b"h5")]
    store.put(b"h2", block_codec.encode([2])[0])  # L2 holds one of the three already
    offload.cost = StepCostModel({1: 0.01, 12: 1.0})  # recomputing 12 tokens: 1 s
    assert offload.preempt("r", blocks, 12) == [(3, b"h3"), (5, b"h5")]  # copy out what L2 lacks
    offload.swap_out([(3, b"h3"), (5, b"h5")])
    for block_id, block_hash in blocks:
        assert store.get(block_hash) == ("cpu", block_codec.encode([block_id])[0])
    assert offload.preempt("r", blocks, 12) == []  # all held now: refreshed, nothing to copy
    store.set_bandwidth("cpu", 1.0)
    assert offload.preempt("r", blocks, 12) == []  # recompute: reading them back would take minutes
    big = [(1, b"x%d" % i) for i in range(5)]  # more than L2 holds
    assert offload.preempt("r", big, 20) == [] and offload.preempt("r", [], 3) == []
    assert offload.counts.preemptions == {("swap", "cheaper"): 2, ("recompute", "cheaper"): 1,
                                          ("recompute", "too_large"): 1, ("recompute", "no_blocks"): 1}
    registry = CollectorRegistry()
    registry.register(KVOffloadCollector(store.stats, "m", 4, offload.engine_stats))
    text = generate_latest(registry).decode()
    assert 'threefold:kv_offload_preemptions_total{action="swap",model_name="m",reason="cheaper"} 2.0' in text
    assert 'threefold:kv_offload_swapped_blocks_total{model_name="m"} 6.0' in text
    offload.close()
