"""Routing policies: pure, clock-injected Python shared by the HTTP router and the simulator.

Interface (every policy, one class each, registered by name in POLICIES):

    policy = make_policy("dualmap", ["http://a", "http://b"], RouterConfig())
    request = RouteRequest.from_tokens("r1", token_ids, config, arrival=now)
    policy.submit(request, now)            # hand the request to the policy
    for request_id, backend in policy.dispatch(now):   # requests to send now
        ...send...
    policy.on_first_token(request_id, now) # its prefill finished (TTFT observed; measured=False when
                                           # only the whole answer was seen, as for a non-streamed one)
    policy.on_finished(request_id, now)    # done or failed: frees its accounting
    policy.observe_load(backend, num_requests, now)    # a backend's own count (/load)
    policy.add_backend(name, now); policy.remove_backend(name, now)
    policy.tick(now)                       # time-based work (DualMap's hotspot check)
    policy.snapshot()                      # per backend: load, cached blocks, counts

`now` is seconds on any monotonic clock the caller owns (wall time in the
router, simulated time in the simulator); no policy reads a clock, sleeps or
does I/O. `submit` never blocks: round_robin, least_loaded, prefix_hash and
cache_aware choose at once (the next `dispatch` returns the choice); DualMap
queues per instance and binds late, so `dispatch` returns a request only when
its instance is ready, and callers must call `dispatch` again after
`on_first_token`/`on_finished`/`tick`. A request whose backend failed before
it started is simply submitted again (after `on_finished`). `remove_backend`
re-routes whatever the policy still queues for that backend.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

from threefold.errors import ThreefoldError
from threefold.router.config import RouterConfig
from threefold.router.hashring import HashRing
from threefold.router.radix import PrefixIndex, block_hashes, prefix_key


class NoBackendError(ThreefoldError):
    """No healthy backend can take a request (the router answers 503)."""

    def __init__(self, message: str = "No healthy backend is available.") -> None:
        super().__init__(message, status_code=503)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy knows about one request: its block-aligned prefix, size and arrival."""

    request_id: str
    block_hashes: tuple[int, ...]
    num_tokens: int
    key: int
    """The prefix key (first key_tokens tokens) that prefix_hash and DualMap hash onto rings."""
    arrival: float

    @classmethod
    def from_tokens(cls, request_id: str, token_ids: list[int], config: RouterConfig,
                    arrival: float) -> RouteRequest:
        return cls(request_id, block_hashes(token_ids, config.block_size), len(token_ids),
                   prefix_key(token_ids, config.block_size, config.key_tokens), arrival)


class Assignment(NamedTuple):
    request_id: str
    backend: str


@dataclass
class BackendState:
    """The router's own accounting for one backend."""

    name: str
    cache: PrefixIndex
    inflight: dict[str, int] = field(default_factory=dict)
    """request_id -> its miss (uncached) tokens, from dispatch to finish."""
    prefilling: dict[str, int] = field(default_factory=dict)
    """request_id -> miss tokens, from dispatch to first token (DualMap's running miss tokens)."""
    reported_requests: int = 0
    """The backend's own running+waiting count at its last /load (includes other clients)."""
    num_routed: int = 0
    hit_tokens: int = 0
    last_prefill_done: float | None = None

    @property
    def num_requests(self) -> int:
        return max(len(self.inflight), self.reported_requests)

    @property
    def prefill_tokens(self) -> int:
        return sum(self.prefilling.values())


