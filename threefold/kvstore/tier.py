"""The one small interface every KV tier implements, and the fault handling they share.

Rules for a tier:
  - keys and values are bytes; a tier never interprets a value (the store frames and verifies them);
  - `get` of a missing key is None, never an exception;
  - a fault of the medium (disk full or read-only, Redis down or slow) raises TierFault; the store counts
    it by `kind`, treats the call as a miss or a skipped write, and carries on;
  - a tier is thread-safe: the engine thread reads while the store's writer thread writes.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod

from threefold.kvstore.frame import FrameError, RecordBuffer


class TierFault(Exception):
    """The tier's medium failed; `kind` is the counted fault ("unavailable", "disk_full", "read_only", ...),
    or "skipped": the tier is backing off after an earlier fault and did not try."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.partial: list[bytes | None] = []
        """From `get_many`: the answers for the keys before the one that failed (they are good)."""


class Tier(ABC):
    """One level below the engine's pool."""

    name: str
    """"cpu", "disk" or "redis": the label in stats, metrics and lookup results."""
    framed: bool = True
    """Whether values are stored as verified frames (frame.py). Only in-process memory is trusted as is."""
    io_reads: bool = True
    """Whether a read waits on a device or the network: the engine then prefetches it on a background
    thread while its steps go on. In-process memory is read inline."""

    @abstractmethod
    def get(self, key: bytes) -> bytes | None: ...

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """One answer per key, in order (a remote tier in one round trip). A fault raises TierFault with
        the answers before it in `partial`. A tier that checks its own storage around a record (the disk
        tier's slot header) raises FrameError from `get`; the bad value's place then holds the FrameError."""
        values: list[bytes | None] = []
        for key in keys:
            try:
                values.append(self.get(key))
            except FrameError as bad:
                values.append(bad)  # type: ignore[arg-type]  # the store counts it and deletes the block
            except TierFault as fault:
                fault.partial = values
                raise
        return values

    @abstractmethod
    def put(self, key: bytes, value: bytes) -> bool:
        """Store a value; False when there was nothing to write (already held, or larger than the tier)."""

    def put_record(self, key: bytes, record: memoryview, buffer: RecordBuffer | None = None) -> bool:
        """`put` of a framed record, a view valid during the call only (a tier keeps no reference to it).
        `buffer`: the page-aligned RecordBuffer the record lies in, if it does (a file can be written
        from it with O_DIRECT as it is)."""
        return self.put(key, bytes(record))

    @abstractmethod
    def delete(self, key: bytes) -> None: ...

    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    @abstractmethod
    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """One answer per key; a remote tier answers them in one round trip."""

    @property
    @abstractmethod
    def capacity_bytes(self) -> int | None:
        """The byte limit, or None where the medium sizes itself (Redis' maxmemory)."""

    @property
    @abstractmethod
    def used_bytes(self) -> int | None:
        """Bytes held, or None where this process cannot know (a Redis shared with others)."""

    def check_integrity(self) -> list[str]:
        """Mismatches between the tier's index and what it holds; empty when sound."""
        return []

    def available(self) -> bool:
        """Whether reads may be tried now (False while a failed medium waits for its retry)."""
        return True

    def close(self) -> None:
        """Release connections; the tier is not used afterwards."""
        return  # nothing to release for a local tier


class Backoff:
    """Skip a failing medium for a while, doubling the pause on each fault, so a dead Redis or a full
    disk costs nothing per step, and a recovered one is used again within `max_delay` seconds."""

    def __init__(self, initial_delay: float = 0.2, max_delay: float = 5.0) -> None:
        self.initial_delay, self.max_delay = initial_delay, max_delay
        self._delay = 0.0
        self._retry_at = 0.0
        self._lock = threading.Lock()

    def ready(self) -> bool:
        """Whether to try the medium now."""
        return time.monotonic() >= self._retry_at

    def failed(self) -> None:
        with self._lock:
            self._delay = min(self.max_delay, self._delay * 2 or self.initial_delay)
            self._retry_at = time.monotonic() + self._delay

    def succeeded(self) -> None:
        with self._lock:
            self._delay, self._retry_at = 0.0, 0.0
