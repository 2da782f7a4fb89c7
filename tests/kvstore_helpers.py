"""Blocks and stores for the KV tier tests (tests/test_kvstore*.py)."""

from __future__ import annotations

import os

from threefold.kvstore import Namespace, OffloadConfig, TieredKVStore

NS = Namespace("weights-sha:abc", "auto", 16)


def block(i: int, size: int = 4096) -> tuple[bytes, bytes]:
    """(block hash, payload): a 32-byte hash and random bytes, distinct per i."""
    return i.to_bytes(32, "little"), os.urandom(size)


def make_store(**config) -> TieredKVStore:
    return TieredKVStore(OffloadConfig(**config), NS)
