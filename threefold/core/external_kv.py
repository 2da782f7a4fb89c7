"""External KV: the scheduler's view of the KV offload store (plain Python; the engine implements it).

On admission the scheduler offers the request's block hashes past its local prefix hit; the store side
decides the longest prefix worth loading (its tiers' bandwidth against the recompute time) and says from
which tier each block comes. Blocks in host memory are read at once and loaded with this very step.
Blocks on disk or in Redis are prefetched: the request holds the L1 blocks they go into and waits in
WAITING_FOR_KV while a background thread reads them and the steps run other requests; when the reads are
in, the next schedule() loads them and the request is admitted with them counted as computed.

    waiting ──fetch: ready──────────────────────────────► running   (blocks_to_load this step)
    waiting ──fetch: not ready──► loading ──poll_loads──► waiting, blocks held ──► running
                                     │                     (blocks_to_load the step it arrives)
                                  abort: blocks freed, the read's result dropped

A read that fails or returns a corrupt block ends the loaded prefix there: the rest is recomputed, the
request never fails for it. Preempting a request asks `preempt` whether to keep its blocks in host
memory (swap) or let them go (recompute); either way it resumes through the same admission path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from threefold.core.block_pool import KVCacheBlock
from threefold.core.kv_cache_manager import KVCacheManager
from threefold.core.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class ExternalHit(NamedTuple):
    tiers: list[str]
    """The tier of each block worth loading, in order (empty: recompute them all)."""
    ready: bool
    """True: read already, so loaded with this step; False: to prefetch with start_load first."""


NO_HIT = ExternalHit([], True)


class ExternalKV(Protocol):
    def fetch(self, request_id: str, block_hashes: list[bytes], num_tokens_after: int) -> ExternalHit:
        """The longest prefix of `block_hashes` worth loading. `num_tokens_after`: tokens the request
        computes past these blocks anyway (for the cost model)."""
        ...

    def start_load(self, request_id: str, block_hashes: list[bytes]) -> None:
        """Read these blocks (a fetch that was not ready) in the background."""
        ...

    def poll_loads(self) -> dict[str, list[str]]:
        """Loads finished since the last poll: request id -> the tier each leading block that arrived
        intact came from (fewer than asked: the rest is recomputed)."""
        ...

    def wait_for_loads(self, timeout: float) -> None:
        """Block until a load finishes or `timeout` seconds pass (the engine idles here, not in a spin)."""
        ...

    def commit(self, request_id: str, num_blocks: int) -> None:
        """The request's first `num_blocks` read blocks are in this step's blocks_to_load."""
        ...

    def release(self, request_id: str) -> None:
        """Drop what was read or is being read for a request that will not load it."""
        ...

    def preempt(self, request_id: str, blocks: list[tuple[int, bytes]], num_computed_tokens: int
                ) -> list[tuple[int, bytes]]:
        """A running request is preempted holding these full computed (block_id, hash) blocks: swap them
        to host memory or recompute them, whichever costs less. The blocks the runner must copy out
        before this step reuses them (empty when recomputing or when host memory holds them all)."""
        ...


def tokens_by_tier(num_local_tokens: int, tiers: list[str], block_size: int) -> dict[str, int]:
    """num_cached_tokens by source: "pool" (the L1 prefix hit), then a block per tier entry."""
    counts = {"pool": num_local_tokens} if num_local_tokens else {}
    for tier in tiers:
        counts[tier] = counts.get(tier, 0) + block_size
    return counts


@dataclass
class PendingLoad:
    """A request in WAITING_FOR_KV: what it holds and what is being read for it."""

    request: Request
    num_local_tokens: int
    """Its L1 prefix hit."""
    block_ids: list[int]
    """The L1 blocks the read blocks go into, in order (allocated, not yet published)."""
    block_hashes: list[bytes]
    resumed: bool
    """It was preempted before: admitted as a resumed request."""


class ExternalLoads:
    """The scheduler's bookkeeping of prefetched prefixes, beside it so schedule() stays the policy.

    Every block stays in the KVCacheManager's accounting: a loading request holds its L1 hit and the
    blocks its reads go into (unpublished, so no other request can hit unfilled KV); a loaded one holds
    them, published, until it is admitted or finishes.
    """

    def __init__(self, external: ExternalKV, kv: KVCacheManager) -> None:
        self.external, self.kv = external, kv
        self.loading: dict[str, PendingLoad] = {}
        self.loaded: dict[str, dict[str, int]] = {}
        """Waiting requests holding the blocks their load filled -> num_cached_tokens by source."""

    def fetch(self, request: Request, num_local_blocks: int) -> ExternalHit:
        """The blocks worth loading from the tiers past the local hit. The last token always stays to
        compute (its logits are needed); prompt logprobs need every position computed."""
        if not self.kv.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return NO_HIT
        max_blocks = (request.num_tokens - 1) // self.kv.block_size
        hashes = request.block_hashes[num_local_blocks:max_blocks]
        if not hashes:
            return NO_HIT
        num_after = request.num_tokens - (num_local_blocks + len(hashes)) * self.kv.block_size
        return self.external.fetch(request.request_id, hashes, num_after)

    def start(self, request: Request, computed_blocks: list[KVCacheBlock], num_hit: int, tiers: list[str]) -> bool:
        """Hold the blocks and start the reads; False (nothing changed) when the pool has no room."""
        new_blocks = self.kv.allocate_for_load(request, computed_blocks, len(tiers))
        if new_blocks is None:
            return False
        start = len(computed_blocks)
        hashes = request.block_hashes[start : start + len(tiers)]
        self.loading[request.request_id] = PendingLoad(request, num_hit, [b.block_id for b in new_blocks], hashes,
                                                       request.status == RequestStatus.PREEMPTED)
        request.status = RequestStatus.WAITING_FOR_KV
        self.external.start_load(request.request_id, hashes)
        return True

    def finish(self, load: list[tuple[int, bytes]]) -> list[Request]:
        """The loads that came in: their blocks join this step's `load` and are published (the runner
        fills them before the forward reads any), their requests go back in line holding them. A load
        that brought fewer blocks than asked leaves the rest to compute."""
        ready = []
        for request_id, tiers in self.external.poll_loads().items():
            num_arrived = len(tiers)
            pending = self.loading.pop(request_id, None)
            if pending is None:
                continue  # aborted while its reads ran
            request = pending.request
            load.extend(zip(pending.block_ids[:num_arrived], pending.block_hashes[:num_arrived], strict=True))
            self.external.commit(request_id, num_arrived)
            request.num_computed_tokens = pending.num_local_tokens + num_arrived * self.kv.block_size
            self.kv.publish(request, request.num_computed_tokens)
            request.status = RequestStatus.PREEMPTED if pending.resumed else RequestStatus.WAITING
            self.loaded[request_id] = tokens_by_tier(pending.num_local_tokens, tiers, self.kv.block_size)
            ready.append(request)
        return ready

    def preempt(self, request: Request) -> list[tuple[int, bytes]]:
        """Swap or recompute a preempted request's computed blocks; the ones to copy out this step."""
        cacheable = self.kv.enable_caching and request.sampling_params.prompt_logprobs is None
        keep = self.kv.full_blocks(request) if cacheable else []
        return self.external.preempt(request.request_id, keep, request.num_computed_tokens)

    def unhold_if_stuck(self, waiting: list[Request]) -> None:
        """Nothing ran this step and nothing is running: if loaded requests' blocks are what keeps the
        head of the line out, the last of them lets its blocks go. They stay cached in L1, so it finds
        them again as a prefix hit unless they are evicted first."""
        if self.loading:
            return  # a read still in flight: wait for it
        held = [r for r in waiting if r.request_id in self.loaded]
        if not held or held == waiting[:1]:
            return
        request = held[-1]
        logger.debug("KV loads: %s lets its loaded blocks go so the waiting line can move", request.request_id)
        self.kv.free(request)
        request.num_computed_tokens = 0
        del self.loaded[request.request_id]

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: drop its loads (its blocks are freed by the caller)."""
        self.loading.pop(request_id, None)
        self.loaded.pop(request_id, None)
        self.external.release(request_id)
