"""Measure the HTTP path between router and replicas, which the simulator models as two delays.

From the router's and the engines' own histograms (sums and counts, so any stretch of
traffic can be measured as the difference of two scrapes):

    http     = mean `threefold:router_backend_first_token_seconds` (dispatch -> first token event)
               - mean `vllm:time_to_first_token_seconds` (the engine's own: submitted -> first token)
    dispatch = min(http, mean `threefold:router_backend_accept_seconds`)
               (dispatch -> the backend's response headers, sent once the request is submitted)
    report   = http - dispatch

`http` is everything the router sees of a backend's TTFT that its engine does not: the
request's way in (HTTP, parsing, chat template, tokenizing) and the first token's way
out (output processor, detokenizing, the SSE event, HTTP). The headers mark the split;
they can trail the submission (the server's event loop shares the replica's core with
the engine's steps), hence the min. `probe` measures them on idle replicas with short
streamed requests sent one at a time through a router.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from threefold.sim.engine_model import EngineModel

ACCEPT = "threefold:router_backend_accept_seconds"
FIRST_TOKEN = "threefold:router_backend_first_token_seconds"
ENGINE_TTFT = "vllm:time_to_first_token_seconds"


@dataclass(frozen=True)
class Scrape:
    """(sum, count) of each histogram, over all label sets and all the scraped servers."""

    totals: dict[str, tuple[float, float]]

    def mean_since(self, earlier: Scrape, name: str) -> float | None:
        total, count = self.totals.get(name, (0.0, 0.0))
        total0, count0 = earlier.totals.get(name, (0.0, 0.0))
        return (total - total0) / (count - count0) if count > count0 else None


@dataclass(frozen=True)
class Delays:
    dispatch_s: float
    report_s: float
    requests: int

    def apply(self, model: EngineModel) -> EngineModel:
        """The engine model with these delays."""
        return dataclasses.replace(model, dispatch_delay_s=self.dispatch_s, report_delay_s=self.report_s)


def scrape(router_url: str, backend_urls: list[str]) -> Scrape:
    totals: dict[str, tuple[float, float]] = {}
    for url in (router_url, *backend_urls):
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            if family.name not in (ACCEPT, FIRST_TOKEN, ENGINE_TTFT):
                continue
            total, count = totals.get(family.name, (0.0, 0.0))
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
            totals[family.name] = (total, count)
    return Scrape(totals)


def delays_between(before: Scrape, after: Scrape) -> Delays | None:
    """The delays over the streamed requests served between two scrapes; None without any."""
    accept, first, engine = (after.mean_since(before, name) for name in (ACCEPT, FIRST_TOKEN, ENGINE_TTFT))
    if accept is None or first is None or engine is None:
        return None
    count = after.totals[FIRST_TOKEN][1] - before.totals.get(FIRST_TOKEN, (0.0, 0.0))[1]
    http = max(0.0, first - engine)
    dispatch = min(http, accept)
    return Delays(dispatch, http - dispatch, int(count))


def probe(router_url: str, backend_urls: list[str], model: str, num_requests: int = 8) -> Delays:
    """Short streamed chat requests, one at a time (idle replicas), each with fresh text (no cache hits)."""
    before = scrape(router_url, backend_urls)
    with httpx.Client(timeout=120) as client:
        for _ in range(num_requests):
            body = {"model": model, "max_tokens": 2, "temperature": 0, "stream": True,
                    "messages": [{"role": "user", "content": f"Say something about {uuid.uuid4().hex}."}]}
            with client.stream("POST", f"{router_url}/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                for _ in response.iter_lines():
                    pass
    delays = delays_between(before, scrape(router_url, backend_urls))
    if delays is None:
        raise RuntimeError("no streamed request was measured: are these threefold router and serve URLs?")
    return delays
