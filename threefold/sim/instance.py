"""One simulated replica: a waiting queue, continuous batching, an LRU prefix cache.

Like the engine's scheduler, a step runs one token for every decode and
spends the rest of `max_num_batched_tokens` on prefill, chunked, first come
first served from the waiting queue. A request's cached prefix (its leading
block hashes found in this replica's cache) is skipped; its prompt blocks are
cached when its prefill ends and its prompt+output blocks when it finishes.

Runs of decode-only steps are one event (a "stretch"): nothing changes inside
one but the context, which grows by the decode count each step, so step j of
a stretch lasts A + B*j and k steps last k*A + B*k(k-1)/2. An arrival cuts
the stretch after the step in progress. This keeps the simulator's events per
request O(1) instead of O(output tokens).

Simplifications (stated, deliberate): no preemption (the KV of running
requests is assumed to fit), and running requests' blocks do not shrink the
prefix cache's capacity.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from threefold.router.radix import PrefixIndex
from threefold.sim.engine_model import EngineModel


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


@dataclass
class Instance:
    name: str
    model: EngineModel
    cache: PrefixIndex = field(init=False)
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
        self.cache = PrefixIndex(self.model.num_blocks)

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
                if request.remaining < 0:
                    self._admit(request)
                chunk = min(request.remaining, budget)
                self._chunks.append((request, chunk))
                budget -= chunk
            tokens = sum(c for _, c in self._chunks)
            before = sum(c * (r.prompt_len - r.remaining) for r, c in self._chunks)  # cached or earlier chunks
            self.prefill_tokens += tokens
            self.end = now + self.model.step_seconds(tokens + num_decodes, self.context, before)
        elif num_decodes:
            k = self.decodes[0][0] - self.steps
            a = self.model.step_seconds(num_decodes, self.context)
            b = self.model.per_context_s * num_decodes
            self._stretch = (k, a, b)
            self.end = now + k * a + b * k * (k - 1) / 2
        if self.end is not None:
            self.version += 1
        return self.end

    def _admit(self, request: SimRequest) -> None:
        matched = self.cache.match(request.prompt_hashes)
        hit = min(matched * self.model.block_size, request.prompt_len - 1)
        self.cache.insert(request.prompt_hashes[:matched])  # a hit refreshes its blocks' LRU position
        request.hit_tokens, request.remaining = hit, request.prompt_len - hit

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
                self.cache.insert(request.prompt_hashes)
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
                self._seq += 1
                heapq.heappush(self.decodes, (self.steps + request.output_len - 1, self._seq, request))
                self.context += request.prompt_len + 1
        self.end, self._chunks, self._stretch = None, [], None
        return first, finished

    def _finish(self, request: SimRequest) -> SimRequest:
        self.cache.insert(request.cache_hashes)
        return request
