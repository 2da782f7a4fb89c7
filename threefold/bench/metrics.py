"""From per-request results to the numbers a benchmark reports.

Definitions follow vLLM's `benchmarks/serve`:
  TTFT  send -> first text chunk, per request
  TPOT  (e2e - ttft) / (output_tokens - 1), per request with 2+ tokens
  ITL   gap between consecutive text chunks, over all chunks of all requests
  E2E   send -> last byte, per request
  goodput   requests meeting every given SLO (ttft <= slo_ttft, tpot <= slo_tpot)
            per second of benchmark duration (DistServe's definition)
All times are seconds; throughputs are per second of wall-clock duration.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from threefold.bench.client import RequestResult

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    ttft: float | None = None
    """Seconds to first token a request may take and still count as good."""
    tpot: float | None = None
    """Seconds per output token (after the first) a request may take."""

    def met_by(self, result: RequestResult) -> bool:
        if not result.ok:
            return False
        if self.ttft is not None and (result.ttft is None or result.ttft > self.ttft):
            return False
        tpot = result.tpot
        return self.tpot is None or tpot is None or tpot <= self.tpot

    @property
    def given(self) -> bool:
        return self.ttft is not None or self.tpot is not None


def distribution(values: list[float]) -> dict[str, float] | None:
    """mean, std, p50/p90/p99, min, max of `values`; None when there are none."""
    if not values:
        return None
    arr = np.asarray(values, dtype=np.float64)
    stats = {"mean": float(arr.mean()), "std": float(arr.std()), "min": float(arr.min()), "max": float(arr.max())}
    for p in PERCENTILES:
        stats[f"p{p}"] = float(np.percentile(arr, p))
    return stats


def _cached_ratio(results: list[RequestResult]) -> float | None:
    """Cached prompt tokens / prompt tokens, over requests whose usage reported both."""
    reported = [r for r in results if r.ok and r.cached_tokens is not None and r.prompt_tokens]
    if not reported:
        return None
    return sum(r.cached_tokens or 0 for r in reported) / sum(r.prompt_tokens or 0 for r in reported)


def _input_tokens(result: RequestResult) -> int:
    return result.prompt_tokens if result.prompt_tokens is not None else result.prompt_len


def _errors(results: list[RequestResult]) -> dict[str, int]:
    """Error messages cut to their first 80 characters, so one cause counts as one kind."""
    return dict(Counter((r.error or "unknown")[:80] for r in results if not r.ok))


def tier_tokens(result: RequestResult) -> dict[str, int]:
    """Cached prompt tokens by where they came from: the server's own split when it gives one
    (threefold's KV tiers), else all of them from its prefix cache ("pool", i.e. L1)."""
    if result.cached_tokens_by_tier is not None:
        return dict(result.cached_tokens_by_tier)
    return {"pool": result.cached_tokens} if result.cached_tokens else {}


def tier_hit_rates(results: list[RequestResult]) -> dict[str, float] | None:
    """Share of the prompt tokens each tier served, over requests whose usage reported the cache."""
    reported = [r for r in results if r.ok and r.cached_tokens is not None and r.prompt_tokens]
    if not reported:
        return None
    total = sum(r.prompt_tokens or 0 for r in reported)
    by_tier: Counter[str] = Counter()
    for r in reported:
        by_tier.update(tier_tokens(r))
    return {tier: count / total for tier, count in sorted(by_tier.items())}


def later_turns(results: list[RequestResult]) -> dict:
    """Turns after a session's first: what a returning user waits for, and which tier served the
    history (the number the KV tiers exist to lower)."""
    group = [r for r in results if r.ok and r.turn is not None and r.turn > 0]
    return {"completed": len(group),
            "mean_prompt_tokens": float(np.mean([_input_tokens(r) for r in group])) if group else None,
            "ttft": distribution([r.ttft for r in group if r.ttft is not None]),
            "cached_token_ratio": _cached_ratio(group),
            "tier_hit_rates": tier_hit_rates(group)}


def per_turn(results: list[RequestResult]) -> list[dict]:
    """TTFT and cache hits by turn index: are later turns of a session faster?"""
    turns = sorted({r.turn for r in results if r.turn is not None})
    rows = []
    for turn in turns:
        group = [r for r in results if r.turn == turn and r.ok]
        rows.append({
            "turn": turn,
            "completed": len(group),
            "mean_prompt_tokens": float(np.mean([_input_tokens(r) for r in group])) if group else None,
            "ttft": distribution([r.ttft for r in group if r.ttft is not None]),
            "cached_token_ratio": _cached_ratio(group),
        })
    return rows


def summarize(results: list[RequestResult], duration: float, slo: SLO | None = None,
              skipped: int = 0) -> dict:
    """Everything `bench serve` prints and saves, from the raw results."""
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(_input_tokens(r) for r in done)
    duration = max(duration, 1e-9)
    summary = {
        "duration_s": duration,
        "num_requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "skipped_turns": skipped,
        "errors": _errors(results),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "input_throughput": in_tokens / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft": distribution([r.ttft for r in done if r.ttft is not None]),
        "tpot": distribution([t for r in done if (t := r.tpot) is not None]),
        "itl": distribution([gap for r in done for gap in r.itl]),
        "e2e": distribution([r.e2e for r in done if r.e2e is not None]),
        "cached_token_ratio": _cached_ratio(done),
        "tier_hit_rates": tier_hit_rates(done),
        "goodput": None,
        "slo_attainment": None,
    }
    if slo is not None and slo.given:
        good = sum(slo.met_by(r) for r in results)
        summary["goodput"] = good / duration
        summary["slo_attainment"] = good / len(results) if results else None
    if any(r.turn is not None for r in results):
        summary["per_turn"] = per_turn(results)
        summary["later_turns"] = later_turns(results)
    return summary


def format_summary(summary: dict) -> str:
    """A short human-readable block like vLLM's, times in ms."""
    lines = [
        f"requests: {summary['completed']} ok, {summary['failed']} failed in {summary['duration_s']:.2f} s",
        f"request throughput: {summary['request_throughput']:.3f} req/s",
        (f"output tokens/s: {summary['output_throughput']:.2f}   total tokens/s: "
         f"{summary['total_token_throughput']:.2f}"),
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        dist = summary[name]
        if dist:
            lines.append(f"{name.upper():5s} ms  mean {dist['mean'] * 1e3:9.2f}  p50 {dist['p50'] * 1e3:9.2f}  "
                         f"p90 {dist['p90'] * 1e3:9.2f}  p99 {dist['p99'] * 1e3:9.2f}")
    if summary["goodput"] is not None:
        lines.append(f"goodput: {summary['goodput']:.3f} req/s ({summary['slo_attainment']:.1%} meet the SLOs)")
    if summary["cached_token_ratio"] is not None:
        lines.append(f"cached prompt tokens: {summary['cached_token_ratio']:.1%}")
    for row in summary.get("per_turn", []):
        ttft = row["ttft"]["mean"] * 1e3 if row["ttft"] else float("nan")
        cached = f"{row['cached_token_ratio']:.1%}" if row["cached_token_ratio"] is not None else "n/a"
        lines.append(f"  turn {row['turn']}: {row['completed']} ok, mean TTFT {ttft:.1f} ms, cached {cached}")
    later = summary.get("later_turns")
    if later and later["ttft"]:
        rates = ", ".join(f"{t} {v:.1%}" for t, v in (later["tier_hit_rates"] or {}).items()) or "n/a"
        lines.append(f"later turns: {later['completed']} ok, TTFT p50 {later['ttft']['p50'] * 1e3:.1f} ms "
                     f"p99 {later['ttft']['p99'] * 1e3:.1f} ms, prompt tokens by tier: {rates}")
    for error, count in summary["errors"].items():
        lines.append(f"error x{count}: {error}")
    return "\n".join(lines)
