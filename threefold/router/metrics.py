"""The router's Prometheus metrics, `threefold:router_*`, labelled by policy and backend."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

DELAY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TTFT_BUCKETS = (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class RouterMetrics:
    """One registry per router (tests run several in one process)."""

    def __init__(self, policy: str) -> None:
        disable_created_metrics()  # no `*_created` series (as the server)
        self.policy = policy
        self.registry = CollectorRegistry()
        labels = ["policy", "backend"]
        reg = self.registry
        self.requests = Counter("threefold:router_requests", "Requests sent to a backend.", labels, registry=reg)
        self.hit_tokens = Counter("threefold:router_prefix_hit_tokens",
                                  "Prompt tokens the router expected cached at the chosen backend.", labels,
                                  registry=reg)
        self.prompt_tokens = Counter("threefold:router_prompt_tokens", "Prompt tokens routed.", labels, registry=reg)
        self.retries = Counter("threefold:router_retries", "Requests re-routed before they started.",
                               [*labels, "reason"], registry=reg)
        self.stream_errors = Counter("threefold:router_stream_errors",
                                     "Started streams cut off by a failing backend.", labels, registry=reg)
        self.migrations = Gauge("threefold:router_migrations", "Queued requests moved off a hotspot (DualMap).",
                                labels, registry=reg)
        self.healthy = Gauge("threefold:router_backend_healthy", "1 while the backend is in the rings.", labels,
                             registry=reg)
        self.ttft = Histogram("threefold:router_time_to_first_token_seconds",
                              "TTFT of streamed requests through the router: arrival to the first token's event.",
                              labels, buckets=TTFT_BUCKETS, registry=reg)
        self.latency = Histogram("threefold:router_request_latency_seconds",
                                 "Arrival at the router to the end of the answer, streamed or not.", labels,
                                 buckets=TTFT_BUCKETS, registry=reg)
        self.backend_accept = Histogram(
            "threefold:router_backend_accept_seconds",
            "Dispatch until the backend's response headers (HTTP, parsing, tokenizing, joining the engine's queue).",
            labels, buckets=DELAY_BUCKETS, registry=reg)
        self.backend_first_token = Histogram(
            "threefold:router_backend_first_token_seconds",
            "Dispatch until the backend's first token event (streams): its TTFT plus the HTTP path both ways.",
            labels, buckets=TTFT_BUCKETS, registry=reg)
        self.queue_time = Histogram("threefold:router_queue_time_seconds",
                                    "Seconds from arrival at the router to dispatch to a backend.", ["policy"],
                                    buckets=TTFT_BUCKETS, registry=reg)

    def routed(self, backend: str, prompt_tokens: int, hit_tokens: int, queued_s: float) -> None:
        self.requests.labels(self.policy, backend).inc()
        self.prompt_tokens.labels(self.policy, backend).inc(prompt_tokens)
        self.hit_tokens.labels(self.policy, backend).inc(hit_tokens)
        self.queue_time.labels(self.policy).observe(queued_s)

    def render(self, snapshot: dict[str, dict], health: dict[str, bool]) -> bytes:
        for backend, healthy in health.items():
            self.healthy.labels(self.policy, backend).set(1 if healthy else 0)
            self.migrations.labels(self.policy, backend).set(snapshot.get(backend, {}).get("migrations", 0))
        return generate_latest(self.registry)
