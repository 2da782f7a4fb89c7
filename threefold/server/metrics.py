"""Prometheus metrics under vLLM's names, so vLLM dashboards and benchmarks read them as-is.

One CollectorRegistry per server (tests run several servers in one process).
Counters are exposed with prometheus' `_total` suffix, as vLLM's are:
`vllm:prompt_tokens_total`, `vllm:request_success_total{finished_reason=...}`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from threefold.engine.async_engine import StatLogger
from threefold.engine.outputs import RequestOutput

# vLLM's buckets (vllm/v1/metrics/loggers.py), so histograms compare bucket for bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class _Tracked:
    """What the metrics remember about one live request (engine thread only)."""

    arrival_time: float
    num_tokens: int = 0
    last_token_time: float | None = None


class ServerMetrics(StatLogger):
    """Engine gauges and counters, plus per-request latency histograms, fed from the engine thread."""

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no `*_created` series, as in vLLM (a process-wide switch)
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, ["model_name"], registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, ["model_name"], registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._model_name = model_name
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self._spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.", ["model_name", "position"],
                                     registry=self.registry)
        # Hybrid scheduling: queues and preemptions by request class (online | offline), offline work done.
        by_class = ["model_name", "request_class"]
        self._running_by_class = Gauge("threefold:num_requests_running_by_class", "Running requests by class.",
                                       by_class, registry=self.registry)
        self._waiting_by_class = Gauge("threefold:num_requests_waiting_by_class", "Waiting requests by class.",
                                       by_class, registry=self.registry)
        preemptions = Counter("threefold:num_preemptions_by_class", "Cumulative preemptions by request class.",
                              by_class, registry=self.registry)
        self.offline_tokens = counter("threefold:offline_tokens",
                                      "Tokens computed for offline (batch) requests, prefill and decode.")
        self._tracked: dict[str, _Tracked] = {}
        self._cumulative = [
            ("prefix_cache_queries", self.prefix_queries), ("prefix_cache_hits", self.prefix_hits),
            ("num_preemptions", self.preemptions), ("spec_num_drafts", self.spec_drafts),
            ("spec_num_draft_tokens", self.spec_draft_tokens), ("spec_num_accepted_tokens", self.spec_accepted),
            ("offline_tokens", self.offline_tokens),
            ("num_preemptions_online", preemptions.labels(model_name, "online")),
            ("num_preemptions_offline", preemptions.labels(model_name, "offline"))]
        self._last_cumulative = dict.fromkeys((name for name, _ in self._cumulative), 0)
        self._last_per_pos: list[int] = []

    def set_cache_config(self, info: dict) -> None:
        """The KV pool's configuration: vLLM's info-style gauge (value 1, the config in its
        labels, kv_cache_dtype among them) plus threefold: gauges of its size; for a per-layer
        mix one info gauge per layer, and for a guard: spec its budget and measured KL."""
        scalars = {k: v for k, v in info.items() if not isinstance(v, (list, dict))}
        labels = {"model_name": self._model_name, **{k: str(v) for k, v in scalars.items()}}
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(labels),
              registry=self.registry).labels(**labels).set(1)
        for key, doc in (("bytes_per_token", "KV-cache bytes per token, all layers, everything stored."),
                         ("capacity_tokens", "Tokens the KV pool holds.")):
            Gauge(f"threefold:kv_cache_{key}", doc, ["model_name", "kv_cache_dtype"],
                  registry=self.registry).labels(self._model_name, info["kv_cache_dtype"]).set(info[key])
        if "layer_codecs" in info:
            layers = Gauge("threefold:kv_cache_layer_codec_info", "Codec of each layer in a per-layer KV mix (1).",
                           ["model_name", "layer", "codec"], registry=self.registry)
            for layer, codec in enumerate(info["layer_codecs"]):
                layers.labels(self._model_name, str(layer), codec).set(1)
        if "kv_guard" in info:
            guard = info["kv_guard"]
            kl = Gauge("threefold:kv_guard_kl", "KV quality guard: KL vs auto in nats/token (budget, predicted as "
                       "the sum of the layers', measured on the whole mix) on the calibration text.",
                       ["model_name", "guard", "kind"], registry=self.registry)
            for kind in ("budget", "predicted_kl", "measured_kl"):
                kl.labels(self._model_name, guard["guard"], kind.removesuffix("_kl")).set(guard[kind])

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- StatLogger (engine thread) --------------------------------------

    def on_added(self, request_id: str, arrival_time: float) -> None:
        self._tracked[request_id] = _Tracked(arrival_time)

    def on_step(self, stats: Any, outputs: Sequence[RequestOutput], now: float) -> None:
        self._record_engine_stats(stats)
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is not None:
                self._record_output(tracked, output, now)

    def on_aborted(self, request_ids: Sequence[str], now: float) -> None:
        for request_id in request_ids:
            tracked = self._tracked.pop(request_id, None)
            if tracked is not None:
                self._finish(tracked, "abort", now, None)

    # ---- helpers -----------------------------------------------------------

    def _record_engine_stats(self, stats: Any) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        for gauge, total, offline in (
                (self._running_by_class, stats.num_running, getattr(stats, "num_running_offline", 0)),
                (self._waiting_by_class, stats.num_waiting, getattr(stats, "num_waiting_offline", 0))):
            gauge.labels(self._model_name, "online").set(total - offline)
            gauge.labels(self._model_name, "offline").set(offline)
        # The engine reports cumulative totals; prometheus counters want increments.
        for name, metric in self._cumulative:
            total = getattr(stats, name, 0)
            if total > self._last_cumulative[name]:
                metric.inc(total - self._last_cumulative[name])
            self._last_cumulative[name] = total
        self._record_per_pos(getattr(stats, "spec_num_accepted_tokens_per_pos", None) or [])

    def _record_per_pos(self, per_pos: list[int]) -> None:
        for position, total in enumerate(per_pos):
            last = self._last_per_pos[position] if position < len(self._last_per_pos) else 0
            if total > last:
                self._spec_per_pos.labels(model_name=self._model_name, position=str(position)).inc(total - last)
        self._last_per_pos = list(per_pos)

    def _record_output(self, tracked: _Tracked, output: RequestOutput, now: float) -> None:
        new_tokens = sum(len(c.token_ids) for c in output.outputs)  # outputs are deltas
        if new_tokens > 0:
            if tracked.last_token_time is None:
                self.prompt_tokens.inc(len(output.prompt_token_ids))
                first = output.metrics.first_token_time if output.metrics else None
                self.ttft.observe(max(0.0, (first or now) - tracked.arrival_time))
            else:
                self.itl.observe(max(0.0, now - tracked.last_token_time))
            self.generation_tokens.inc(new_tokens)
            tracked.num_tokens += new_tokens
            tracked.last_token_time = now
        if output.finished:
            del self._tracked[output.request_id]
            reason = "error" if output.error else (output.outputs[0].finish_reason or "stop")
            self._finish(tracked, reason, now, output)

    def _finish(self, tracked: _Tracked, reason: str, now: float, output: RequestOutput | None) -> None:
        self._success.labels(model_name=self._model_name, finished_reason=reason).inc()
        self.e2e.observe(max(0.0, now - tracked.arrival_time))
        metrics = output.metrics if output is not None else None
        if metrics is not None and metrics.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, metrics.first_scheduled_time - tracked.arrival_time))
        elif tracked.last_token_time is None:
            self.queue_time.observe(max(0.0, now - tracked.arrival_time))  # never left the queue
