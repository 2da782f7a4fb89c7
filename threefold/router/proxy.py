"""The router's live side: backend health, the policy pump, and forwarding one request.

Every request is keyed (prompt tokens -> RouteRequest), submitted to the policy and
parked on a future until `dispatch` binds it to a backend (at once, or later under
DualMap's late binding). Failures before a response starts (connection refused, a
503 with Retry-After) re-route the request; a stream that breaks after it started
ends with an OpenAI-shaped error event and `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from threefold.errors import ThreefoldError
from threefold.router.config import RouterConfig
from threefold.router.metrics import RouterMetrics
from threefold.router.policies import NoBackendError, Policy, RouteRequest, make_policy
from threefold.server.errors import error_body

logger = logging.getLogger(__name__)
SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    health_interval_s: float = 1.0
    """How often each backend's /health (and /metrics, for its load) is polled."""
    max_attempts: int = 4
    """Tries per request before the router answers 503 itself."""
    max_retry_wait_s: float = 30.0
    """Longest Retry-After the router waits out when every backend is cooling."""
    queue_timeout_s: float = 600.0
    """Longest a request waits in the policy's queue."""


@dataclass
class BackendHealth:
    healthy: bool = True
    cooling_until: float = 0.0
    """After a 503 with Retry-After: out of the rings until then."""
    failures: list[str] = field(default_factory=list)


