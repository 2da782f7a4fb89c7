"""Counters of the tiered store, one set per tier, and each tier's measured read bandwidth."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

BANDWIDTH_PRIOR = {"cpu": 8e9, "disk": 1e9, "redis": 3e8}
"""Bytes/s assumed before the first real read (host memcpy, an NVMe SSD, loopback Redis): the
load-or-recompute cost model must start somewhere sane; real reads replace it quickly."""
BANDWIDTH_EMA = 0.2
MIN_SAMPLE_BYTES = 4096
"""Smaller reads measure call overhead, not bandwidth."""


@dataclass
class TierStats:
    """Cumulative counters of one tier (a snapshot when returned by TieredKVStore.stats())."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    load_seconds: float = 0.0
    """Wall time of hits: the read, the checksum and the copy."""
    faults: dict[str, int] = field(default_factory=dict)
    """Counted faults by kind: unavailable, timeout, disk_full, read_only, read, write (the medium), and
    corrupt records by what was wrong: checksum, truncated, bad_magic, version, namespace."""
    skipped: int = 0
    """Calls not tried because the tier was backing off after a fault."""
    used_bytes: int | None = 0
    capacity_bytes: int | None = 0
    bandwidth: float = 0.0
    """Measured read bytes/s (EMA), or the prior before any read."""


@dataclass
class StoreStats:
    tiers: dict[str, TierStats]
    """In order: "cpu", "disk", "redis" (those configured)."""
    dropped_writes: int = 0
    """Blocks not offloaded because the writer's queue was full (never blocks an engine step)."""
    pending_writes: int = 0
    writer_cpu_seconds: float = 0.0
    """CPU time the writer thread spent framing and writing blocks (what write-through costs the cores)."""


class StatsBook:
    """The live counters; updated from the engine thread and the writer thread under one lock."""

    def __init__(self, tier_names: list[str]) -> None:
        self._lock = threading.Lock()
        self._tiers = {name: TierStats(bandwidth=BANDWIDTH_PRIOR.get(name, 1e9)) for name in tier_names}
        self.dropped_writes = 0
        self.writer_cpu_seconds = 0.0

    def hit(self, tier: str, num_bytes: int, seconds: float, count: int = 1) -> None:
        """`count` blocks of `num_bytes` in all, read in `seconds` (one batched read)."""
        with self._lock:
            stats = self._tiers[tier]
            stats.hits += count
            stats.bytes_read += num_bytes
            stats.load_seconds += seconds
            if num_bytes >= MIN_SAMPLE_BYTES and seconds > 0:
                stats.bandwidth += BANDWIDTH_EMA * (num_bytes / seconds - stats.bandwidth)

    def miss(self, tier: str, count: int = 1) -> None:
        with self._lock:
            self._tiers[tier].misses += count

    def wrote(self, tier: str, num_bytes: int) -> None:
        with self._lock:
            self._tiers[tier].writes += 1
            self._tiers[tier].bytes_written += num_bytes

    def fault(self, tier: str, kind: str) -> None:
        with self._lock:
            stats = self._tiers[tier]
            if kind == "skipped":
                stats.skipped += 1
            else:
                stats.faults[kind] = stats.faults.get(kind, 0) + 1

    def dropped(self) -> None:
        with self._lock:
            self.dropped_writes += 1

    def writer_busy(self, cpu_seconds: float) -> None:
        with self._lock:
            self.writer_cpu_seconds += cpu_seconds

    def set_bandwidth(self, tier: str, bytes_per_second: float) -> None:
        with self._lock:
            self._tiers[tier].bandwidth = bytes_per_second

    def bandwidth(self, tier: str) -> float:
        with self._lock:
            return self._tiers[tier].bandwidth

    def snapshot(self, sizes: dict[str, tuple[int | None, int | None]], pending: int) -> StoreStats:
        with self._lock:
            tiers = {name: replace(s, faults=dict(s.faults), used_bytes=sizes[name][0],
                                   capacity_bytes=sizes[name][1]) for name, s in self._tiers.items()}
            return StoreStats(tiers, self.dropped_writes, pending, self.writer_cpu_seconds)


class BandwidthMeter:
    """Bytes/s of a repeated copy, as an EMA of measured ones (the engine's pool <-> payload copies)."""

    def __init__(self, prior: float) -> None:
        self.value = prior

    def observe(self, num_bytes: int, seconds: float) -> None:
        if num_bytes >= MIN_SAMPLE_BYTES and seconds > 0:
            self.value += BANDWIDTH_EMA * (num_bytes / seconds - self.value)


@dataclass
class EngineOffloadStats:
    """The engine's side of the tiers: prefetches, and what preemption chose (a snapshot)."""

    preemptions: dict[tuple[str, str], int] = field(default_factory=dict)
    """(action, reason) -> preempted requests. action: swap | recompute; reason: cheaper (the cost rule
    chose it), no_l2 (no host-memory tier), no_blocks (no full computed block to keep), too_large (more
    than L2 holds)."""
    swapped_blocks: int = 0
    """Blocks kept in L2 for preempted requests (copied out, or already there and refreshed)."""
    loading_requests: int = 0
    """Requests waiting for their prefix to be read from a tier now."""
    prefetched_requests: int = 0
    """Requests whose prefix was read in the background (finished loads)."""
    load_fallbacks: int = 0
    """Of those, loads that brought fewer blocks than planned (a failed, evicted or corrupt block):
    the rest was recomputed."""
