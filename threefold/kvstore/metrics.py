"""The tiered store's counters as Prometheus samples, `threefold:kv_offload_*{tier=...}`.

A pure function of `TieredKVStore.stats()` (and of the engine's prefetch and preemption counters),
plus a collector that calls them at scrape time, so the server registers it once and nothing is pushed
from the engine thread:

    registry.register(KVOffloadCollector(store.stats, model_name, block_size, offload.engine_stats))

Counters keep prometheus' `_total` suffix, as the server's vLLM-named ones do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from threefold.kvstore.stats import EngineOffloadStats, StoreStats, TierStats

PREFIX = "threefold:kv_offload_"

# (name, help, what it reads from TierStats): one counter per tier each
_TIER_COUNTERS: tuple[tuple[str, str, Callable[[TierStats], float]], ...] = (
    ("hits", "Blocks loaded from the tier.", lambda s: s.hits),
    ("misses", "Block reads the tier could not serve.", lambda s: s.misses),
    ("read_bytes", "Bytes loaded from the tier.", lambda s: s.bytes_read),
    ("written_bytes", "Bytes written to the tier (framed records below L2).", lambda s: s.bytes_written),
    ("writes", "Blocks written to the tier.", lambda s: s.writes),
    ("load_seconds", "Seconds spent loading hits from the tier.", lambda s: s.load_seconds),
    ("skipped", "Calls not tried while the tier backed off after a fault.", lambda s: s.skipped),
)


def metric_families(stats: StoreStats, model_name: str, block_size: int) -> list[Metric]:
    """Every sample of one stats snapshot."""
    labels = ["model_name", "tier"]
    families: list[Metric] = []
    for name, doc, read in _TIER_COUNTERS:
        family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
        for tier, tier_stats in stats.tiers.items():
            family.add_metric([model_name, tier], read(tier_stats))
        families.append(family)
    saved = CounterMetricFamily(PREFIX + "hit_tokens", "Tokens loaded from the tier instead of recomputed.",
                                labels=labels)
    faults = CounterMetricFamily(PREFIX + "faults", "Tier faults by kind (the request was served anyway).",
                                 labels=[*labels, "kind"])
    used = GaugeMetricFamily(PREFIX + "used_bytes", "Bytes the tier holds (not reported for Redis).", labels=labels)
    capacity = GaugeMetricFamily(PREFIX + "capacity_bytes", "The tier's size limit.", labels=labels)
    bandwidth = GaugeMetricFamily(PREFIX + "read_bandwidth_bytes_per_second",
                                  "Measured read bandwidth (EMA), which the load-or-recompute choice uses.",
                                  labels=labels)
    for tier, tier_stats in stats.tiers.items():
        saved.add_metric([model_name, tier], tier_stats.hits * block_size)
        for kind, count in sorted(tier_stats.faults.items()):
            faults.add_metric([model_name, tier, kind], count)
        if tier_stats.used_bytes is not None:
            used.add_metric([model_name, tier], tier_stats.used_bytes)
        if tier_stats.capacity_bytes is not None:
            capacity.add_metric([model_name, tier], tier_stats.capacity_bytes)
        bandwidth.add_metric([model_name, tier], tier_stats.bandwidth)
    dropped = CounterMetricFamily(PREFIX + "dropped_writes",
                                  "Blocks not offloaded because the writer's queue was full.", labels=["model_name"])
    dropped.add_metric([model_name], stats.dropped_writes)
    pending = GaugeMetricFamily(PREFIX + "pending_writes", "Blocks queued for the writer thread.",
                                labels=["model_name"])
    pending.add_metric([model_name], stats.pending_writes)
    return [*families, saved, faults, used, capacity, bandwidth, dropped, pending]


def engine_families(stats: EngineOffloadStats, model_name: str) -> list[Metric]:
    """Preemptions by what they chose and why, swapped blocks, and the background loads."""
    preemptions = CounterMetricFamily(PREFIX + "preemptions", "Preempted requests by action (swap to host "
                                      "memory or recompute) and reason.", labels=["model_name", "action", "reason"])
    for (action, reason), count in sorted(stats.preemptions.items()):
        preemptions.add_metric([model_name, action, reason], count)
    families: list[Metric] = [preemptions]
    for name, doc, value, kind in (
            ("swapped_blocks", "Blocks kept in host memory for preempted requests.", stats.swapped_blocks,
             CounterMetricFamily),
            ("loading_requests", "Requests waiting for their prefix to be read from a tier.",
             stats.loading_requests, GaugeMetricFamily),
            ("prefetched_requests", "Requests whose prefix was read in the background.",
             stats.prefetched_requests, CounterMetricFamily),
            ("load_fallbacks", "Background loads that brought fewer blocks than planned (rest recomputed).",
             stats.load_fallbacks, CounterMetricFamily)):
        family = kind(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([model_name], value)
        families.append(family)
    return families


class KVOffloadCollector:
    """A prometheus_client collector reading the store's stats at each scrape."""

    def __init__(self, stats: Callable[[], StoreStats], model_name: str, block_size: int,
                 engine_stats: Callable[[], EngineOffloadStats] | None = None) -> None:
        self._stats, self._model_name, self._block_size = stats, model_name, block_size
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        yield from metric_families(self._stats(), self._model_name, self._block_size)
        if self._engine_stats is not None:
            yield from engine_families(self._engine_stats(), self._model_name)
