"""Routes of the savings ledger and the live dashboard.

GET /v1/ledger?window=S&technique=T   totals over the last S seconds, by technique (400 on bad input)
GET /dashboard                        one static page (uPlot, vendored under static/; no external URL)
GET /dashboard/data                   the page's numbers, read from the /metrics registry (so they match it)
"""

from __future__ import annotations

import time
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client.metrics_core import Metric

from threefold.ledger import parse_window
from threefold.server.errors import ServerError
from threefold.server.serving_common import ServerState

STATIC_FILES = {"uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css", "uPlot.LICENSE": "text/plain",
                "dashboard_common.js": "text/javascript", "dashboard.css": "text/css",
                "dashboard.js": "text/javascript"}
"""The page's files; all but dashboard.js are the router's dashboard's too (router/dashboard.py names them)."""
_CSP = "default-src 'self'; style-src 'self' 'unsafe-inline'"
"""The page may load nothing but this server's own files: the browser itself enforces it."""


def add_dashboard_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/ledger")
    async def ledger(window: str | None = None, technique: str | None = None) -> dict:
        if state.ledger is None:
            raise ServerError("This server's engine keeps no savings ledger.", 404)
        return state.ledger.totals(parse_window(window), technique)

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return Response(_static("dashboard.html"), media_type="text/html", headers={"content-security-policy": _CSP})

    @app.get("/dashboard/static/{name}")
    async def static(name: str) -> Response:
        if name not in STATIC_FILES:
            raise ServerError(f"No dashboard file {name!r}.", 404)
        return Response(_static(name), media_type=STATIC_FILES[name])

    @app.get("/dashboard/data")
    async def data() -> dict:
        return dashboard_data(state)


def _static(name: str) -> bytes:
    return resources.files("threefold.server").joinpath("static", name).read_bytes()


def dashboard_data(state: ServerState) -> dict:
    """Counters and gauges as /metrics has them at this moment, plus the rates derived from them."""
    model = state.config.model_name
    # One pass over every collector (engine, KV offload, ledger): get_sample_value would run them all per call.
    metrics = list(state.metrics.registry.collect())
    samples = {(s.name, frozenset(s.labels.items())): s.value for metric in metrics for s in metric.samples}

    def value(name: str, **labels: str) -> float:
        return samples.get((name, frozenset({"model_name": model, **labels}.items()))) or 0.0

    queries, hits = value("vllm:prefix_cache_queries_total"), value("vllm:prefix_cache_hits_total")
    drafts = value("vllm:spec_decode_num_draft_tokens_total")
    accepted = value("vllm:spec_decode_num_accepted_tokens_total")
    data: dict = {"time": time.time(), "model": model,
                  "generation_tokens": value("vllm:generation_tokens_total"),
                  "prompt_tokens": value("vllm:prompt_tokens_total"),
                  "running": value("vllm:num_requests_running"), "waiting": value("vllm:num_requests_waiting"),
                  "kv_usage": value("vllm:kv_cache_usage_perc"), "kv_codec": _kv_codec(metrics),
                  "prefix_cache_queries": queries, "prefix_cache_hits": hits,
                  "prefix_hit_rate": hits / queries if queries else None,
                  "spec_draft_tokens": drafts, "spec_accepted_tokens": accepted,
                  "draft_acceptance": accepted / drafts if drafts else None, "ledger": None,
                  "kv_tiers": _kv_tiers(metrics)}
    if state.ledger is not None:
        saved = {t: value("threefold:ledger_saved_seconds_total", technique=t)
                 - value("threefold:ledger_lost_seconds_total", technique=t) for t in state.ledger.techniques}
        data["ledger"] = {"requests": value("threefold:ledger_requests_total"),
                          "compute_s": value("threefold:ledger_compute_seconds_total"), "saved_s": saved}
    return data


_TIER_FIELDS = {"threefold:kv_offload_used_bytes": "used_bytes",
                "threefold:kv_offload_capacity_bytes": "capacity_bytes",
                "threefold:kv_offload_hit_tokens_total": "hit_tokens",
                "threefold:kv_offload_writes_total": "writes"}
"""The KV offload collector's samples the page shows per tier (Redis reports no used bytes)."""


def _kv_tiers(metrics: list[Metric]) -> dict[str, dict[str, float]]:
    """Per KV offload tier (cpu, disk, redis): bytes held, its size, blocks written, prompt tokens it served."""
    tiers: dict[str, dict[str, float]] = {}
    for metric in metrics:
        if not metric.name.startswith("threefold:kv_offload_"):
            continue
        for sample in metric.samples:
            field = _TIER_FIELDS.get(sample.name)
            if field is not None and "tier" in sample.labels:
                tiers.setdefault(sample.labels["tier"], {})[field] = sample.value
    return tiers


def _kv_codec(metrics: list[Metric]) -> str | None:
    for metric in metrics:
        if metric.name == "vllm:cache_config_info":
            return next((s.labels.get("kv_cache_dtype") for s in metric.samples), None)
    return None
