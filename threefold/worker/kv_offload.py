"""The engine's side of the KV offload tiers: blocks <-> bytes, write-through, load-or-recompute,
prefetch, and swap-or-recompute preemption.

    schedule:  Scheduler ──fetch(hashes)──► KVOffload: store.lookup, cost model ─┬─ host memory: read now
                                                                                └─ disk/Redis: prefetch
               Scheduler ──poll_loads()──► prefetched reads that came in (their request is admitted)
               Scheduler ──preempt(blocks)──► swap (keep them in L2) or recompute, by cost
    execute:   runner ──swap_out(blocks)──► pool blocks → bytes → L2   (first: the step may reuse them)
               runner ──load(blocks_to_load)──► read bytes → pool blocks   (before the forward)
               runner ──store(blocks_to_store)──► pool blocks → bytes → store.put   (after the forward)

When blocks are stored: write-through, as each full block is published (after the forward that wrote
it), not on eviction. Persistence across restarts (L3) and sharing across instances (L4) need the data
below L1 while its owner is still alive; a demote-on-evict store would lose every block of a crashed
or restarted engine, and another instance could not see a prefix until the first evicted it. The
cost is one device-to-host copy per new block (one batched gather per step) and an async write,
which the store's writer keeps to 1% of wall time in CPU while steps run (the rest waits for idle
time, or is dropped and counted when its queue is full); the store dedupes blocks it already holds.

Load or recompute, per request: loading block i costs its bytes over its tier's measured bandwidth
plus our own copy into the pool; recomputing the prefix costs the step-cost model's time for those
tokens on top of the tokens computed anyway, and never less than a floor per token: the slope of a
short prefill measured once per loaded model at startup. (The step-cost model alone extrapolates from
the steps it has seen; an engine that has only run small steps, e.g. one whose prompts all came from
a tier, can see a zero slope and think a 2k-token prefill free.) The longest prefix whose loading
saves time as a whole is loaded. Blocks held in host memory are read inline; any block on disk or in Redis sends the
request to wait in WAITING_FOR_KV while background threads read them (core/external_kv.py).

Swap or recompute, per preempted request (vLLM only recomputes): its full computed blocks are already
written through, but L2 may have evicted some. Swapping keeps them all in L2 (refresh the held ones,
copy out the rest): out costs the missing bytes over our copy bandwidth, back in costs all the bytes
over L2's read bandwidth plus our copy; recomputing costs a forward over its computed tokens. Its
partial last block is always recomputed (fewer than block_size tokens, and it has no hash to find it
by). Either way it resumes through admission, which loads what the tiers still hold if that is cheaper.
"""

from __future__ import annotations

import math
import time
import weakref

import torch

from threefold.core.external_kv import ExternalHit
from threefold.kvstore import TieredKVStore
from threefold.kvstore.prefetch import Prefetcher, StagedBlock
from threefold.kvstore.stats import BandwidthMeter, EngineOffloadStats
from threefold.spec.adaptive import StepCostModel
from threefold.spec.train import causal_attention
from threefold.worker.kv_block_codec import BlockCodec

__all__ = ["BlockCodec", "KVOffload", "prefill_profile"]

COPY_BANDWIDTH_PRIOR = 2e9
"""Bytes/s assumed for our own pool <-> payload copies before the first is measured."""
PROFILE_TOKENS = (1, 128)
"""Forwards timed at startup: their slope is the recompute floor per token (a lower bound at long
contexts, where attention adds to it)."""
_profiles: weakref.WeakKeyDictionary[torch.nn.Module, dict[int, float]] = weakref.WeakKeyDictionary()


@torch.inference_mode()
def prefill_profile(model: torch.nn.Module) -> dict[int, float]:
    """Seconds of one forward of n fresh tokens for n in PROFILE_TOKENS (best of 2), measured once per
    loaded model (engines over the same weights share it)."""
    profile = _profiles.get(model)
    if profile is None:
        device = next(model.parameters()).device
        profile = {}
        for num_tokens in PROFILE_TOKENS:
            ids, positions = torch.zeros(num_tokens, dtype=torch.long, device=device), torch.arange(num_tokens,
                                                                                                 device=device)
            times = []
            for _ in range(2):
                start = time.perf_counter()
                model(ids, positions, causal_attention)
                times.append(time.perf_counter() - start)
            profile[num_tokens] = min(times)
        _profiles[model] = profile
    return profile


def token_seconds_floor(profile: dict[int, float]) -> float:
    """Seconds per token of the profile's prefill slope (0 if noise made it negative)."""
    (t0, s0), (t1, s1) = min(profile.items()), max(profile.items())
    return max(s1 - s0, 0.0) / (t1 - t0) if t1 > t0 else 0.0


