"""The router's estimate of what each backend holds in its prefix cache.

The engines cache KV in full blocks keyed by chained hashes (block i's hash
covers tokens 0..(i+1)*block_size), so a set of chained hashes is a radix tree
over block-aligned prefixes: a prompt's cached length is the number of leading
block hashes found. This is the block-level form of SGLang's approximate radix
tree; the router inserts a prompt's blocks when it routes it there and forgets
the least recently used blocks beyond `capacity_blocks` (the engine's KV pool).
A prompt's blocks are touched tail first, so its first block is the most recent:
eviction then trims a prefix from its end, as the engine does (a finished request
frees its blocks tail first), instead of cutting its head and leaving every later
block of the chain unmatchable.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from threefold.router.hashring import hash64


def block_hashes(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the prompt's full blocks (a trailing partial block is never cached)."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        parent = hash64(parent.to_bytes(8, "big") + b"".join(t.to_bytes(4, "big") for t in block))
        hashes.append(parent)
    return tuple(hashes)


def prefix_key(token_ids: Sequence[int], block_size: int, key_tokens: int) -> int:
    """The routing key of prefix_hash/DualMap: a hash of the first `key_tokens` tokens, cut to a
    block boundary (the whole prompt when it is shorter than one key)."""
    aligned = max(block_size, key_tokens // block_size * block_size)
    head = token_ids[:aligned]
    if len(head) >= block_size:
        head = head[:len(head) // block_size * block_size]
    return hash64(b"".join(t.to_bytes(4, "big") for t in head))


class PrefixIndex:
    """LRU set of chained block hashes for one backend."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks present (chained hashes: a gap ends the match)."""
        matched = 0
        for h in hashes:
            if h not in self._blocks:
                break
            matched += 1
        return matched

    def insert(self, hashes: Sequence[int]) -> None:
        for h in reversed(hashes):  # tail first: the head is evicted last
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
