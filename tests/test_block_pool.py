"""BlockPool and KVCacheManager: exact block ids, free-list order, prefix hits."""

from __future__ import annotations

import pytest

from threefold.core.block_pool import BlockPool
from threefold.core.kv_cache_manager import KVCacheManager
from threefold.core.request import Request
from threefold.sample.params import SamplingParams

BLOCK = 4


def make_request(request_id: str, token_ids: list[int], **params) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(**params), frozenset({0}), max_tokens=16)


def test_free_queue_order_and_o1_remove():
    pool = BlockPool(6)
    assert pool.free_queue.block_ids() == [1, 2, 3, 4, 5]  # block 0 is the null block
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert pool.free_queue.block_ids() == [4, 5]
    pool.free_blocks(reversed(blocks))
    assert pool.free_queue.block_ids() == [4, 5, 3, 2, 1]
    pool.touch([pool.blocks[5]])  # revive from the middle of the queue
    assert pool.free_queue.block_ids() == [4, 3, 2, 1]
    assert pool.blocks[5].ref_cnt == 1
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(5)


def test_double_free_is_caught():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError):
        pool.free_blocks([block])


def test_allocate_exact_ids_and_free_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, model_fingerprint="m")
    req = make_request("a", range(1, 11))  # 10 tokens -> 3 blocks
    new = kv.allocate_slots(req, 10)
    assert [b.block_id for b in new] == [1, 2, 3]
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 2) == []  # fits the third block
    req.num_computed_tokens = 12
    assert [b.block_id for b in kv.allocate_slots(req, 1)] == [4]
    kv.free(req)
    # Tail blocks are freed first, so they are evicted first; the prefix survives longest.
    assert kv.pool.free_queue.block_ids() == [5, 6, 7, 4, 3, 2, 1]
    assert kv.usage() == 0.0


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK, model_fingerprint="m")
    a = make_request("a", range(1, 9))
    assert kv.allocate_slots(a, 8) is not None
    b = make_request("b", range(100, 112))  # needs 3 blocks, 1 free
    before = kv.pool.free_queue.block_ids()
    assert kv.allocate_slots(b, 12) is None
    assert kv.pool.free_queue.block_ids() == before
    assert "b" not in kv.req_to_blocks


def test_prefix_hit_shares_blocks_and_compares_tokens():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, model_fingerprint="m")
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks + 1
    a = make_request("a", prompt)
    kv.allocate_slots(a, len(prompt))
    b = make_request("b", [*prompt[:12], 99, 98])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 12 and [h.block_id for h in hits] == [1, 2, 3]
    kv.allocate_slots(b, 2, hits)
    assert kv.block_ids("b")[:3] == [1, 2, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 2]
    # A hit always leaves the last token to compute.
    c = make_request("c", prompt[:12])
    assert kv.get_computed_blocks(c)[1] == 8
    # Different model fingerprint: no hit.
    other = KVCacheManager(num_blocks=16, block_size=BLOCK, model_fingerprint="other")
    assert other.seed != kv.seed


def test_freed_cached_blocks_are_revived_then_evicted_lru():
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK, model_fingerprint="m")
    a = make_request("a", range(1, 10))  # 2 full blocks + 1
    kv.allocate_slots(a, 9)
    kv.free(a)
    b = make_request("b", range(1, 10))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and [h.block_id for h in hits] == [1, 2]
    kv.allocate_slots(b, 1, hits)
    assert kv.block_ids("b") == [1, 2, 4]
    kv.free(b)
    c = make_request("c", range(50, 66))  # 4 blocks: evicts everything, LRU first
    assert [x.block_id for x in kv.allocate_slots(c, 16)] == [3, 4, 2, 1]
    assert kv.pool.cached == {k: v for k, v in kv.pool.cached.items() if v.block_id in (1, 2, 3, 4)}
    assert kv.get_computed_blocks(make_request("d", range(1, 10)))[1] == 0


def test_hash_collision_never_serves_wrong_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, model_fingerprint="m")
    a = make_request("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)
    block = kv.pool.blocks[1]
    block.token_ids = (9, 9, 9, 9)  # simulate a collision: same hash, other tokens
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5]))[1] == 0


def test_prompt_logprobs_requests_skip_the_cache():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, model_fingerprint="m")
    kv.allocate_slots(make_request("a", range(1, 10)), 9)
    assert kv.get_computed_blocks(make_request("b", range(1, 10), prompt_logprobs=1))[1] == 0


def test_lookahead_slots_are_reserved_but_not_published():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, model_fingerprint="m")
    a = make_request("a", range(1, 4))
    assert len(kv.allocate_slots(a, 3, num_lookahead_tokens=4)) == 2
    assert kv.num_cached_blocks.get("a", 0) == 0
