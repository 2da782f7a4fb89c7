"""The Ledger: finished requests' entries over a time window, totals by technique, and money.

Entries live in a bounded ring buffer (the oldest drop first), so a window
longer than the buffer covers fewer requests: `totals()` says how many it summed
and since when. Money is `cost_per_hour` spread over the estimated compute
seconds: cost per million tokens with every technique on, and with each one
off (its saved seconds added back). A technique the server does not run is
absent from the totals, never shown as zero savings.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from threefold.errors import ThreefoldError
from threefold.ledger.entry import TIER_PREFIX, CostBasis, LedgerEntry

DEFAULT_CAPACITY = 100_000
MAX_WINDOW_S = 7 * 24 * 3600.0


def check_cost_per_hour(value: float | None) -> float | None:
    if value is not None and (not math.isfinite(value) or value < 0):
        raise ThreefoldError(f"cost_per_hour must be a finite price >= 0, got {value!r}.", param="cost_per_hour")
    return value


def parse_window(text: str | None) -> float:
    """A window in seconds (query parameter text); a clear error for anything else."""
    if text is None:
        return MAX_WINDOW_S
    try:
        window = float(text)
    except ValueError:
        raise ThreefoldError(f"window must be a number of seconds, got {text!r}.", param="window") from None
    if not math.isfinite(window) or not 0 < window <= MAX_WINDOW_S:
        raise ThreefoldError(f"window must be in (0, {MAX_WINDOW_S:.0f}] seconds, got {text!r}.", param="window")
    return window


class Ledger:
    """Thread-safe: the engine thread adds entries, HTTP handlers read totals."""

    def __init__(self, basis: CostBasis, cost_per_hour: float | None = None,
                 capacity: int = DEFAULT_CAPACITY) -> None:
        self.basis = basis
        self.cost_per_hour = check_cost_per_hour(cost_per_hour)
        self._entries: deque[LedgerEntry] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._tiers: set[str] = set()

    def add(self, entry: LedgerEntry) -> None:
        with self._lock:
            self._entries.append(entry)
            self._tiers.update(entry.prompt_tokens_by_tier or ())

    @property
    def techniques(self) -> tuple[str, ...]:
        """What this server runs: its configured techniques, then every tier that has reported."""
        return self.basis.techniques + tuple(TIER_PREFIX + t for t in sorted(self._tiers))

    def entries(self, window_s: float, now: float | None = None) -> list[LedgerEntry]:
        since = (time.time() if now is None else now) - window_s
        with self._lock:
            return [e for e in self._entries if e.finished_time >= since]

    def totals(self, window_s: float, technique: str | None = None, now: float | None = None) -> dict:
        """Sums over the window, per technique; `technique` narrows the answer to one (400 if unknown)."""
        techniques = self.techniques
        if technique is not None and technique not in techniques:
            raise ThreefoldError(f"unknown technique {technique!r}; this server runs: "
                                 f"{', '.join(techniques) or 'none'}.", param="technique")
        entries = self.entries(window_s, now)
        tokens = {"prompt": sum(e.prompt_tokens for e in entries),
                  "prompt_computed": sum(e.prompt_tokens_computed for e in entries),
                  "prompt_prefix_cache": sum(e.prompt_tokens_prefix_cache for e in entries),
                  "output": sum(e.output_tokens for e in entries),
                  "output_from_accepted_drafts": sum(e.output_tokens_from_drafts for e in entries),
                  "drafts_rejected": sum(e.draft_tokens_rejected for e in entries)}
        compute = sum(e.compute_s for e in entries)
        chosen = techniques if technique is None else (technique,)
        by_technique = {name: self._technique(name, entries, compute, tokens) for name in chosen}
        return {"object": "ledger", "window_s": window_s, "num_requests": len(entries),
                "kv_cache_dtype": self.basis.kv_cache_dtype, "cost_per_hour": self.cost_per_hour,
                "tokens": tokens, "kv": {"bytes": sum(e.kv_bytes for e in entries),
                                         "bytes_at_model_dtype": sum(e.kv_bytes_at_dtype for e in entries)},
                "compute_s": compute, "cost_per_million_tokens": self._per_million(compute, tokens),
                "by_technique": by_technique}

    def _technique(self, name: str, entries: list[LedgerEntry], compute: float, tokens: dict) -> dict:
        saved = sum(e.saved_s.get(name, 0.0) for e in entries)
        row: dict = {"saved_s": saved, "cost_per_million_tokens_without": self._per_million(compute + saved, tokens)}
        if name.startswith(TIER_PREFIX):
            tier = name[len(TIER_PREFIX):]
            row["prompt_tokens"] = sum((e.prompt_tokens_by_tier or {}).get(tier, 0) for e in entries)
        elif name == "prefix_cache":
            row["prompt_tokens"] = tokens["prompt_prefix_cache"]
        elif name == "speculation":
            row["output_tokens"] = tokens["output_from_accepted_drafts"]
            row["drafts_rejected"] = tokens["drafts_rejected"]
        else:  # kv_codec saves memory (capacity), not compute time
            row["kv_bytes_saved"] = sum(e.kv_bytes_at_dtype - e.kv_bytes for e in entries)
        return row

    def _per_million(self, seconds: float, tokens: dict) -> dict | None:
        """Price per million tokens (prompt + output, and output alone), None without a price or tokens."""
        if self.cost_per_hour is None:
            return None
        money = self.cost_per_hour * seconds / 3600.0
        total = tokens["prompt"] + tokens["output"]
        return {"total_tokens": money * 1e6 / total if total else None,
                "output_tokens": money * 1e6 / tokens["output"] if tokens["output"] else None}
