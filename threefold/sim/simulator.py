"""The discrete-event loop: arrivals -> the router's policy -> replicas -> first tokens and finishes.

The policy is the router's own class (threefold/router/policies.py), driven on
simulated time exactly as the HTTP router drives it on wall time: submit at
arrival, dispatch, on_first_token, on_finished, tick. Events live in one heap
of (time, seq, kind, payload); each is O(log events) plus the policy's own
cost. Policies that queue and bind late (DualMap: `dispatch` scans every
instance) are polled at most once per `dispatch_quantum_s` of simulated time,
like a router's event loop, so 1000 instances stay affordable; the others
hand back their choice at once and are dispatched immediately.

The HTTP path between router and replicas is two calibrated delays
(`EngineModel.dispatch_delay_s`, `report_delay_s`): a dispatched request
reaches its replica's queue one dispatch delay later, and a first token or a
finish reaches the router, the client and the policy (late binding waits on
it) one report delay after the step that made it. A TTFT is what the client
sees: arrival at the router to the report of the first token.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import cast

import numpy as np

from threefold.router.config import RouterConfig
from threefold.router.policies import Policy, RouteRequest, make_policy
from threefold.sim.engine_model import EngineModel
from threefold.sim.instance import Instance, SimRequest
from threefold.sim.traces import Trace

ARRIVE, STEP, DISPATCH, TICK, ENQUEUE, REPORT = range(6)


@dataclass(frozen=True)
class RunResult:
    policy: str
    trace: str
    instances: int
    rate: float
    """Requests per second offered (all instances together)."""
    num_requests: int
    slo_attainment: float
    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    itl_mean: float
    hit_rate: float
    """Prompt tokens served from a replica's prefix cache / all prompt tokens."""
    imbalance: float
    """Busiest replica's busy seconds / the mean over replicas."""
    migrations: int
    sim_seconds: float


def router_config(model: EngineModel, slo_s: float, seed: int) -> RouterConfig:
    """The router configured for these replicas, as an operator would: their block size and cache
    size, the SLO, and the measured prefill cost per token (DualMap's tpct)."""
    return RouterConfig(block_size=model.block_size, cache_capacity_blocks=model.num_blocks, slo_s=slo_s,
                        tpct_s=model.prefill_seconds_per_token(), seed=seed)


