"""DualMap (arXiv 2602.06502): two hash candidates, SLO-aware choice, per-instance queues,
hotspot rebalancing and late binding. Defaults follow the reference code
(`../shared/reference/algorithms.md` section 5):

1. c1, c2 from two independent consistent-hash rings over the prefix key
   (c2 := the next instance when they coincide).
2. TTFT_c = tpct * (miss tokens queued at c + miss tokens prefilling at c + own miss at c).
3. a = the candidate with the most cached prefix (ties: fewer in flight, then random);
   if TTFT_a > SLO/2 take argmin TTFT over {c1, c2}, else a. The balance is per request:
   nothing switches affinity off for the whole fleet.
4. Each instance's queue is a heap keyed (priority, -hit tokens, arrival); HIGH priority
   when the predicted TTFT exceeds the p99 of the last 256 observed TTFTs.
5. Hotspot: pending TTFT > SLO, or the oldest waiter waited >= 3 s, or both candidates of a
   new request overloaded. Queued requests move greedily, cheapest first while the cost
   TTFT_target - TTFT_source < 0, to their other candidate (or the next instance if that one
   is overloaded), until the moved tokens reach pending - SLO/tpct. Never recursive; running
   requests never move.
6. Late binding: an instance pulls from its queue when nothing is prefilling there, or one
   request is and its last prefill ended < 2 s ago; one pull takes up to SLO/tpct miss tokens.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field

from threefold.router.config import RouterConfig
from threefold.router.hashring import HashRing
from threefold.router.policies import Assignment, NoBackendError, Policy, RouteRequest, register

HIGH, NORMAL = 0, 1


@dataclass(order=True)
class Queued:
    """A heap entry; the order is DualMap's (priority, -hit, arrival), then submission order."""

    priority: int
    neg_hit: int
    arrival: float
    seq: int
    request: RouteRequest = field(compare=False)
    miss: int = field(compare=False, default=0)
    """Uncached tokens at the instance whose queue holds the entry."""


