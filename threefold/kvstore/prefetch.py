"""Reads of a request's prefix from the tiers, inline or on background threads (torch-free).

A read takes the blocks in order, in batches (one Redis MGET per 32 blocks), and stops at the first
one that is missing, fails or has the wrong size: what came before it is loaded, the rest recomputed.
Disk and Redis reads are I/O (the GIL is let go while they wait, and while zlib checks a frame), so
the engine's steps go on while they run.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from threefold.kvstore.store import TieredKVStore

logger = logging.getLogger(__name__)

StagedBlock = tuple[bytes, str, bytes]
"""(block hash, the tier it came from, verified payload)."""


class Prefetcher:
    """Background reads, one job per request. Owned by the engine thread: submit, finished, cancel and
    wait are called from it only; the pool's threads run `read_prefix` and touch nothing else."""

    def __init__(self, store: TieredKVStore, payload_bytes: int, max_workers: int = 2) -> None:
        self.store, self.payload_bytes = store, payload_bytes
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kv-prefetch")
        self._jobs: dict[str, tuple[Future[list[StagedBlock]], int]] = {}

    def read_prefix(self, block_hashes: list[bytes]) -> list[StagedBlock]:
        """The longest prefix of the blocks that every tier lookup and check lets through (batched reads,
        store.get_prefix). Never raises."""
        try:
            got = self.store.get_prefix(block_hashes)
        except Exception:  # a bug in a tier must not fail the request: recompute it
            logger.exception("KV offload: reading a prefix failed; recomputing it")
            return []
        blocks: list[StagedBlock] = []
        for block_hash, (tier, payload) in zip(block_hashes, got, strict=False):
            if len(payload) != self.payload_bytes:
                break  # written by a build with another layout under the same namespace: never trust it
            blocks.append((block_hash, tier, payload))
        return blocks

    def submit(self, request_id: str, block_hashes: list[bytes]) -> None:
        self._jobs[request_id] = (self._pool.submit(self.read_prefix, block_hashes), len(block_hashes))

    def finished(self) -> dict[str, tuple[list[StagedBlock], int]]:
        """Jobs done since the last call: request id -> (the blocks read, how many were asked)."""
        done = {rid: job for rid, job in self._jobs.items() if job[0].done()}
        for request_id in done:
            del self._jobs[request_id]
        return {rid: (future.result(), wanted) for rid, (future, wanted) in done.items()}

    def cancel(self, request_id: str) -> None:
        """Forget a job; a read already running finishes on its thread and its result is dropped."""
        job = self._jobs.pop(request_id, None)
        if job is not None:
            job[0].cancel()

    def wait(self, timeout: float) -> None:
        """Until a job finishes or `timeout` seconds pass."""
        if self._jobs:
            wait([future for future, _ in self._jobs.values()], timeout, return_when=FIRST_COMPLETED)

    @property
    def num_pending(self) -> int:
        return len(self._jobs)

    def close(self) -> None:
        """Drop queued jobs; reads in flight end on their own (tier timeouts bound them)."""
        self._jobs.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