class Simulator:
    def __init__(self, model: EngineModel, num_instances: int, policy: str, slo_s: float = 1.0,
                 seed: int = 0, tick_s: float = 0.25, dispatch_quantum_s: float = 0.002) -> None:
        names = [f"i{k}" for k in range(num_instances)]
        self.model, self.slo_s, self.seed = model, slo_s, seed
        self.instances = {name: Instance(name, model) for name in names}
        self.policy: Policy = make_policy(policy, names, router_config(model, slo_s, seed))
        self.late_binding = type(self.policy).dispatch is not Policy.dispatch
        self.tick_s, self.quantum = tick_s, dispatch_quantum_s
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._requests: dict[str, SimRequest] = {}
        self._dispatch_at: float | None = None
        self._outstanding = 0
        self.done: list[SimRequest] = []
        """Finished requests, in the order the router saw them finish."""
        self._trace: Trace | None = None
        self._thinks = np.zeros(0)
        self._think_at = np.zeros(1, dtype=int)

    def _push(self, time: float, kind: int, payload: object) -> None:
        heapq.heappush(self._events, (time, next(self._seq), kind, payload))

    def run(self, trace: Trace, rate: float) -> RunResult:
        starts, self._thinks = trace.arrivals(rate, self.seed)
        self._trace = trace
        self._think_at = np.concatenate([[0], np.cumsum([len(s) for s in trace.sessions])])
        if trace.arrival_times is not None:  # replayed: every turn at its recorded time
            for index, times in enumerate(trace.arrival_times):
                for turn, time in enumerate(times):
                    self._push(time, ARRIVE, (index, turn))
        else:
            for index, start in enumerate(starts.tolist()):
                self._push(start, ARRIVE, (index, 0))
        self._push(0.0, TICK, None)
        self.done = []
        now, total = 0.0, trace.num_requests
        while self._events:
            now, _, kind, payload = heapq.heappop(self._events)
            if kind == ARRIVE:
                session, turn = cast(tuple[int, int], payload)
                self._arrive(trace, session, turn, now)
            elif kind == STEP:
                name, version = cast(tuple[str, int], payload)
                self._step(self.instances[name], version, now)
            elif kind == ENQUEUE:
                self._enqueue(cast(SimRequest, payload), now)
            elif kind == REPORT:
                self._report(*cast(tuple[list[SimRequest], list[SimRequest]], payload), now)
            elif kind == DISPATCH:
                self._dispatch_at = None
                self._dispatch(now)
            elif kind == TICK and (self._outstanding or len(self.done) < total):
                self.policy.tick(now)
                self._dispatch(now)
                self._push(now + self.tick_s, TICK, None)
        return self._result(trace, rate, self.done, now)

    def _arrive(self, trace: Trace, session: int, turn: int, now: float) -> None:
        t = trace.sessions[session][turn]
        request = SimRequest(f"s{session}t{turn}", t.prompt_len, t.output_len, t.prompt_hashes, t.cache_hashes,
                             t.key, now, session, turn)
        self._requests[request.request_id] = request
        self._outstanding += 1
        self.policy.submit(RouteRequest(request.request_id, t.prompt_hashes, t.prompt_len, t.key, now), now)
        self._want_dispatch(now)

    def _want_dispatch(self, now: float) -> None:
        if not self.late_binding:
            self._dispatch(now)
        elif self._dispatch_at is None:
            self._dispatch_at = now + self.quantum
            self._push(self._dispatch_at, DISPATCH, None)

    def _dispatch(self, now: float) -> None:
        """Send the policy's assignments; each reaches its replica `dispatch_delay_s` later."""
        for request_id, backend in self.policy.dispatch(now):
            request = self._requests[request_id]
            request.backend = backend
            if self.model.dispatch_delay_s > 0:
                self._push(now + self.model.dispatch_delay_s, ENQUEUE, request)
            else:
                self._enqueue(request, now)

    def _enqueue(self, request: SimRequest, now: float) -> None:
        instance = self.instances[request.backend]
        end = instance.enqueue(request, now)
        if end is not None:
            self._push(end, STEP, (request.backend, instance.version))

    def _step(self, instance: Instance, version: int, now: float) -> None:
        if version != instance.version:
            return  # replaced by a cut stretch or a restart
        first, finished = instance.complete(now)
        end = instance.start(now)
        if end is not None:
            self._push(end, STEP, (instance.name, instance.version))
        if not (first or finished):
            return
        if self.model.report_delay_s > 0:
            self._push(now + self.model.report_delay_s, REPORT, (first, finished))
        else:
            self._report(first, finished, now)

    def _report(self, first: list[SimRequest], finished: list[SimRequest], now: float) -> None:
        """The router (and the client) see first tokens and finishes: TTFTs end here, next turns start."""
        for request in first:
            request.first_token = now
            self.policy.on_first_token(request.request_id, now)
        for request in finished:
            request.finish = now
            self.policy.on_finished(request.request_id, now)
            del self._requests[request.request_id]
            self._outstanding -= 1
            self.done.append(request)
            trace = cast(Trace, self._trace)
            if trace.arrival_times is None and request.turn + 1 < len(trace.sessions[request.session]):
                gap = float(self._thinks[self._think_at[request.session] + request.turn])
                self._push(now + gap, ARRIVE, (request.session, request.turn + 1))
        self._want_dispatch(now)

    def _result(self, trace: Trace, rate: float, done: list[SimRequest], now: float) -> RunResult:
        ttft = np.array([r.first_token - r.arrival for r in done])  # type: ignore[operator]
        itl = [(r.finish - r.first_token) / (r.output_len - 1) for r in done if r.output_len > 1]  # type: ignore
        prompt = sum(r.prompt_len for r in done)
        busy = np.array([i.busy_seconds for i in self.instances.values()])
        migrations = sum(getattr(self.policy, "migrations", {}).values())
        p50, p90, p99 = np.percentile(ttft, [50, 90, 99]).tolist()
        return RunResult(self.policy.name, trace.name, len(self.instances), rate, len(done),
                         float(np.mean(ttft <= self.slo_s)), float(ttft.mean()), p50, p90, p99,
                         float(np.mean(itl)) if itl else 0.0, sum(r.hit_tokens for r in done) / max(prompt, 1),
                         float(busy.max() / max(busy.mean(), 1e-12)), migrations, now)


def simulate(model: EngineModel, trace: Trace, num_instances: int, policy: str, rate: float,
             slo_s: float = 1.0, seed: int = 0) -> RunResult:
    return Simulator(model, num_instances, policy, slo_s, seed).run(trace, rate)
