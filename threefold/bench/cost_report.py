"""From `bench cost` runs to numbers, verdicts and a markdown table.

Cost per million output tokens = price per hour x the run's wall time / 3600 / output tokens
x 1e6: the machine is paid for the whole run, whatever it was doing. Every rung runs on the
same machine (two-replica rungs share its cores), so one price per hour applies to all.

The verdict rule is RULE below; every report states it.
"""

from __future__ import annotations

from threefold.bench.cost_run import RungRun
from threefold.bench.cost_rungs import Comparison
from threefold.bench.cost_workload import CLASSES, single_turn_texts
from threefold.bench.metrics import distribution, summarize

RULE = ("Verdict rule (noise = {noise:.0%}): **truly cuts cost** when every comparison that isolates the technique "
        "lowers cost per million output tokens by more than the noise; **cuts cost only on some traffic** when, "
        "short of that, some comparison lowers it by more than the noise, or one traffic class's median seconds "
        "per output token (a request's E2E over its output tokens) falls by more than twice the noise; "
        "**for show here** otherwise. Quality is reported beside the verdict, not folded into it.")
TRULY, SOME, SHOW = "truly cuts cost", "cuts cost only on some traffic", "for show here"
TECHNIQUE_LABELS = {"cb": "continuous batching (vs transformers static batching)", "prefix": "prefix caching",
                    "codec": "KV codec", "spec": "speculative decoding", "tiers": "KV tiers (L2 host memory)",
                    "rr": "a second replica (round-robin)", "router": "router policy (vs round-robin)"}


def _p(dist: dict | None, key: str) -> float | None:
    return dist[key] if dist else None


def _classes(run: RungRun) -> dict[str, dict]:
    out = {}
    for name in CLASSES:
        done = [r for r, c in zip(run.played.results, run.played.classes, strict=True) if c == name and r.ok]
        per_token = [r.e2e / r.output_tokens for r in done if r.e2e is not None and r.output_tokens]
        out[name] = {"requests": len(done), "ttft_p50_s": _p(distribution([r.ttft for r in done if r.ttft]), "p50"),
                     "s_per_token_p50": _p(distribution(per_token), "p50")}
    return out


def rung_row(name: str, run: RungRun, cost_per_hour: float) -> dict:
    """The measured numbers of one rung (quality is added by the caller)."""
    played = run.played
    summary = summarize(played.results, played.duration_s, skipped=played.skipped_turns)
    out_tokens = summary["total_output_tokens"]
    cost = cost_per_hour * played.duration_s / 3600 / out_tokens * 1e6 if out_tokens else None
    return {"rung": name, "completed": summary["completed"], "failed": summary["failed"],
            "skipped_turns": played.skipped_turns, "errors": summary["errors"], "duration_s": played.duration_s,
            "output_tokens": out_tokens, "output_tok_s": summary["output_throughput"],
            "ttft_p50_s": _p(summary["ttft"], "p50"), "ttft_p99_s": _p(summary["ttft"], "p99"),
            "itl_p50_s": _p(summary["itl"], "p50"), "itl_p99_s": _p(summary["itl"], "p99"),
            "cached_token_ratio": summary["cached_token_ratio"],
            "peak_rss_bytes": run.peak_rss_bytes if run.processes else None,
            "serving_processes": run.processes, "cost_per_m_output_tokens": cost, "classes": _classes(run),
            "routed_per_replica": run.routed, "ledgers": run.ledgers, "error": run.error}


def same_outputs(run: RungRun, reference: RungRun) -> float | None:
    """Fraction of single-turn requests whose greedy text equals the reference rung's."""
    pairs = [(a, b) for a, b in zip(single_turn_texts(run.played), single_turn_texts(reference.played), strict=True)
             if a is not None and b is not None]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def _change(after: float | None, before: float | None) -> float | None:
    return after / before - 1 if after is not None and before else None


