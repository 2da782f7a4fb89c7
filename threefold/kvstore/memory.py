"""L2: blocks in host memory, least recently used first out, sized in bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict

from threefold.kvstore.tier import Tier


class MemoryTier(Tier):
    """An LRU map of key -> payload bytes. Values are the engine's own bytes objects, kept unframed:
    nothing outside this process can touch them."""

    name = "cpu"
    framed = False
    io_reads = False

    def __init__(self, capacity_bytes: int) -> None:
        self._capacity = capacity_bytes
        self._used = 0
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()  # oldest first
        self._settled: set[bytes] = set()  # held here and written to every tier below (store.py)
        self._lock = threading.Lock()
        self.num_evicted = 0

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            value = self._blocks.get(key)
            if value is not None:
                self._blocks.move_to_end(key)
            return value

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        with self._lock:
            values = [self._blocks.get(key) for key in keys]
            for key, value in zip(keys, values, strict=True):
                if value is not None:
                    self._blocks.move_to_end(key)
            return values

    def put(self, key: bytes, value: bytes) -> bool:
        """Insert or refresh; evicts the least recently used until it fits. A value larger than the
        whole tier is not stored (it would evict everything and still not fit)."""
        if len(value) > self._capacity:
            return False
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self._used -= len(old)
            self._settled.discard(key)
            while self._used + len(value) > self._capacity:
                evicted_key, evicted = self._blocks.popitem(last=False)
                self._settled.discard(evicted_key)
                self._used -= len(evicted)
                self.num_evicted += 1
            self._blocks[key] = value
            self._used += len(value)
        return True

    def settle(self, key: bytes) -> None:
        """Mark a held block as written to every tier below, so a later put of it can stop here."""
        with self._lock:
            if key in self._blocks:
                self._settled.add(key)

    def refresh_if_settled(self, key: bytes) -> bool:
        """Make a settled block the most recent and say True; False for any other key."""
        with self._lock:
            if key not in self._settled:
                return False
            self._blocks.move_to_end(key)
            return True

    def touch(self, key: bytes) -> bool:
        """Make a held block the most recent (a swapped-out request's, kept for its resume); False if absent."""
        with self._lock:
            if key not in self._blocks:
                return False
            self._blocks.move_to_end(key)
            return True

    def delete(self, key: bytes) -> None:
        with self._lock:
            self._settled.discard(key)
            old = self._blocks.pop(key, None)
            if old is not None:
                self._used -= len(old)

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._blocks for key in keys]

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def check_integrity(self) -> list[str]:
        with self._lock:
            held = sum(len(value) for value in self._blocks.values())
            problems = [f"used_bytes {self._used} != {held} held"] if held != self._used else []
            return problems + ([f"{held} bytes held > capacity {self._capacity}"] if held > self._capacity else [])

    def keys(self) -> list[bytes]:
        """Oldest first (tests assert the LRU order)."""
        with self._lock:
            return list(self._blocks)
