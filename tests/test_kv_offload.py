"""The engine over the KV offload tiers (issue 12): external KV loads, write-through, restarts,
sharing through a real Redis, faults. One fp32 SmolLM2 (conftest's), small pools, short outputs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from threefold.errors import ThreefoldError
from threefold.kv.paged import PagedKVCache
from threefold.kv.registry import make_codec
from threefold.kvstore import OffloadConfig, TieredKVStore
from threefold.kvstore.keys import Namespace
from threefold.sample.params import SamplingParams
from threefold.spec.adaptive import StepCostModel
from threefold.worker.kv_offload import BlockCodec, KVOffload

BLOCK_BYTES_FP32 = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2: 30 layers, 3 KV heads of 64, fp32
POOL = {"max_model_len": 512, "kv_cache_memory": 40 * BLOCK_BYTES_FP32}  # 40 blocks: fewer than 4 sessions need
GREEDY = SamplingParams(max_tokens=4, temperature=0)


def sessions(num: int = 4, length: int = 150) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(num)]


def run_turns(llm, histories: list[list[int]], turns: int = 2):
    """Multi-turn: each turn appends the reply and a fixed user message. -> (token ids, RequestOutput) per turn."""
    histories = [list(h) for h in histories]
    results = []
    for turn in range(turns):
        outs = llm.generate([{"prompt_token_ids": h} for h in histories], GREEDY)
        for h, out in zip(histories, outs, strict=True):
            assert out.error is None and out.outputs[0].finish_reason != "error"
            h.extend(out.outputs[0].token_ids)
            h.extend(range(1000 + 40 * turn, 1020 + 40 * turn))
        results.append(outs)
    return results


def tier_tokens(results, tier: str) -> int:
    return sum((o.cached_tokens_by_tier or {}).get(tier, 0) for turn in results for o in turn)


def token_ids(results) -> list[list[int]]:
    return [o.outputs[0].token_ids for turn in results for o in turn]


@pytest.fixture(scope="module")
def baseline(make_llm):
    llm = make_llm(**POOL)
    return token_ids(run_turns(llm, sessions()))


def test_later_turns_hit_lower_tiers_with_equal_outputs(make_llm, baseline, tmp_path):
    # L2 holds ~10 blocks: the sessions' early blocks fall through to L3.
    config = OffloadConfig(cpu_bytes=10 * BLOCK_BYTES_FP32, disk_dir=str(tmp_path))
    llm = make_llm(kv_offload=config, **POOL)
    results = run_turns(llm, sessions())
    assert token_ids(results) == baseline
    assert tier_tokens(results[1:], "cpu") > 0 and tier_tokens(results[1:], "disk") > 0
    offload = llm.engine.core.offload
    assert offload.token_seconds > 0  # the recompute floor, from the startup prefill profile
    stats = offload.store.stats()
    # Every block loaded was read from its tier (a read staged for a request that then waited may be read again).
    assert stats.tiers["cpu"].hits * 16 >= tier_tokens(results, "cpu")
    assert stats.tiers["disk"].hits * 16 >= tier_tokens(results, "disk")
    assert offload.num_loaded * 16 == tier_tokens(results, "cpu") + tier_tokens(results, "disk")
    llm.close()


def test_block_codec_round_trip_dense_exact_and_int8_bounded():
    torch.manual_seed(0)
    dense = make_codec("auto", 2, 8, torch.float32)
    cache = PagedKVCache(dense, 3, 6, 4, torch.device("cpu"))
    for layer in range(3):
        cache.write(layer, torch.arange(24), torch.randn(24, 2, 8), torch.randn(24, 2, 8))
    original = [storage.clone() for storage in cache.layers]
    same = BlockCodec(cache, dense)
    payloads = same.encode([2, 4])
    assert len(payloads[0]) == same.payload_bytes == 3 * 2 * 4 * 2 * 8 * 4
    same.decode([5, 1], payloads)
    for layer in range(3):
        assert torch.equal(cache.layers[layer][:, 5], original[layer][:, 2])
        assert torch.equal(cache.layers[layer][:, 1], original[layer][:, 4])
    int8 = make_codec("int8", 2, 8, torch.float32)
    coded = BlockCodec(cache, int8)
    assert coded.payload_bytes < same.payload_bytes
    coded.decode([3, 0], coded.encode([2, 4]))
    for layer in range(3):
        for source, target in ((2, 3), (4, 0)):
            k, v = original[layer][0, source], original[layer][1, source]  # [bs, kvh, d]
            rk, rv = int8.round_trip(k, v)
            assert torch.allclose(cache.layers[layer][0, target], rk, atol=1e-6)  # the codec's own round trip
            assert torch.allclose(cache.layers[layer][1, target], rv, atol=1e-6)
            assert not torch.equal(cache.layers[layer][0, target], k)
    bf16 = make_codec("auto", 2, 8, torch.bfloat16)  # numpy has no bf16: the codec copies bytes
    half = PagedKVCache(bf16, 3, 6, 4, torch.device("cpu"))
    for layer in range(3):
        half.write(layer, torch.arange(24), torch.randn(24, 2, 8), torch.randn(24, 2, 8))
    half_codec = BlockCodec(half, bf16)
    half_codec.decode([0], half_codec.encode([3]))
    assert all(torch.equal(storage[:, 0], storage[:, 3]) for storage in half.layers)


def test_load_or_recompute_takes_the_longest_saving_prefix_past_a_flat_stretch_of_the_step_cost():
    dense = make_codec("auto", 3, 64, torch.float32)
    codec = BlockCodec(PagedKVCache(dense, 30, 4, 16, torch.device("cpu")), dense)  # SmolLM2's 720 KiB blocks
    with TieredKVStore(OffloadConfig(cpu_bytes=1 << 20), Namespace("m", "auto", 16)) as store:
        offload = KVOffload(store, codec, 16)
        # One slow 64-token step (a busy machine): the running maximum is flat from 64 to 1000 tokens, so the
        # first blocks past 80 computed tokens look free to recompute, the 2,000 tokens after them do not.
        offload.cost = StepCostModel({2: 0.03, 64: 0.5, 96: 0.1, 1000: 0.5, 3000: 6.0})
        assert offload._worth_loading(["cpu"] * 130, 80) == ["cpu"] * 130
        assert offload._worth_loading(["cpu"] * 20, 80) == []  # all within the flat stretch: recompute
        assert offload.num_load_rejected == 20


def test_a_cost_model_of_small_steps_still_loads_a_long_prefix_from_a_fast_tier_and_skips_a_slow_one():
    dense = make_codec("auto", 3, 64, torch.float32)
    codec = BlockCodec(PagedKVCache(dense, 30, 4, 16, torch.device("cpu")), dense)
    with TieredKVStore(OffloadConfig(cpu_bytes=1 << 20), Namespace("m", "auto", 16)) as store:
        # Instance B of the cross-instance run: a startup profile, then only small steps (its prompts came
        # from Redis), one of them slow: the running maximum is flat from 4 tokens on, so the model alone
        # prices a 2,000-token prefill at nothing.
        offload = KVOffload(store, codec, 16, profile={1: 0.02, 128: 0.15})
        for num_tokens, seconds in ((1, 0.03), (2, 0.05), (4, 0.4), (3, 0.03)):
            offload.observe_step(num_tokens, seconds)
        assert offload.cost(2008) == offload.cost(8)
        assert offload.token_seconds == pytest.approx(0.13 / 127)
        assert offload._worth_loading(["cpu"] * 125, 8) == ["cpu"] * 125  # the floor: ~1 ms a token
        store.set_bandwidth("cpu", 1e5)  # 7 s a block: recomputing 16 tokens is far cheaper
        assert offload._worth_loading(["cpu"] * 125, 8) == []
        assert offload.num_load_rejected == 125


def test_random_aborts_leave_no_leaks(make_llm, tmp_path):
    llm = make_llm(kv_offload=OffloadConfig(cpu_bytes=12 * BLOCK_BYTES_FP32, disk_dir=str(tmp_path)), **POOL)
    engine, rng = llm.engine, random.Random(3)
    prompts = sessions(6, 120)
    for i, prompt in enumerate(prompts + prompts[:2]):
        engine.add_request(f"r{i}", prompt[: rng.randrange(40, 120)], SamplingParams(max_tokens=8, temperature=0))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps % 3 == 0 and engine.requests:
            engine.abort_request([rng.choice(sorted(engine.requests))])
    core = engine.core
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks - 1 and not core.kv.req_to_blocks
    assert not core.offload.staged and not core.scheduler.requests
    loads = core.scheduler.loads
    assert not loads.loading and not loads.loaded and core.offload.prefetch.num_pending == 0
    assert core.offload.store.flush(10) and core.offload.store.check_integrity() == []
    assert core.offload.store.stats().tiers["disk"].writes == core.offload.num_stored > 0
    llm.close()


def test_restart_hits_disk_and_changed_codec_or_corruption_recomputes(make_llm, baseline, tmp_path):
    prompt = [sessions()[0]]
    first = make_llm(kv_offload=OffloadConfig(disk_dir=str(tmp_path)), **POOL)
    want = run_turns(first, prompt, turns=1)
    first.close()  # flushes the writer: the blocks are on disk
    second = make_llm(kv_offload=OffloadConfig(disk_dir=str(tmp_path)), **POOL)
    again = run_turns(second, prompt, turns=1)
    assert tier_tokens(again, "disk") == 144 and token_ids(again) == token_ids(want) == baseline[:1]
    second.close()
    other_codec = make_llm(kv_offload=OffloadConfig(disk_dir=str(tmp_path), codec="int8"), **POOL)
    assert tier_tokens(run_turns(other_codec, prompt, turns=1), "disk") == 0
    other_codec.close()
    for path in Path(tmp_path).rglob("*.slab"):  # flip a byte mid-record in every slot: all must be recomputed
        data, slot_bytes = bytearray(path.read_bytes()), int(path.name.split("-")[0])
        for start in range(0, len(data), slot_bytes):
            data[start + slot_bytes // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    corrupt = make_llm(kv_offload=OffloadConfig(disk_dir=str(tmp_path)), **POOL)
    recomputed = run_turns(corrupt, prompt, turns=1)
    assert tier_tokens(recomputed, "disk") == 0 and token_ids(recomputed) == baseline[:1]
    assert sum(corrupt.engine.core.offload.store.stats().tiers["disk"].faults.values()) >= 1
    corrupt.close()


def test_two_engines_share_redis_and_survive_its_death(make_llm, baseline, redis_server):
    prompt = [sessions()[0]]
    a = make_llm(kv_offload=OffloadConfig(redis_url=redis_server.url), **POOL)
    run_turns(a, prompt, turns=1)
    a.close()
    b = make_llm(kv_offload=OffloadConfig(redis_url=redis_server.url), **POOL)
    shared = run_turns(b, prompt, turns=1)
    assert tier_tokens(shared, "redis") == 144 and token_ids(shared) == baseline[:1]
    redis_server.stop()  # killed mid-run: every request is still served, by recompute
    others = sessions(3, 150)[1:]
    killed = run_turns(b, others, turns=1)
    assert all(o.outputs[0].finish_reason in ("length", "stop") for turn in killed for o in turn)
    stats = b.engine.core.offload.store.stats().tiers["redis"]
    assert sum(stats.faults.values()) + stats.skipped >= 1
    b.close()


@pytest.mark.parametrize("pool,offload_codec", [("kivi2:group=16,residual=16", None), ("auto", "turboquant")])
def test_codecs_the_tiers_cannot_move_are_refused_at_startup(make_llm, pool, offload_codec):
    config = OffloadConfig(cpu_bytes=10 * BLOCK_BYTES_FP32, codec=offload_codec)
    with pytest.raises(ThreefoldError, match="kv_offload does not support"):
        make_llm(kv_offload=config, kv_cache_dtype=pool, **POOL)