class Policy:
    """Base: backend bookkeeping; subclasses override choose() (or submit/dispatch, as DualMap)."""

    name: ClassVar[str]

    def __init__(self, backends: list[str], config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self.backends: dict[str, BackendState] = {}
        self._where: dict[str, str] = {}  # request_id -> backend, while in flight
        self._hit_at_dispatch: dict[str, int] = {}  # request_id -> cached tokens expected when it was bound
        self._ready: list[Assignment] = []
        for name in backends:
            self.add_backend(name, 0.0)

    # ---- membership --------------------------------------------------------

    def add_backend(self, name: str, now: float) -> None:
        if name not in self.backends:  # a backend that returns starts with an empty cache estimate
            self.backends[name] = BackendState(name, PrefixIndex(self.config.cache_capacity_blocks))

    def remove_backend(self, name: str, now: float) -> None:
        state = self.backends.pop(name, None)
        if state is not None:
            for request_id in state.inflight:
                self._where.pop(request_id, None)

    # ---- the request's life ------------------------------------------------

    def submit(self, request: RouteRequest, now: float) -> None:
        if not self.backends:
            raise NoBackendError()
        self._assign(request, self.choose(request, now), now)

    def dispatch(self, now: float) -> list[Assignment]:
        ready, self._ready = self._ready, []
        return ready

    def choose(self, request: RouteRequest, now: float) -> str:
        raise NotImplementedError

    def on_first_token(self, request_id: str, now: float, measured: bool = True) -> None:
        state = self._state_of(request_id)
        if state is not None and state.prefilling.pop(request_id, None) is not None:
            state.last_prefill_done = now

    def on_finished(self, request_id: str, now: float) -> None:
        state = self._state_of(request_id)
        self._where.pop(request_id, None)
        self._hit_at_dispatch.pop(request_id, None)
        if state is not None:
            state.prefilling.pop(request_id, None)
            state.inflight.pop(request_id, None)

    def observe_load(self, backend: str, num_requests: int, now: float) -> None:
        if backend in self.backends:
            self.backends[backend].reported_requests = num_requests

    def tick(self, now: float) -> None:
        """Time-based work; nothing for the immediate policies."""

    def backend_of(self, request_id: str) -> str | None:
        return self._where.get(request_id)

    def routed_hit_tokens(self, request_id: str) -> int:
        """Tokens the policy expected cached at the backend it bound the request to (0 if unknown)."""
        return self._hit_at_dispatch.get(request_id, 0)

    def hit_tokens(self, backend: str, request: RouteRequest) -> int:
        return self.backends[backend].cache.match(request.block_hashes) * self.config.block_size

    def snapshot(self) -> dict[str, dict]:
        return {name: {"in_flight": len(s.inflight), "prefilling": len(s.prefilling),
                       "reported_requests": s.reported_requests, "cached_blocks": len(s.cache),
                       "routed": s.num_routed, "hit_tokens": s.hit_tokens} for name, s in self.backends.items()}

    # ---- helpers -----------------------------------------------------------

    def _state_of(self, request_id: str) -> BackendState | None:
        name = self._where.get(request_id)
        return self.backends.get(name) if name is not None else None

    def _assign(self, request: RouteRequest, backend: str, now: float) -> None:
        """Account the request on `backend` and queue it for the next dispatch()."""
        state = self.backends[backend]
        hit = self.hit_tokens(backend, request)
        miss = max(1, request.num_tokens - hit)
        state.inflight[request.request_id] = miss
        state.prefilling[request.request_id] = miss
        state.cache.insert(request.block_hashes)  # it will be cached there once prefilled
        state.num_routed += 1
        state.hit_tokens += hit
        self._where[request.request_id] = backend
        self._hit_at_dispatch[request.request_id] = hit
        self._ready.append(Assignment(request.request_id, backend))


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, backends: list[str], config: RouterConfig | None = None) -> None:
        self._counter = itertools.count()
        super().__init__(backends, config)

    def choose(self, request: RouteRequest, now: float) -> str:
        names = list(self.backends)
        return names[next(self._counter) % len(names)]


class LeastLoaded(Policy):
    """Fewest in-flight requests (router's count, or the backend's own if higher); ties: first listed."""

    name = "least_loaded"

    def choose(self, request: RouteRequest, now: float) -> str:
        return min(self.backends.values(), key=lambda s: (s.num_requests, s.prefill_tokens)).name


class PrefixHash(Policy):
    """Consistent hashing of the prefix key with bounded loads (capacity ceil((1+eps) * m / n))."""

    name = "prefix_hash"

    def __init__(self, backends: list[str], config: RouterConfig | None = None) -> None:
        self.ring = HashRing(vnodes=(config or RouterConfig()).vnodes)
        super().__init__(backends, config)

    def add_backend(self, name: str, now: float) -> None:
        if name not in self.backends:
            self.ring.add(name)
        super().add_backend(name, now)

    def remove_backend(self, name: str, now: float) -> None:
        self.ring.remove(name)
        super().remove_backend(name, now)

    def choose(self, request: RouteRequest, now: float) -> str:
        total = sum(len(s.inflight) for s in self.backends.values()) + 1  # counting this request
        capacity = math.ceil((1 + self.config.bounded_load_eps) * total / len(self.backends))
        chosen = self.ring.lookup_bounded(request.key, lambda b: len(self.backends[b].inflight), capacity)
        assert chosen is not None  # the ring holds every backend
        return chosen


class CacheAware(Policy):
    """SGLang router's cache_aware: shortest queue when the fleet is imbalanced, else the best
    prefix match above cache_threshold, else the backend with the smallest cache tree."""

    name = "cache_aware"

    def choose(self, request: RouteRequest, now: float) -> str:
        states = list(self.backends.values())
        loads = [s.num_requests for s in states]
        cfg = self.config
        if max(loads) - min(loads) > cfg.balance_abs_threshold and max(loads) > cfg.balance_rel_threshold * min(loads):
            return min(states, key=lambda s: s.num_requests).name
        best = max(states, key=lambda s: s.cache.match(request.block_hashes))
        matched = best.cache.match(request.block_hashes) * cfg.block_size
        if request.num_tokens and matched / request.num_tokens > cfg.cache_threshold:
            return best.name
        return min(states, key=lambda s: len(s.cache)).name


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls


for _cls in (RoundRobin, LeastLoaded, PrefixHash, CacheAware):
    register(_cls)


def make_policy(name: str, backends: list[str], config: RouterConfig | None = None) -> Policy:
    if name not in POLICIES:
        import threefold.router.dualmap  # noqa: F401  (registers itself)
    if name not in POLICIES:
        raise ThreefoldError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}", param="policy")
    return POLICIES[name](backends, config)


def policy_names() -> list[str]:
    import threefold.router.dualmap  # noqa: F401
    return sorted(POLICIES)