class KVOffload:
    """The scheduler's ExternalKV and the runner's block I/O, over one TieredKVStore."""

    def __init__(self, store: TieredKVStore, codec: BlockCodec, block_size: int,
                 profile: dict[int, float] | None = None) -> None:
        self.store, self.codec, self.block_size = store, codec, block_size
        self.cost: StepCostModel | None = StepCostModel(profile) if profile else None
        """Measured forward time by tokens, seeded by the startup profile (None without one until the
        first step: loading is then assumed cheaper)."""
        self.token_seconds = token_seconds_floor(profile) if profile else 0.0
        """The floor under recomputing: at least this many seconds per token (the profile's slope)."""
        self.prefetch = Prefetcher(store, codec.payload_bytes)
        self.staged: dict[str, list[StagedBlock]] = {}
        """request id -> blocks read for it, not yet committed to a step's loads."""
        self.to_copy: dict[bytes, bytes] = {}
        """block hash -> payload, committed to this step's blocks_to_load."""
        self.copy_bandwidth = BandwidthMeter(COPY_BANDWIDTH_PRIOR)
        """Bytes/s of our own pool <-> payload copies (encode and decode_into), measured."""
        self.num_loaded = 0
        self.num_stored = 0
        self.store_seconds = 0.0
        """Engine-thread time spent writing blocks through (gather, encode, hand to the store)."""
        self.num_load_rejected = 0
        """Blocks the cost model chose to recompute although a tier held them."""
        self.counts = EngineOffloadStats()

    # ---- ExternalKV (the scheduler's calls) --------------------------------------
    def fetch(self, request_id: str, block_hashes: list[bytes], num_tokens_after: int) -> ExternalHit:
        staged = self.staged.get(request_id, [])
        if staged and [h for h, _, _ in staged] == block_hashes[: len(staged)]:
            return ExternalHit([tier for _, tier, _ in staged], True)  # a retry after no room: read already
        tiers = self._worth_loading(self.store.lookup(block_hashes), num_tokens_after)
        if not all(self.store.reads_inline(tier) for tier in tiers):
            return ExternalHit(tiers, False)
        staged = self.prefetch.read_prefix(block_hashes[: len(tiers)])
        if staged:
            self.staged[request_id] = staged
        return ExternalHit([tier for _, tier, _ in staged], True)

    def start_load(self, request_id: str, block_hashes: list[bytes]) -> None:
        self.prefetch.submit(request_id, block_hashes)

    def poll_loads(self) -> dict[str, list[str]]:
        arrived = {}
        for request_id, (blocks, num_wanted) in self.prefetch.finished().items():
            self.staged[request_id] = blocks
            arrived[request_id] = [tier for _, tier, _ in blocks]
            self.counts.prefetched_requests += 1
            self.counts.load_fallbacks += len(blocks) < num_wanted
        return arrived

    def wait_for_loads(self, timeout: float) -> None:
        self.prefetch.wait(timeout)

    def commit(self, request_id: str, num_blocks: int) -> None:
        for block_hash, _, payload in self.staged.pop(request_id, [])[:num_blocks]:
            self.to_copy[block_hash] = payload

    def release(self, request_id: str) -> None:
        self.staged.pop(request_id, None)
        self.prefetch.cancel(request_id)

    def preempt(self, request_id: str, blocks: list[tuple[int, bytes]], num_computed_tokens: int
                ) -> list[tuple[int, bytes]]:
        action, reason, held = self._swap_or_recompute(blocks, num_computed_tokens)
        key = (action, reason)
        self.counts.preemptions[key] = self.counts.preemptions.get(key, 0) + 1
        if action != "swap":
            return []
        self.counts.swapped_blocks += len(blocks)
        # Refresh what L2 holds now (it may still evict one before the copy-outs land: then that one is
        # recomputed or found below); copy out the rest before the step reuses their pool blocks.
        return [block for block, was_held in zip(blocks, held, strict=True)
                if not (was_held and self.store.hold(block[1]))]

    def _worth_loading(self, tiers: list[str], num_tokens_after: int) -> list[str]:
        """The longest prefix of `tiers` whose loading saves time over recomputing it (none if none saves).
        Judged on the whole prefix, not block by block: the step-cost model is a running maximum of noisy
        samples, flat wherever one slow step sits, so a stretch of blocks (first or last) can look free
        to recompute while the prefix as a whole costs seconds."""
        if (self.cost is None and not self.token_seconds) or not tiers:
            return tiers
        load_s, longest = 0.0, 0
        for i, tier in enumerate(tiers):
            load_s += self._read_seconds(tier, 1)
            if self._recompute_seconds(num_tokens_after, (i + 1) * self.block_size) > load_s:
                longest = i + 1
        self.num_load_rejected += len(tiers) - longest
        return tiers[:longest]

    def _recompute_seconds(self, num_after: int, num_tokens: int) -> float:
        """Computing `num_tokens` more in a step that computes `num_after` anyway: the step-cost model's
        difference, never below the per-token floor."""
        modelled = 0.0 if self.cost is None else self.cost(num_after + num_tokens) - self.cost(num_after)
        return max(modelled, num_tokens * self.token_seconds)

    def _read_seconds(self, tier: str, num_blocks: int) -> float:
        """Reading blocks from a tier and copying them into the pool."""
        num_bytes = num_blocks * self.codec.payload_bytes
        return num_bytes / max(self.store.bandwidth(tier), 1.0) + num_bytes / max(self.copy_bandwidth.value, 1.0)

    def _swap_or_recompute(self, blocks: list[tuple[int, bytes]], num_computed_tokens: int
                           ) -> tuple[str, str, list[bool]]:
        """(action, reason, whether L2 holds each block now) for a preempted request."""
        memory = self.store.memory_tier
        if memory is None:
            return "recompute", "no_l2", []
        if not blocks:
            return "recompute", "no_blocks", []
        if len(blocks) * self.codec.payload_bytes > memory.capacity_bytes:
            return "recompute", "too_large", []
        held = self.store.held_in_memory([h for _, h in blocks])
        out_s = (len(blocks) - sum(held)) * self.codec.payload_bytes / max(self.copy_bandwidth.value, 1.0)
        swap_s = out_s + self._read_seconds(memory.name, len(blocks))
        if self.cost is None and not self.token_seconds:
            recompute_s = math.inf
        else:
            recompute_s = max(self.cost(num_computed_tokens) if self.cost is not None else 0.0,
                              num_computed_tokens * self.token_seconds)
        return ("swap" if swap_s < recompute_s else "recompute"), "cheaper", held

    # ---- the runner's calls ------------------------------------------------------
    def swap_out(self, blocks: list[tuple[int, bytes]]) -> None:
        """Copy preempted requests' blocks to L2 (first in the step: their pool blocks may be reused)."""
        if not blocks:
            return
        start = time.perf_counter()
        payloads = self.codec.encode([b for b, _ in blocks])
        self.copy_bandwidth.observe(len(blocks) * self.codec.payload_bytes, time.perf_counter() - start)
        for (_, block_hash), payload in zip(blocks, payloads, strict=True):
            self.store.hold(block_hash, payload)

    def load(self, blocks: list[tuple[int, bytes]], step_runs: bool = True) -> None:
        """Fill this step's loads' pool blocks from the committed payloads (before the forward, which
        runs if `step_runs`: then the store's writer keeps to its CPU share until it ends)."""
        if step_runs:
            self.store.engine_step(running=True)
        if blocks:
            start = time.perf_counter()
            self.codec.decode([b for b, _ in blocks], [self.to_copy[h] for _, h in blocks])
            self.copy_bandwidth.observe(len(blocks) * self.codec.payload_bytes, time.perf_counter() - start)
            self.num_loaded += len(blocks)
        self.to_copy.clear()

    def store_blocks(self, blocks: list[tuple[int, bytes]]) -> None:
        """Write-through of the blocks published this step (after the forward wrote them)."""
        if not blocks:
            return
        start = time.perf_counter()
        payloads = self.codec.encode([b for b, _ in blocks])
        self.copy_bandwidth.observe(len(blocks) * self.codec.payload_bytes, time.perf_counter() - start)
        for (_, block_hash), payload in zip(blocks, payloads, strict=True):
            self.store.put(block_hash, payload)
        self.num_stored += len(blocks)
        self.store_seconds += time.perf_counter() - start

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.store.engine_step(running=False)
        if self.cost is None:
            self.cost = StepCostModel({num_tokens: seconds})
        else:
            self.cost.observe(num_tokens, seconds)

    def engine_stats(self) -> EngineOffloadStats:
        """A snapshot for /metrics (read from the server's thread)."""
        counts = self.counts
        return EngineOffloadStats(dict(counts.preemptions), counts.swapped_blocks, self.prefetch.num_pending,
                                  counts.prefetched_requests, counts.load_fallbacks)

    def close(self) -> None:
        self.prefetch.close()
        self.store.close()