@register
class DualMap(Policy):
    name = "dualmap"

    def __init__(self, backends: list[str], config: RouterConfig | None = None) -> None:
        cfg = config or RouterConfig()
        self.rings = (HashRing(vnodes=cfg.vnodes, salt="dualmap-1"), HashRing(vnodes=cfg.vnodes, salt="dualmap-2"))
        self.queues: dict[str, list[Queued]] = {}
        self.migrations: dict[str, int] = {}  # per source instance
        self.ttfts: deque[float] = deque(maxlen=cfg.ttft_window)
        self._arrival: dict[str, float] = {}
        self._seq = itertools.count()
        self._rng = random.Random(cfg.seed)
        super().__init__(backends, cfg)

    # ---- membership --------------------------------------------------------

    def add_backend(self, name: str, now: float) -> None:
        if name not in self.backends:
            for ring in self.rings:
                ring.add(name)
            self.queues[name] = []
            self.migrations.setdefault(name, 0)
        super().add_backend(name, now)

    def remove_backend(self, name: str, now: float) -> None:
        for ring in self.rings:
            ring.remove(name)
        orphans = self.queues.pop(name, [])
        super().remove_backend(name, now)
        for entry in sorted(orphans):
            if self.backends:
                self._enqueue(entry.request, now)

    # ---- the request's life ------------------------------------------------

    def submit(self, request: RouteRequest, now: float) -> None:
        if not self.backends:
            raise NoBackendError()
        self._arrival[request.request_id] = request.arrival
        self._enqueue(request, now)

    def dispatch(self, now: float) -> list[Assignment]:
        budget = max(1, round(self.config.slo_s / self.config.tpct_s))
        for name, queue in self.queues.items():
            if not queue or not self._ready_to_pull(name, now):
                continue
            taken = 0
            while queue and (taken == 0 or taken + queue[0].miss <= budget):
                entry = heapq.heappop(queue)
                taken += entry.miss
                self._assign(entry.request, name, now)
        return super().dispatch(now)

    def on_first_token(self, request_id: str, now: float) -> None:
        arrival = self._arrival.pop(request_id, None)
        if arrival is not None:
            self.ttfts.append(now - arrival)
        super().on_first_token(request_id, now)

    def on_finished(self, request_id: str, now: float) -> None:
        self._arrival.pop(request_id, None)
        super().on_finished(request_id, now)

    def tick(self, now: float) -> None:
        for name in list(self.queues):
            if self._is_hotspot(name, now):
                self.rebalance(name, now)

    # ---- the choice (steps 1-4) -------------------------------------------

    def candidates(self, request: RouteRequest) -> tuple[str, str]:
        c1, c2 = (ring.lookup(request.key) for ring in self.rings)
        assert c1 is not None and c2 is not None
        if c1 == c2:
            c2 = self._next_instance(c1)
        return c1, c2

    def pending_tokens(self, name: str) -> int:
        return sum(e.miss for e in self.queues[name]) + self.backends[name].prefill_tokens

    def predicted_ttft(self, name: str, request: RouteRequest) -> float:
        own_miss = max(1, request.num_tokens - self.hit_tokens(name, request))
        return self.config.tpct_s * (self.pending_tokens(name) + own_miss)

    def choose(self, request: RouteRequest, now: float) -> str:
        c1, c2 = self.candidates(request)
        if c1 == c2:
            return c1
        hits = {c: self.hit_tokens(c, request) for c in (c1, c2)}
        affine = max((c1, c2), key=lambda c: (hits[c], -len(self.backends[c].inflight), self._rng.random()))
        if self.predicted_ttft(affine, request) > self.config.slo_s / 2:
            return min((c1, c2), key=lambda c: self.predicted_ttft(c, request))
        return affine

    def _enqueue(self, request: RouteRequest, now: float) -> None:
        target = self.choose(request, now)
        ttft = self.predicted_ttft(target, request)
        self._push(target, request, self._priority(ttft))
        c1, c2 = self.candidates(request)
        if self._overloaded(c1) and self._overloaded(c2):
            for name in {c1, c2}:
                self.rebalance(name, now)

    def _priority(self, predicted_ttft: float) -> int:
        if len(self.ttfts) < 2:
            return NORMAL
        ordered = sorted(self.ttfts)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return HIGH if predicted_ttft > p99 else NORMAL

    def _push(self, name: str, request: RouteRequest, priority: int) -> None:
        hit = self.hit_tokens(name, request)
        entry = Queued(priority, -hit, request.arrival, next(self._seq), request, max(1, request.num_tokens - hit))
        heapq.heappush(self.queues[name], entry)

    # ---- hotspots (step 5) and late binding (step 6) -----------------------

    def _overloaded(self, name: str) -> bool:
        return self.config.tpct_s * self.pending_tokens(name) > self.config.slo_s

    def _is_hotspot(self, name: str, now: float) -> bool:
        queue = self.queues[name]
        oldest_wait = now - min(e.arrival for e in queue) if queue else 0.0
        return bool(queue) and (self._overloaded(name) or oldest_wait >= self.config.hotspot_wait_s)

    def rebalance(self, source: str, now: float) -> int:
        """Move queued requests off `source`, cheapest first while it pays; returns the number moved."""
        threshold = self.config.slo_s / self.config.tpct_s
        excess = max(self.pending_tokens(source) - threshold, 1)  # a wait-triggered hotspot moves >= 1
        moved_tokens = moved = 0
        while moved_tokens < excess and self.queues[source]:
            cost, entry, target = min(self._moves(source), key=lambda m: (m[0], m[1]))
            if cost >= 0:
                break
            self.queues[source].remove(entry)
            heapq.heapify(self.queues[source])
            self._push(target, entry.request, entry.priority)
            moved_tokens += entry.miss
            moved += 1
        self.migrations[source] = self.migrations.get(source, 0) + moved
        return moved

    def _moves(self, source: str) -> list[tuple[float, Queued, str]]:
        source_ttft = self.config.tpct_s * self.pending_tokens(source)
        moves = []
        for entry in self.queues[source]:
            c1, c2 = self.candidates(entry.request)
            target = c2 if c1 == source else c1
            if target == source or self._overloaded(target):
                target = self._next_instance(source)
            if target != source:
                moves.append((self.predicted_ttft(target, entry.request) - source_ttft, entry, target))
        return moves or [(0.0, self.queues[source][0], source)]

    def _ready_to_pull(self, name: str, now: float) -> bool:
        state = self.backends[name]
        if not state.prefilling:
            return True
        recent = state.last_prefill_done is not None and now - state.last_prefill_done < self.config.recent_prefill_s
        return len(state.prefilling) <= 1 and recent

    def _next_instance(self, name: str) -> str:
        names = list(self.backends)
        return names[(names.index(name) + 1) % len(names)]

    def snapshot(self) -> dict[str, dict]:
        snap = super().snapshot()
        for name, info in snap.items():
            info.update(queued=len(self.queues[name]), pending_tokens=self.pending_tokens(name),
                        migrations=self.migrations.get(name, 0))
        return snap
