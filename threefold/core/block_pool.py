"""BlockPool: KV blocks with reference counts, an O(1) LRU free list and the prefix-cache map.

A block is in exactly one of three states:
  in use        ref_cnt > 0, not in the free queue
  free, cached  ref_cnt == 0, in the free queue, still in the hash map (a prefix hit revives it)
  free, empty   ref_cnt == 0, in the free queue, no hash

The free queue is least-recently-freed first: allocation pops from the head,
so the blocks freed longest ago are the ones whose cached KV is evicted.
Block 0 is the null block: never allocated, it pads block tables.

Lifecycle events (when `record_events` is on, for the KV offload tiers): "cached"
(block_id, hash) when a full block is published under its hash. The scheduler
drains them each step; the tiers are written through, so eviction needs no event.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

NULL_BLOCK_ID = 0


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    """The tokens behind `block_hash`, compared on every hit."""
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; append, popleft and remove are all O(1)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise RuntimeError("no free blocks: the caller must check num_free_blocks first")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, f"{block} is not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids in eviction order (for tests and debugging)."""
        ids, node = [], self._head.next_free
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


class BlockPool:
    """Owns every KV block. Callers hold blocks by reference count."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.record_events = record_events
        self.cached_events: list[tuple[int, bytes]] = []
        """(block_id, block_hash) of blocks published since the last drain."""

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: bytes, token_ids: tuple[int, ...]) -> KVCacheBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, reviving free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = block.token_ids = None

    def cache_block(self, block: KVCacheBlock, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Publish a full block under its hash; the first block with a hash keeps it."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        if self.cached.setdefault(block_hash, block) is block and self.record_events:
            self.cached_events.append((block.block_id, block_hash))

    def drain_cached_events(self) -> list[tuple[int, bytes]]:
        events, self.cached_events = self.cached_events, []
        return events

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the queue tail in the given order."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"{block} freed twice"
            if block.ref_cnt == 0:
                if not self.enable_caching:
                    self._evict(block)
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> None:
        for block in list(self.cached.values()):
            self._evict(block)
