"""DualMap's per-instance queue and its prefill-cost estimate, each operation O(log n) or O(1).

The queue is a heap in DualMap's order (priority, -hit tokens, arrival). Two more things are
asked of it on every request and every tick: the miss tokens it holds (the predicted TTFT) and
its oldest arrival (the hotspot trigger). Both are kept as it changes: a running token sum, and
a second heap by arrival. Entries leave from the middle when a hotspot sheds them; removal is
lazy (the entry is forgotten, both heaps skip it when it surfaces), so nothing rescans the queue.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from threefold.router.policies import RouteRequest

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
    left: tuple[str, ...] = field(compare=False, default=())
    """Instances it was moved off as a hotspot's queue shed it. It never moves back to one of
    them: without this rule a request bounced between its two candidates as each in turn became
    the hotspot (13,942 migrations for 5,120 requests at 128 instances)."""


class InstanceQueue:
    def __init__(self) -> None:
        self._heap: list[Queued] = []
        self._by_arrival: list[tuple[float, int]] = []
        self._live: dict[int, Queued] = {}  # seq -> entry; what is not here was removed
        self.tokens = 0
        """Miss tokens of the queued entries."""

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def push(self, entry: Queued) -> None:
        heapq.heappush(self._heap, entry)
        heapq.heappush(self._by_arrival, (entry.arrival, entry.seq))
        self._live[entry.seq] = entry
        self.tokens += entry.miss

    def peek(self) -> Queued:
        while self._heap[0].seq not in self._live:
            heapq.heappop(self._heap)
        return self._heap[0]

    def pop(self) -> Queued:
        entry = self.peek()
        heapq.heappop(self._heap)
        self._forget(entry)
        return entry

    def remove(self, entry: Queued) -> None:
        self._forget(entry)
        if len(self._heap) > 2 * len(self._live) + 64:  # mostly dead entries: rebuild, O(n) now and then
            self._heap = [e for e in self._heap if e.seq in self._live]
            heapq.heapify(self._heap)
            self._by_arrival = [(e.arrival, e.seq) for e in self._heap]
            heapq.heapify(self._by_arrival)

    def oldest_arrival(self) -> float | None:
        while self._by_arrival and self._by_arrival[0][1] not in self._live:
            heapq.heappop(self._by_arrival)
        return self._by_arrival[0][0] if self._by_arrival else None

    def entries(self) -> list[Queued]:
        """The live entries in heap order (the order pops would take)."""
        return sorted(self._live.values())

    def _forget(self, entry: Queued) -> None:
        del self._live[entry.seq]
        self.tokens -= entry.miss


class TpctEstimate:
    """DualMap's tpct (prefill seconds per uncached token), fitted to the TTFTs the router sees.

    TTFT_c = tpct * (tokens ahead at c + own miss), so each observed request gives a point
    (tokens, ttft); tpct is the least-squares slope through the origin, sum(t*y) / sum(t*t),
    over the last `window` points. Large requests dominate that fit, as they should: a
    request of a few tokens is mostly fixed overhead. Until `min_points` arrive, the
    configured tpct stands. A static tpct is only right for the machine and load it was
    measured on; set 10x too low (a GPU figure on a CPU) the SLO switch never fires and a
    candidate that holds one shared block (a chat template) takes every request.
    """

    def __init__(self, initial: float, window: int, adapt: bool, min_points: int = 8) -> None:
        self.initial, self.adapt, self.min_points = initial, adapt, min_points
        self._points: deque[tuple[int, float]] = deque(maxlen=window)
        self._sum_ty = self._sum_tt = 0.0
        self._count = 0
        self.value = initial

    def observe(self, tokens: int, ttft: float) -> None:
        if not self.adapt or tokens <= 0:
            return
        if len(self._points) == self._points.maxlen:
            old_t, old_y = self._points[0]
            self._sum_ty -= old_t * old_y
            self._sum_tt -= old_t * old_t
        self._points.append((tokens, ttft))
        self._sum_ty += tokens * ttft
        self._sum_tt += tokens * tokens
        self._count += 1
        if self._count % len(self._points) == 0:  # re-sum now and then: no drift from the running sums
            self._sum_ty = sum(t * y for t, y in self._points)
            self._sum_tt = float(sum(t * t for t, _ in self._points))
        if len(self._points) >= self.min_points and self._sum_tt > 0:
            self.value = max(self._sum_ty / self._sum_tt, self.initial / 100)
