"""The server's savings ledger: built at startup, fed from the engine thread, read by /v1/ledger,
the opt-in `usage.threefold_ledger` extension, /metrics (`threefold:ledger_*`) and the dashboard.

The pricing basis (cost model, bytes per token) comes from threefold.engine.ledger_basis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from threefold.engine.async_engine import StatLogger
from threefold.engine.ledger_basis import cost_basis
from threefold.engine.outputs import RequestOutput
from threefold.ledger import Ledger, LedgerEntry, make_entry

TIERS_ATTRIBUTE = "cached_tokens_by_tier"
"""RequestOutput's tier -> prompt tokens it served ("pool" = the L1 prefix cache; "cpu", "disk", "redis" = the
KV offload tiers); None when no offload tier served any (then `num_cached_tokens` is all L1)."""


def build_ledger(engine: Any, cost_per_hour: float | None) -> Ledger | None:
    """The ledger of a loaded LLMEngine (None for an engine without a model runner to price with)."""
    basis = cost_basis(engine)
    return None if basis is None else Ledger(basis, cost_per_hour)


def entry_of(ledger: Ledger, output: RequestOutput, num_output_tokens: int, now: float = 0.0) -> LedgerEntry:
    """The ledger entry of a finished request; `num_output_tokens` counts all its completions' tokens."""
    by_tier = getattr(output, TIERS_ATTRIBUTE, None) or {}
    tiers = {tier: n for tier, n in by_tier.items() if tier != "pool"} or None
    l1_hits = output.num_cached_tokens - sum((tiers or {}).values())  # num_cached_tokens counts every tier
    return make_entry(ledger.basis, len(output.prompt_token_ids), num_output_tokens, l1_hits,
                      output.num_draft_tokens, output.num_accepted_tokens, tiers, finished_time=now)


def usage_extension(ledger: Ledger | None, finals: Sequence[RequestOutput], num_tokens: Sequence[int]) -> dict:
    """`usage.threefold_ledger`: the entries of an HTTP request's engine requests, summed."""
    assert ledger is not None
    entries = [entry_of(ledger, o, n) for o, n in zip(finals, num_tokens, strict=True)]
    return _sum_dicts([e.to_dict() for e in entries])


def _sum_dicts(dicts: list[dict]) -> dict:
    total: dict = {}
    for d in dicts:
        for key, value in d.items():
            if isinstance(value, dict):
                total[key] = _sum_dicts([total.get(key, {}), value])
            else:
                total[key] = total.get(key, 0) + value
    return total


class LedgerRecorder(StatLogger):
    """Adds every finished (not aborted, not failed) request's entry to the ledger; counts into /metrics."""

    def __init__(self, ledger: Ledger, registry: CollectorRegistry, model_name: str) -> None:
        self.ledger = ledger
        self._output_tokens: dict[str, int] = {}

        def counter(name: str, doc: str, label: str | None = None) -> Any:
            labels = ["model_name"] + ([label] if label else [])
            metric = Counter(f"threefold:ledger_{name}", doc, labels, registry=registry)
            return metric.labels(model_name=model_name) if label is None else (lambda v: metric.labels(model_name, v))

        self.requests = counter("requests", "Finished requests in the savings ledger.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens by source (computed, prefix_cache, "
                                     "kv_tier:<tier>).", "source")
        self.output_tokens = counter("output_tokens", "Output tokens by source (computed, accepted_drafts).",
                                     "source")
        self.drafts_rejected = counter("drafts_rejected", "Speculative draft tokens rejected.")
        self.kv_bytes = counter("kv_bytes", "KV bytes stored under the served codec (prompt + output tokens).")
        self.kv_bytes_dtype = counter("kv_bytes_at_model_dtype", "KV bytes the same tokens take at the model dtype.")
        self.compute = counter("compute_seconds", "Estimated compute seconds used (step-cost model).")
        self.saved = counter("saved_seconds", "Estimated compute seconds saved, by technique.", "technique")
        self.lost = counter("lost_seconds", "Estimated compute seconds a technique cost beyond what it saved.",
                            "technique")

    def on_added(self, request_id: str, arrival_time: float) -> None:
        self._output_tokens[request_id] = 0

    def on_step(self, stats: Any, outputs: Sequence[RequestOutput], now: float) -> None:
        for output in outputs:
            if output.request_id not in self._output_tokens:
                continue
            self._output_tokens[output.request_id] += sum(len(c.token_ids) for c in output.outputs)  # deltas
            if output.finished:
                num_tokens = self._output_tokens.pop(output.request_id)
                if not output.error:
                    self.record(entry_of(self.ledger, output, num_tokens, now))

    def on_aborted(self, request_ids: Sequence[str], now: float) -> None:
        for request_id in request_ids:
            self._output_tokens.pop(request_id, None)

    def record(self, entry: LedgerEntry) -> None:
        self.ledger.add(entry)
        self.requests.inc()
        self.prompt_tokens("computed").inc(entry.prompt_tokens_computed)
        self.prompt_tokens("prefix_cache").inc(entry.prompt_tokens_prefix_cache)
        for tier, tokens in (entry.prompt_tokens_by_tier or {}).items():
            self.prompt_tokens(f"kv_tier:{tier}").inc(tokens)
        self.output_tokens("computed").inc(entry.output_tokens - entry.output_tokens_from_drafts)
        self.output_tokens("accepted_drafts").inc(entry.output_tokens_from_drafts)
        self.drafts_rejected.inc(entry.draft_tokens_rejected)
        self.kv_bytes.inc(entry.kv_bytes)
        self.kv_bytes_dtype.inc(entry.kv_bytes_at_dtype)
        self.compute.inc(entry.compute_s)
        for technique, seconds in entry.saved_s.items():
            # Counters only grow: net saving = saved - lost (speculation can cost more than it saves).
            self.saved(technique).inc(max(seconds, 0.0))
            self.lost(technique).inc(max(-seconds, 0.0))