def _evidence(comparison: Comparison, rows: dict[str, dict]) -> dict:
    before, after = rows[comparison.before], rows[comparison.after]
    classes = {name: _change(after["classes"][name]["s_per_token_p50"], before["classes"][name]["s_per_token_p50"])
               for name in CLASSES}
    return {"before": comparison.before, "after": comparison.after, "kind": comparison.kind,
            "cost_change": _change(after["cost_per_m_output_tokens"], before["cost_per_m_output_tokens"]),
            "class_s_per_token_change": classes, "peak_rss_change": _change(after["peak_rss_bytes"],
                                                                            before["peak_rss_bytes"]),
            "kl_mean": (after.get("quality") or {}).get("kl_mean")}


def verdicts(comparisons: list[Comparison], rows: dict[str, dict], noise: float) -> list[dict]:
    """One verdict per technique that some pair of completed rungs isolates (rule: module docstring)."""
    out = []
    for technique in TECHNIQUE_LABELS:
        found = [_evidence(c, rows) for c in comparisons if c.technique == technique
                 and rows[c.before]["completed"] and rows[c.after]["completed"]]
        costs = [e["cost_change"] for e in found if e["cost_change"] is not None]
        if not costs:
            continue
        class_changes = [v for e in found for v in e["class_s_per_token_change"].values() if v is not None]
        if all(c < -noise for c in costs):
            verdict = TRULY
        elif any(c < -noise for c in costs) or any(v < -2 * noise for v in class_changes):
            verdict = SOME
        else:
            verdict = SHOW
        out.append({"technique": technique, "label": TECHNIQUE_LABELS[technique], "verdict": verdict,
                    "evidence": found})
    return out


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def _kl(value: float | None) -> str:
    # KL >= 0; float32 sums of near-equal distributions can land a hair below zero.
    return "-" if value is None else f"{max(value, 0.0):.4f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.0f}%"


def markdown(rows: list[dict], verdict_rows: list[dict], header: str, rule: str) -> str:
    base = rows[0]["cost_per_m_output_tokens"] if rows else None
    lines = [header, "", ("| rung | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | peak RSS MiB | KL (nats) "
                          "| top-1 | HumanEval pass@1 | same text as cb | $ / M out tokens | x first rung |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        quality, cost = r.get("quality") or {}, r["cost_per_m_output_tokens"]
        ratio = f"{cost / base:.2f}" if cost and base else "-"
        failed = f" ({r['failed']} failed)" if r["failed"] else ""
        lines.append(f"| {r['rung']}{failed} | {_fmt(r['output_tok_s'])} | {_fmt(r['ttft_p50_s'], 1e3, 0)} / "
                     f"{_fmt(r['ttft_p99_s'], 1e3, 0)} | {_fmt(r['itl_p50_s'], 1e3, 0)} / "
                     f"{_fmt(r['itl_p99_s'], 1e3, 0)} | {_fmt(r['peak_rss_bytes'], 2**-20, 0)} | "
                     f"{_kl(quality.get('kl_mean'))} | {_share(quality.get('top1_agreement'))} | "
                     f"{_share(r.get('pass_at_1'))} | {_share(r.get('same_as_cb'))} | "
                     f"{_fmt(cost, 1, 3)} | {ratio} |")
    lines += ["", "Per traffic class: TTFT p50 ms / median ms per output token (a request's E2E over its tokens)", "",
              "| rung | " + " | ".join(CLASSES) + " |", "|---|" + "---|" * len(CLASSES)]
    for r in rows:
        cells = [f"{_fmt(c['ttft_p50_s'], 1e3, 0)} / {_fmt(c['s_per_token_p50'], 1e3, 0)}"
                 for c in (r["classes"][name] for name in CLASSES)]
        lines.append(f"| {r['rung']} | " + " | ".join(cells) + " |")
    lines += ["", "| technique | verdict | cost change per comparison | biggest per-class change |",
              "|---|---|---|---|"]
    for v in verdict_rows:
        changes = "; ".join(f"{e['after']} vs {e['before']} ({e['kind']}): {_pct(e['cost_change'])}"
                            for e in v["evidence"])
        best = min(((e["class_s_per_token_change"][c], c) for e in v["evidence"] for c in CLASSES
                    if e["class_s_per_token_change"][c] is not None), default=None)
        best_text = f"{best[1]}: {_pct(best[0])} s/token" if best else "-"
        lines.append(f"| {v['label']} | **{v['verdict']}** | {changes} | {best_text} |")
    return "\n".join([*lines, "", rule])
