"""The engine's KV block pool (threefold/core/block_pool.py) as the simulator needs it.

Same rules as `BlockPool`, block for block: a block is in use (held by running
requests, reference counted), free and cached (its hash still findable: a hit
revives it), or free and empty. Only free blocks are evicted, least recently
freed first, and a request frees its blocks tail first, so a prefix outlives
its suffixes. The prefix cache is therefore smaller while requests run, and a
conversation loses its last blocks first, not its first ones (an LRU over every
block, the simulator's old cache, broke chains at their head).

Kept lean for 1000 simulated instances: blocks are not objects. A held block is
a key in its request's list: the block's hash when it is the cached copy of
that hash, a negative id when it holds no findable hash (not yet full, or a
second copy of a hash another block already publishes, as `cache_block` keeps
the first). The free queue is one OrderedDict of such keys. Never-used blocks
are a count at the head of the queue (where `BlockPool` starts them all).

Beyond the engine: when nothing is free, `allocate` still hands out blocks (the
simulator does not preempt); the pool then holds more than `num_blocks` until
as many blocks are freed, and those are dropped instead of queued.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence


class SimBlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._never_used = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict()
        """Free blocks, least recently freed first: a cached block's hash (>= 0) or an empty block's id (< 0)."""
        self._num_free_cached = 0
        self._refs: dict[int, int] = {}
        """hash -> holders, for cached blocks in use."""
        self._empty_ids = itertools.count(-1, -1)
        self.over_capacity = 0
        """Blocks handed out beyond num_blocks (no preemption here); dropped as they are freed."""

    def __len__(self) -> int:
        """Blocks whose hash is findable (in use or free)."""
        return len(self._refs) + self._num_free_cached

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._refs or block_hash in self._free

    @property
    def num_free(self) -> int:
        return self._never_used + len(self._free)

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks cached (chained hashes: a gap ends the match)."""
        matched = 0
        for h in hashes:
            if h not in self._refs and h not in self._free:
                break
            matched += 1
        return matched

    def fits(self, hit_hashes: Sequence[int], num_new: int) -> bool:
        """`KVCacheManager.allocate_slots`' test: free blocks, less the hits it would revive, cover num_new."""
        revived = sum(1 for h in hit_hashes if h in self._free)
        return num_new <= self.num_free - revived

    def touch(self, held: list[int], hit_hashes: Sequence[int]) -> None:
        """Take a reference on cache-hit blocks (reviving free ones) and append them to `held`."""
        for h in hit_hashes:
            if h in self._free:
                del self._free[h]
                self._num_free_cached -= 1
            self._refs[h] = self._refs.get(h, 0) + 1
            held.append(h)

    def allocate(self, held: list[int], num_blocks: int) -> None:
        """Append `num_blocks` empty blocks to `held`, evicting the least recently freed cached ones."""
        for _ in range(num_blocks):
            if self._never_used:
                self._never_used -= 1
            elif self._free:
                key, _ = self._free.popitem(last=False)
                if key >= 0:
                    self._num_free_cached -= 1  # evicted: its hash is gone
            else:
                self.over_capacity += 1
            held.append(next(self._empty_ids))

    def publish(self, held: list[int], hashes: Sequence[int], start: int = 0) -> None:
        """Give held[i] the hash hashes[i] (i >= start) where it has none and no other block has published it."""
        for i in range(start, len(hashes)):
            h = hashes[i]
            if held[i] < 0 and h not in self._refs and h not in self._free:
                held[i] = h
                self._refs[h] = 1

    def free(self, held: list[int]) -> None:
        """Drop the request's references, tail first; blocks reaching zero join the free queue's tail."""
        for key in reversed(held):
            if key >= 0:
                self._refs[key] -= 1
                if self._refs[key]:
                    continue
                del self._refs[key]
            if self.over_capacity:
                self.over_capacity -= 1  # the pool shrinks back to num_blocks
                continue
            self._free[key] = None
            self._num_free_cached += key >= 0
        held.clear()