class Router:
    def __init__(self, backends: list[str], policy: str, config: RouterConfig, keyer: Any,
                 proxy: ProxyConfig | None = None) -> None:
        self.config, self.proxy, self.keyer = config, proxy or ProxyConfig(), keyer
        self.policy: Policy = make_policy(policy, backends, config)
        self.health = {url: BackendHealth() for url in backends}
        self.metrics = RouterMetrics(policy)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.proxy.queue_timeout_s, connect=2.0),
                                        limits=httpx.Limits(max_connections=512, max_keepalive_connections=64))
        self._waiting: dict[str, asyncio.Future[str]] = {}
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._health_loop()), asyncio.create_task(self._tick_loop())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.client.aclose()

    # ---- membership --------------------------------------------------------

    def mark_down(self, url: str, reason: str, cooling_s: float = 0.0) -> None:
        state = self.health[url]
        state.cooling_until = max(state.cooling_until, time.monotonic() + cooling_s)
        state.failures = [*state.failures[-4:], reason]
        if state.healthy:
            logger.warning("backend %s leaves the rings: %s", url, reason)
            state.healthy = False
            self.policy.remove_backend(url, time.monotonic())
            self._pump()
        if not self.policy.backends:  # nothing left to bind to: fail the parked requests now
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(NoBackendError())
            self._waiting.clear()

    def rejoin(self, url: str) -> None:
        state = self.health[url]
        if not state.healthy and time.monotonic() >= state.cooling_until:
            logger.warning("backend %s rejoins", url)
            state.healthy = True
            self.policy.add_backend(url, time.monotonic())
            self._pump()

    async def _probe(self, url: str) -> None:
        try:
            ok = (await self.client.get(f"{url}/health", timeout=2.0)).status_code == 200
            if ok:
                text = (await self.client.get(f"{url}/metrics", timeout=2.0)).text
                self.policy.observe_load(url, _backend_requests(text), time.monotonic())
        except httpx.HTTPError as exc:
            ok, reason = False, f"health check: {exc!r}"
        else:
            reason = "health check: not 200"
        if ok:
            self.rejoin(url)
        elif time.monotonic() >= self.health[url].cooling_until:
            self.mark_down(url, reason)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(url) for url in self.health))
            await asyncio.sleep(self.proxy.health_interval_s)

    async def _tick_loop(self) -> None:
        while True:
            self.policy.tick(time.monotonic())
            self._pump()
            await asyncio.sleep(0.05)

    # ---- binding -----------------------------------------------------------

    def _pump(self) -> None:
        now = time.monotonic()
        for request_id, backend in self.policy.dispatch(now):
            future = self._waiting.pop(request_id, None)
            if future is not None and not future.done():
                future.set_result(backend)
            elif future is None or future.cancelled():
                self.policy.on_finished(request_id, now)  # its client left while it queued

    async def _bind(self, request: RouteRequest) -> str:
        """Submit and wait for the policy to bind the request; waits out a Retry-After when all cool."""
        while True:
            future = asyncio.get_running_loop().create_future()
            self._waiting[request.request_id] = future
            try:
                self.policy.submit(request, time.monotonic())
            except NoBackendError:
                self._waiting.pop(request.request_id, None)
                await self._wait_for_cooling()
                continue
            self._pump()
            try:
                return await asyncio.wait_for(future, self.proxy.queue_timeout_s)
            except BaseException:
                self._waiting.pop(request.request_id, None)
                self.policy.on_finished(request.request_id, time.monotonic())
                raise

    async def _wait_for_cooling(self) -> None:
        cooling = [h.cooling_until - time.monotonic() for h in self.health.values() if not h.healthy]
        soonest = min((c for c in cooling if c > 0), default=None)
        if soonest is None or soonest > self.proxy.max_retry_wait_s:
            raise NoBackendError()
        await asyncio.sleep(soonest)
        for url in self.health:
            self.rejoin(url)

    # ---- forwarding --------------------------------------------------------

    async def forward(self, path: str, raw_body: bytes, headers: dict[str, str]) -> tuple[Any, Any]:
        """-> ("json", (status, body bytes, content type)) or ("stream", async iterator of bytes)."""
        body = _json_or_none(raw_body)
        tokens = self._tokens(path, body)
        stream = isinstance(body, dict) and bool(body.get("stream"))
        arrival, base_id = time.monotonic(), uuid.uuid4().hex
        last_error = "no backend answered"
        for attempt in range(self.proxy.max_attempts):
            request = RouteRequest.from_tokens(f"{base_id}-{attempt}", tokens, self.config, arrival)
            backend = await self._bind(request)
            hit = self.policy.routed_hit_tokens(request.request_id)
            self.metrics.routed(backend, len(tokens), hit, time.monotonic() - arrival)
            upstream = self.client.build_request("POST", backend + path, content=raw_body, headers=headers)
            sent = time.monotonic()
            try:
                response = await self.client.send(upstream, stream=True)
            except httpx.HTTPError as exc:
                last_error = self._failed(request, backend, f"connect: {exc!r}")
                continue
            self.metrics.backend_accept.labels(self.metrics.policy, backend).observe(time.monotonic() - sent)
            if response.status_code == 503:
                await response.aclose()
                retry_after = _retry_after(response.headers.get("retry-after"))
                last_error = self._failed(request, backend, "503", cooling_s=retry_after)
                continue
            if stream and response.status_code == 200:
                return "stream", self._relay(request, backend, response, arrival, sent)
            try:
                content = await response.aread()
            except httpx.HTTPError as exc:  # nothing reached the client yet: safe to retry elsewhere
                last_error = self._failed(request, backend, f"read: {exc!r}")
                continue
            self._done(request, backend, arrival, first_token=True)
            return "json", (response.status_code, content, response.headers.get("content-type"))
        raise ThreefoldError(f"No backend could serve the request ({last_error}).", status_code=503)

    def _tokens(self, path: str, body: Any) -> list[int]:
        if not isinstance(body, dict):
            return []  # malformed: any backend answers with the server's own 4xx
        try:
            return self.keyer.token_ids(path, body)
        except (ThreefoldError, TypeError, ValueError, AttributeError):  # the backend answers with its own 4xx
            return []

    def _failed(self, request: RouteRequest, backend: str, reason: str, cooling_s: float = 0.0) -> str:
        self.policy.on_finished(request.request_id, time.monotonic())
        self.metrics.retries.labels(self.metrics.policy, backend, reason.split(":")[0]).inc()
        self.mark_down(backend, reason, cooling_s)
        return f"{backend}: {reason}"

    def _done(self, request: RouteRequest, backend: str, arrival: float, first_token: bool) -> None:
        now = time.monotonic()
        if first_token:  # a non-streamed answer: its "first token" came with the last one (not a TTFT)
            self.policy.on_first_token(request.request_id, now, measured=False)
        self.metrics.latency.labels(self.metrics.policy, backend).observe(now - arrival)
        self.policy.on_finished(request.request_id, now)
        self._pump()

    async def _relay(self, request: RouteRequest, backend: str, response: httpx.Response,
                     arrival: float, sent: float) -> AsyncIterator[bytes]:
        """Pass whole SSE events through as they arrive; a broken backend ends the stream cleanly."""
        buffer, started, done = b"", False, False
        try:
            async for chunk in response.aiter_raw():
                buffer += chunk
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    if not started and b'"role"' not in event:  # the first token, not the role chunk
                        started, now = True, time.monotonic()
                        self.policy.on_first_token(request.request_id, now)
                        self.metrics.ttft.labels(self.metrics.policy, backend).observe(now - arrival)
                        self.metrics.backend_first_token.labels(self.metrics.policy, backend).observe(now - sent)
                        self._pump()
                    done = done or event.strip() == SSE_DONE.strip()
                    yield event + b"\n\n"
            if not done:
                raise httpx.RemoteProtocolError("stream ended without [DONE]")
        except httpx.HTTPError as exc:
            self.metrics.stream_errors.labels(self.metrics.policy, backend).inc()
            self.mark_down(backend, f"stream: {exc!r}")
            message = f"The backend serving this stream failed: {exc!r}."
            yield f"data: {json.dumps(error_body(message, 502))}\n\n".encode() + SSE_DONE
        finally:
            await response.aclose()
            self._done(request, backend, arrival, first_token=False)

    def state(self) -> dict:
        snapshot = self.policy.snapshot()
        now = time.monotonic()
        return {"policy": self.policy.name, "backends": {
            url: {"healthy": h.healthy, "cooling_s": round(max(0.0, h.cooling_until - now), 3),
                  "recent_failures": h.failures, **snapshot.get(url, {})} for url, h in self.health.items()}}


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _retry_after(value: str | None) -> float:
    with contextlib.suppress(TypeError, ValueError):
        return max(0.0, float(value))  # type: ignore[arg-type]
    return 1.0


def _backend_requests(metrics_text: str) -> int:
    """running + waiting from a backend's vLLM-named gauges (0 when absent)."""
    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            total += sum(sample.value for sample in family.samples)
    return int(total)
