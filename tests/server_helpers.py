"""Helpers shared by the server tests: reading /metrics and waiting on a condition."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metrics(url: str) -> dict[str, float]:
    """Every sample as 'name' or 'name{label=value,...}' -> value (labels sorted, model_name dropped)."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def wait_for(predicate, timeout_s: float = 20.0, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(poll_s)
