"""One simulated replica: a waiting queue, continuous batching, the engine's KV block pool.

Like the engine's scheduler, a step runs one token for every decode and
spends the rest of `max_num_batched_tokens` on prefill, chunked, first come
first served from the waiting queue. A request's cached prefix (its leading
block hashes found in this replica's pool, `SimBlockPool`: the engine's
`BlockPool` rules) is skipped. As in `KVCacheManager`, a request is admitted
only when the pool has blocks for its first chunk (else it and everyone behind
it waits), each chunk's full blocks are published as it is scheduled, its
output blocks are taken at its first token and published when it finishes,
and its blocks are freed tail first then: only blocks no running request
holds are evicted.

Runs of decode-only steps are one event (a "stretch"): nothing changes inside
one but the context, which grows by the decode count each step, so step j of
a stretch lasts A + B*j and k steps last k*A + B*k(k-1)/2. An arrival cuts
the stretch after the step in progress. This keeps the simulator's events per
request O(1) instead of O(output tokens).

Simplifications (stated, deliberate): no preemption (a running request that
needs blocks the pool lacks gets them beyond its size, `SimBlockPool.allocate`),
and output blocks are taken all at once at the first token (the engine takes
one per `block_size` tokens decoded).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from threefold.sim.block_pool import SimBlockPool
from threefold.sim.engine_model import EngineModel, attention_pairs


@dataclass(eq=False)
class SimRequest:
    request_id: str
    prompt_len: int
    output_len: int
    prompt_hashes: tuple[int, ...]
    cache_hashes: tuple[int, ...]
    """Block hashes of prompt + output: what the engine holds once the request finished."""
    key: int
    arrival: float
    session: int = -1
    turn: int = 0
    backend: str = ""
    hit_tokens: int = 0
    remaining: int = -1
    """Prefill tokens still to compute; -1 until the request is admitted."""
    first_token: float | None = None
    finish: float | None = None
    blocks: list[int] = field(default_factory=list)
    """The KV blocks it holds on its instance (SimBlockPool keys), in token order."""


@dataclass
class Instance:
    name: str
    model: EngineModel
    pool: SimBlockPool = field(init=False)
    waiting: deque[SimRequest] = field(default_factory=deque)
    decodes: list[tuple[int, int, SimRequest]] = field(default_factory=list)
    """Heap of (step count at which it finishes, seq, request)."""
    context: int = 0
    """Total KV tokens of the running decodes."""
    steps: int = 0
    version: int = 0
    """Bumped whenever the pending step-end event is replaced (older ones are stale)."""
    end: float | None = None
    busy_seconds: float = 0.0
    prefill_tokens: int = 0
    _start: float = 0.0
    _stretch: tuple[int, float, float] | None = None
    """(k steps, A, B) of the decode stretch in progress; None for a prefill step."""
    _chunks: list[tuple[SimRequest, int]] = field(default_factory=list)
    _seq: int = 0

    def __post_init__(self) -> None:
        self.pool = SimBlockPool(self.model.num_blocks)

    @property
    def busy(self) -> bool:
        return self.end is not None

    def enqueue(self, request: SimRequest, now: float) -> float | None:
        """Add a request; returns the new step-end time when it changed (start or cut), else None."""
        self.waiting.append(request)
        if self.end is None:
            return self.start(now)
        if self._stretch is not None:
            return self._cut(now)
        return None

    def start(self, now: float) -> float | None:
        """Plan the next step (or stretch) from `now`; None when there is nothing to run."""
        self.end, self._start, self._stretch, self._chunks = None, now, None, []
        num_decodes = len(self.decodes)
        if self.waiting and num_decodes < self.model.max_num_seqs:
            budget = self.model.max_num_batched_tokens - num_decodes
            for request in self.waiting:
                if budget <= 0 or num_decodes + len(self._chunks) >= self.model.max_num_seqs:
                    break
                chunk = self._schedule(request, budget)
                if not chunk:
                    break  # no blocks for it: it and everyone behind it wait (FCFS, as the engine)
                self._chunks.append((request, chunk))
                budget -= chunk
            tokens = sum(c for _, c in self._chunks)
            before = sum(c * (r.prompt_len - r.remaining) for r, c in self._chunks)  # cached or earlier chunks
            pairs = sum(attention_pairs(c) for _, c in self._chunks)  # each chunk's attention over itself
            self.prefill_tokens += tokens
            self.end = now + self.model.step_seconds(tokens + num_decodes, self.context, before, pairs)
        elif num_decodes:
            k = self.decodes[0][0] - self.steps
            a = self.model.step_seconds(num_decodes, self.context)
            b = self.model.per_context_s * num_decodes
            self._stretch = (k, a, b)
            self.end = now + k * a + b * k * (k - 1) / 2
        if self.end is not None:
            self.version += 1
        return self.end

    def _schedule(self, request: SimRequest, budget: int) -> int:
        """Blocks for the request's next chunk, admitting it first if it is new; its size, 0 when it must wait.

        Admission matches at most (prompt_len - 1) // block_size blocks (the last token is always
        computed) and needs free blocks for the first chunk unless nothing else runs here."""
        bs = self.model.block_size
        if request.remaining < 0:
            usable = request.prompt_hashes[:(request.prompt_len - 1) // bs]
            hits = usable[:self.pool.match(usable)]
            chunk = min(request.prompt_len - len(hits) * bs, budget)
            if not self.pool.fits(hits, -(-chunk // bs)) and (self._chunks or self.decodes):
                return 0
            self.pool.touch(request.blocks, hits)
            request.hit_tokens = len(hits) * bs
            request.remaining = request.prompt_len - request.hit_tokens
        computed = request.prompt_len - request.remaining
        chunk = min(request.remaining, budget)
        self.pool.allocate(request.blocks, -(-(computed + chunk) // bs) - len(request.blocks))
        self.pool.publish(request.blocks, request.prompt_hashes[:(computed + chunk) // bs], computed // bs)
        return chunk

    def _cut(self, now: float) -> float:
        """End the stretch after the step in progress at `now`."""
        k, a, b = self._stretch  # type: ignore[misc]
        elapsed = now - self._start
        if b > 0:  # completed steps j: b/2 j^2 + (a - b/2) j <= elapsed
            half = a - b / 2
            done = int((-half + math.sqrt(half * half + 2 * b * elapsed)) / b)
        else:
            done = int(elapsed / a)
        while done > 0 and done * a + b * done * (done - 1) / 2 > elapsed:
            done -= 1  # float rounding
        k2 = min(k, done + 1)
        self._stretch = (k2, a, b)
        self.end = self._start + k2 * a + b * k2 * (k2 - 1) / 2
        self.version += 1
        return self.end

    def complete(self, now: float) -> tuple[list[SimRequest], list[SimRequest]]:
        """Apply the step (or stretch) ending now: (requests whose first token came, finished ones)."""
        self.busy_seconds += now - self._start
        num_steps = self._stretch[0] if self._stretch is not None else 1
        num_decodes = len(self.decodes)
        self.steps += num_steps
        self.context += num_decodes * num_steps
        first: list[SimRequest] = []
        for request, chunk in self._chunks:
            request.remaining -= chunk
            if request.remaining == 0:
                self.waiting.remove(request)
                first.append(request)
        finished: list[SimRequest] = []
        while self.decodes and self.decodes[0][0] <= self.steps:
            _, _, request = heapq.heappop(self.decodes)
            self.context -= request.prompt_len + request.output_len
            finished.append(self._finish(request))
        for request in first:
            if request.output_len <= 1:
                finished.append(self._finish(request))
            else:
                total = -(-(request.prompt_len + request.output_len - 1) // self.model.block_size)
                self.pool.allocate(request.blocks, total - len(request.blocks))
                self._seq += 1
                heapq.heappush(self.decodes, (self.steps + request.output_len - 1, self._seq, request))
                self.context += request.prompt_len + 1
        self.end, self._chunks, self._stretch = None, [], None
        return first, finished

    def _finish(self, request: SimRequest) -> SimRequest:
        """Publish its output's full blocks (the last token's KV is never computed), then free them all."""
        bs = self.model.block_size
        computed = request.cache_hashes[:(request.prompt_len + request.output_len - 1) // bs]
        self.pool.publish(request.blocks, computed, request.prompt_len // bs)
        self.pool.free(request.blocks)
        return request
