"""TieredKVStore: the engine's KV blocks below its pool, in host memory (L2), on disk (L3) and in Redis (L4).

    engine ──put(hash, payload)──► L2 now ──queue──► writer thread ──► L3, L4   (write-through)
    engine ──lookup(hashes)──────► ["cpu", "disk", "redis", ...]  tier of each block of the hit prefix
    engine ──get_prefix(hashes)──► the verified blocks of the hit prefix, each from the first tier holding
                                   it (batched: one read per tier and READ_CHUNK blocks); promoted above

Write-through, not demote-on-evict: every block put reaches L3 and L4 right away (off the engine's
thread), so a restarted engine finds it on disk and another instance finds it in Redis without waiting
for L2 to evict it. L2 evicting a block then just drops it: the copy below is already there, or still
in the writer's queue: a queued block is read from there (a write buffer), counted as a hit of the tier
it is queued for, so a block L2 dropped before the writer reached it is not lost to this process.

The writer keeps to a CPU budget while the engine is busy: on 2 cores every CPU-second it spends is
taken from the engine's compute threads (and costs them about twice that: the other thread of an
OpenMP region waits for it at the barrier). So while steps run it writes only as its backlog demands:
nothing while the queue holds under BACKLOG_FREE of MAX_PENDING_BYTES (the idle gaps drain it), then a
CPU share of wall time that rises in proportion to the backlog, up to `backlog_share` at a full queue
(a token bucket refilled at that share, holding at most WRITER_BURST_S); once no step has run for
IDLE_AFTER_S it writes unthrottled. A put beyond a full queue is dropped and counted
(`dropped_writes`): only traffic that outruns the writer at its highest share, with no idle time,
leaves the tiers below L2 with a sample of the blocks; any idle gap, `flush` and `close` (a graceful
shutdown) write the queue out. Durability: a block is in L3/L4 once its queued write ran;
what was queued at a crash is lost (recomputed if needed).

Payloads are opaque bytes (the engine's encoded KV block); this package never imports torch. Keys are
namespaced (keys.py), records framed and checksummed (frame.py); tier faults are counted, never raised.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque

from threefold.kvstore.config import OffloadConfig
from threefold.kvstore.disk import DiskTier
from threefold.kvstore.frame import FrameError, RecordBuffer, decode
from threefold.kvstore.keys import Namespace
from threefold.kvstore.malloc import keep_heap_mapped
from threefold.kvstore.memory import MemoryTier
from threefold.kvstore.stats import StatsBook, StoreStats
from threefold.kvstore.tier import Tier, TierFault

logger = logging.getLogger(__name__)

READ_CHUNK = 32
"""Blocks per batched read (a Redis MGET of SmolLM2's fp32 blocks: 23 MiB, one round trip instead of 32)."""
MAX_PENDING_BYTES = 256 << 20
"""Bytes queued for the writer at most; beyond it a put is dropped and counted (an engine step never waits)."""
WRITER_CPU_SHARE = 0.0
"""The writer's CPU time as a share of wall time while the engine is busy and its backlog short (idle:
unlimited). 0: a 1% share cost 2.5-3.7% of throughput on 2 cores with no reuse (BENCHMARKS.md, KV tiers)."""
BACKLOG_FREE = 0.25
"""The share of MAX_PENDING_BYTES the queue may hold before the writer writes while steps run."""
WRITER_BACKLOG_SHARE = 0.5
"""The writer's CPU share while the engine is busy and its queue is full; in proportion from BACKLOG_FREE
up. A steady producer settles the queue where this share keeps up with it, before it drops."""
WRITER_BURST_S = 0.01
"""CPU seconds of writes the writer may bank while within its share (a burst after a quiet stretch): about
ten O_DIRECT disk blocks. Small on purpose: the bank is full whenever a busy stretch starts after an idle
one, and on 2 cores a 50 ms burst alone was 2.5% of a 2-second burst of traffic."""
IDLE_AFTER_S = 0.05
"""The engine counts as idle once no step has run for this long."""


def build_tiers(config: OffloadConfig) -> list[Tier]:
    """The configured tiers, fastest first."""
    tiers: list[Tier] = []
    if config.cpu_bytes > 0:
        tiers.append(MemoryTier(config.cpu_bytes))
    if config.disk_dir is not None:
        tiers.append(DiskTier(config.disk_dir, config.disk_bytes))
    if config.redis_url is not None:
        from threefold.kvstore.redis_tier import RedisTier  # the client library is only needed for L4

        tiers.append(RedisTier(config.redis_url))
    return tiers


class TieredKVStore:
    """Blocks by chained block hash, in every configured tier. Thread-safe: the engine calls put, lookup
    and get from its thread while one writer thread fills the slower tiers."""

    def __init__(self, config: OffloadConfig, namespace: Namespace, tiers: list[Tier] | None = None,
                 max_pending_bytes: int = MAX_PENDING_BYTES, writer_cpu_share: float = WRITER_CPU_SHARE,
                 backlog_share: float = WRITER_BACKLOG_SHARE) -> None:
        self.config, self.namespace = config, namespace
        keep_heap_mapped()  # every block's payload is allocated here and freed by the writer (malloc.py)
        self.tiers = build_tiers(config) if tiers is None else tiers
        first = self.tiers[0] if self.tiers else None
        self._memory = first if isinstance(first, MemoryTier) else None
        self._by_name = {tier.name: tier for tier in self.tiers}
        self._book = StatsBook([tier.name for tier in self.tiers])
        self._max_pending_bytes = max_pending_bytes
        self.read_chunk = READ_CHUNK
        """Blocks per batched read (1 reads block by block: what a benchmark compares against)."""
        self._queue: deque[tuple[bytes, bytes, list[Tier]]] = deque()
        self._queued: dict[bytes, tuple[bytes, set[str], int]] = {}
        """key -> (payload, the tiers it is queued for, times queued): the queue as a write buffer."""
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._closed = False
        self.writer_cpu_share = writer_cpu_share
        """CPU share of wall time the writer may spend while the engine is busy (1.0: no limit)."""
        self.backlog_share = backlog_share
        """The share it may rise to as its queue fills (the larger of the two applies)."""
        self._step_running = False
        self._busy_at = -math.inf  # monotonic time the engine last started or ended a step
        self._credit, self._refilled = WRITER_BURST_S, time.monotonic()
        self._record_buffer = RecordBuffer()  # the writer thread's: each block framed once, for every tier
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload-writer", daemon=True)
        self._writer.start()

    # ---- the engine's calls --------------------------------------------------

    def put(self, block_hash: bytes, payload: bytes) -> None:
        """Offload one block. L2 takes it at once; the slower tiers get it from the writer thread. Never
        blocks: with the writer's queue full, the block is dropped (counted) and the engine recomputes it
        if it is ever needed again."""
        if not isinstance(payload, bytes):
            payload = bytes(payload)  # L2 and the queue keep it: a reused buffer must not change under them
        key = self.namespace.key(block_hash)
        below = self.tiers
        if self._memory is not None:
            if self._memory.refresh_if_settled(key):
                return  # L2 holds it and every tier below has it: spare them the same bytes again
            self._put_one(self._memory, key, payload, None)
            below = self.tiers[1:]
        if below:
            self._enqueue(key, payload, below)

    def engine_step(self, running: bool) -> None:
        """The engine starts (True) or ends (False) a step: while a step runs and until IDLE_AFTER_S
        after the last one, the writer keeps to its CPU share."""
        self._step_running = running
        self._busy_at = time.monotonic()

    def lookup(self, block_hashes: list[bytes]) -> list[str]:
        """The tier holding each block of the longest stored prefix of `block_hashes`, stopping at the
        first block that no tier holds. A hint: the block may still be evicted or found corrupt before
        `get`, which then returns None and the engine recomputes from there."""
        keys = [self.namespace.key(h) for h in block_hashes]
        found: list[str | None] = [None] * len(keys)
        for tier in self.tiers:
            todo = [i for i, name in enumerate(found) if name is None]  # one round trip for a remote tier
            if not todo or not tier.available():
                continue
            try:
                present = tier.contains_many([keys[i] for i in todo])
            except TierFault as fault:
                self._book.fault(tier.name, fault.kind)
                continue
            for i, hit in zip(todo, present, strict=True):
                if hit:
                    found[i] = tier.name
        for i, name in enumerate(found):
            if name is None:
                found[i] = self._queued_for(keys[i])
        prefix = []
        for name in found:
            if name is None:
                break
            prefix.append(name)
        return prefix

    def get(self, block_hash: bytes) -> tuple[str, bytes] | None:
        """(tier name, verified payload) from the fastest tier holding the block, or None. A corrupt copy
        is deleted and counted, and the next tier is tried. A hit is promoted to the tiers above."""
        return self._get_chunk([block_hash])[0]

    def get_prefix(self, block_hashes: list[bytes]) -> list[tuple[str, bytes]]:
        """(tier name, verified payload) of each block of the longest prefix the tiers can serve, read
        `read_chunk` blocks at a time with one batched read per tier. A block that no tier holds intact
        (missing, failed, corrupt: as in `get`) ends the prefix; the chunks after it are not read."""
        found: list[tuple[str, bytes]] = []
        for start in range(0, len(block_hashes), self.read_chunk):
            for got in self._get_chunk(block_hashes[start:start + self.read_chunk]):
                if got is None:
                    return found
                found.append(got)
        return found

    def bandwidth(self, tier: str) -> float:
        """Measured read bytes/s of a tier (EMA of real reads; a prior before any): the engine's
        load-or-recompute cost model weighs a block's bytes by this. It times the store's part (read,
        checksum, copy out); L2's is a dictionary lookup, so the engine adds its own copy into the pool."""
        return self._book.bandwidth(tier)

    def set_bandwidth(self, tier: str, bytes_per_second: float) -> None:
        """Replace a tier's bandwidth estimate (an operator who knows the link, a test); later reads
        move it as before."""
        self._book.set_bandwidth(tier, bytes_per_second)

    def reads_inline(self, tier: str) -> bool:
        """Whether reading from `tier` is in-process (host memory): cheap enough to do in the step."""
        return not self._by_name[tier].io_reads

    @property
    def memory_tier(self) -> MemoryTier | None:
        """L2, the host-memory tier, or None (then preemption cannot swap)."""
        return self._memory

    def held_in_memory(self, block_hashes: list[bytes]) -> list[bool]:
        """Whether L2 holds each block (all False without L2)."""
        if self._memory is None:
            return [False] * len(block_hashes)
        return self._memory.contains_many([self.namespace.key(h) for h in block_hashes])

    def hold(self, block_hash: bytes, payload: bytes | None = None) -> bool:
        """Keep a block in L2, most recent first, for a swapped-out request's resume: refresh it if held,
        else store `payload` there (L2 only: the tiers below were written through when it filled).
        False without L2, or when it is neither held nor given."""
        if self._memory is None:
            return False
        key = self.namespace.key(block_hash)
        if self._memory.touch(key):
            return True
        return payload is not None and self._put_one(self._memory, key, payload, None)

    def stats(self) -> StoreStats:
        sizes = {tier.name: (tier.used_bytes, tier.capacity_bytes) for tier in self.tiers}
        with self._cond:
            pending = len(self._queue)
        return self._book.snapshot(sizes, pending)

    def check_integrity(self) -> list[str]:
        """Problems with the tiers' own accounting (empty when sound): what the engine's leak tests and a
        debugging operator ask. A tier without a local index (Redis) has nothing to check."""
        return [f"{tier.name}: {problem}" for tier in self.tiers for problem in tier.check_integrity()]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the writer has written everything queued; False if `timeout` ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._pending_bytes == 0, timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        """Finish queued writes (up to `timeout`), stop the writer and release the tiers. Idempotent."""
        if self._closed:
            return
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._writer.join(timeout)
        for tier in self.tiers:
            tier.close()

    def __enter__(self) -> TieredKVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers ----------------------------------------------------------------

    def _get_chunk(self, block_hashes: list[bytes]) -> list[tuple[str, bytes] | None]:
        """Each block from the fastest tier holding a verified copy (one batched read per tier, asking
        only for what the tiers above lacked), promoted to the tiers above; None where none does."""
        keys = [self.namespace.key(h) for h in block_hashes]
        got: list[tuple[str, bytes] | None] = [None] * len(keys)
        for depth, tier in enumerate(self.tiers):
            todo = [i for i, found in enumerate(got) if found is None]
            if not todo:
                break
            start = time.perf_counter()
            payloads = self._get_many(tier, [keys[i] for i in todo])
            payloads = [self._queued_payload(keys[i], tier.name) if payload is None else payload
                        for i, payload in zip(todo, payloads, strict=True)]
            hits = [(i, payload) for i, payload in zip(todo, payloads, strict=True) if payload is not None]
            if hits:
                self._book.hit(tier.name, sum(len(p) for _, p in hits), time.perf_counter() - start, len(hits))
            if len(hits) < len(todo):
                self._book.miss(tier.name, len(todo) - len(hits))
            for i, payload in hits:
                got[i] = (tier.name, payload)
                self._promote(keys[i], payload, self.tiers[:depth])
        return got

    def _get_many(self, tier: Tier, keys: list[bytes]) -> list[bytes | None]:
        """Verified payloads from one tier (None: missing, failed or corrupt; faults counted)."""
        if not tier.available():
            self._book.fault(tier.name, "skipped")
            return [None] * len(keys)
        try:
            records = tier.get_many(keys)
        except TierFault as fault:
            self._book.fault(tier.name, fault.kind)
            records = fault.partial + [None] * (len(keys) - len(fault.partial))
        if not tier.framed:
            return records
        return [None if record is None else self._verified(tier, key, record)
                for key, record in zip(keys, records, strict=True)]

    def _verified(self, tier: Tier, key: bytes, record: bytes | FrameError) -> bytes | None:
        """The payload of a sound record; None (counted, the block deleted) for a bad one, or one the
        tier itself found bad (a disk slot whose header does not name it: Tier.get_many)."""
        try:
            if isinstance(record, FrameError):
                raise record
            return decode(record, self.namespace.digest, self.namespace.format_version)
        except FrameError as bad:
            logger.warning("KV offload %s tier: dropping a bad block (%s)", tier.name, bad)
            self._book.fault(tier.name, bad.reason)
            self._delete_one(tier, key)
            return None

    def _delete_one(self, tier: Tier, key: bytes) -> None:
        try:
            tier.delete(key)
        except TierFault as fault:
            self._book.fault(tier.name, fault.kind)

    def _promote(self, key: bytes, payload: bytes, above: list[Tier]) -> None:
        if above and above[0] is self._memory:
            self._put_one(self._memory, key, payload, None)
            above = above[1:]
        if above:
            self._enqueue(key, payload, above)

    def _put_one(self, tier: Tier, key: bytes, payload: bytes, record: memoryview | None) -> bool:
        """Write one block to one tier (the payload, or the framed record in the writer's buffer);
        False (counted) on a fault."""
        try:
            if not tier.framed:
                written, size = tier.put(key, payload), len(payload)
            else:
                assert record is not None
                written, size = tier.put_record(key, record, self._record_buffer), len(record)
        except TierFault as fault:
            self._book.fault(tier.name, fault.kind)
            return False
        if written:
            self._book.wrote(tier.name, size)
        return True

    def _enqueue(self, key: bytes, payload: bytes, targets: list[Tier]) -> None:
        with self._cond:
            if self._closed or self._pending_bytes + len(payload) > self._max_pending_bytes:
                self._book.dropped()
                return
            self._queue.append((key, payload, targets))
            _, names, times = self._queued.get(key, (payload, set(), 0))
            self._queued[key] = (payload, names | {tier.name for tier in targets}, times + 1)
            self._pending_bytes += len(payload)
            self._cond.notify_all()

    def _queued_for(self, key: bytes) -> str | None:
        """The first tier (in tier order) a queued block is waiting to be written to, or None."""
        with self._cond:
            entry = self._queued.get(key)
        if entry is None:
            return None
        return next((tier.name for tier in self.tiers if tier.name in entry[1]), None)

    def _queued_payload(self, key: bytes, tier: str) -> bytes | None:
        """The payload of a block queued for `tier` and not yet written there, or None."""
        with self._cond:
            entry = self._queued.get(key)
        return entry[0] if entry is not None and tier in entry[1] else None

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed and drained
                key, payload, targets = self._queue[0]
            charged = self._wait_for_budget()
            cpu_start = time.thread_time()
            try:
                record = self._record_buffer.pack(payload, self.namespace.digest, self.namespace.format_version)
                stored = [self._put_one(tier, key, payload, record) for tier in targets]
                if self._memory is not None and all(stored) and len(targets) == len(self.tiers) - 1:
                    self._memory.settle(key)  # a fault below leaves it unsettled: the next put retries
            except Exception:  # a bug must not kill the writer: flush() would then wait forever
                logger.exception("KV offload writer: unexpected error; block not offloaded")
                self._book.fault(targets[0].name, "internal")
            spent = time.thread_time() - cpu_start
            self._book.writer_busy(spent)
            if charged:
                self._credit -= spent
            with self._cond:
                self._queue.popleft()  # only now: flush() waits for the write, not just the dequeue
                self._pending_bytes -= len(payload)
                _, names, times = self._queued[key]
                if times == 1:
                    del self._queued[key]
                else:
                    self._queued[key] = (payload, names, times - 1)
                self._cond.notify_all()

    def _wait_for_budget(self) -> bool:
        """Wait until the writer may write: at once while the engine is idle or the store closing (the
        write is then not charged: False), else once the bucket holds credit (True: charge it)."""
        while True:
            now, share = time.monotonic(), self.busy_share()
            self._credit = min(WRITER_BURST_S, self._credit + (now - self._refilled) * share)
            self._refilled = now
            idle = not self._step_running and now - self._busy_at >= IDLE_AFTER_S
            if self._closed or idle or share >= 1.0:
                return False
            if self._credit > 0:
                return True
            wait = -self._credit / share if share > 0 else math.inf
            with self._cond:  # woken early by a put (the backlog grew) or close(); idleness within IDLE_AFTER_S
                self._cond.wait(min(wait, IDLE_AFTER_S))

    def busy_share(self) -> float:
        """The writer's CPU share of wall time while the engine is busy, for its backlog now: its base
        share, or more as the queue fills past BACKLOG_FREE, rising linearly to `backlog_share` when full."""
        fill = self._pending_bytes / self._max_pending_bytes if self._max_pending_bytes > 0 else 1.0
        rise = min(1.0, max(0.0, (fill - BACKLOG_FREE) / (1.0 - BACKLOG_FREE)))
        return max(self.writer_cpu_share, self.backlog_share * rise)
