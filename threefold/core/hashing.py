"""Chained block hashes for automatic prefix caching.

    block 0            block 1            block 2
  [t0 .. t15]        [t16 .. t31]       [t32 .. t47]
  h0 = H(seed, t0..)  h1 = H(h0, t16..)  h2 = H(h1, t32..)

Each full block's hash covers every token before it, so equal hashes mean
equal prefixes (and the pool still compares the tokens on a hit, so a hash
collision can never serve wrong KV). The seed mixes in a fingerprint of the
model and the KV codec spec so caches of different weights or codecs never meet. SHA-256, not Python's
`hash`, so hashes are stable across processes (the KV tiers rely on that).
"""

from __future__ import annotations

import hashlib
from array import array


def seed_hash(model_fingerprint: str, kv_cache_spec: str = "auto") -> bytes:
    """The chain's root: blocks of another model, or of another KV codec (whose blocks hold
    other bytes), never share a hash."""
    return hashlib.sha256(b"threefold-prefix-v1:" + model_fingerprint.encode() + b"|kv:"
                          + kv_cache_spec.encode()).digest()


def hash_block(parent_hash: bytes, token_ids: list[int] | tuple[int, ...]) -> bytes:
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def extend_block_hashes(
    block_hashes: list[bytes], token_ids: list[int], block_size: int, seed: bytes
) -> None:
    """Append hashes for every newly completed full block of `token_ids` (in place)."""
    start = len(block_hashes) * block_size
    parent = block_hashes[-1] if block_hashes else seed
    while start + block_size <= len(token_ids):
        parent = hash_block(parent, token_ids[start : start + block_size])
        block_hashes.append(parent)
        start += block_size
