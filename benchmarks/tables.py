"""Markdown tables for BENCHMARKS.md from `bench serve/sweep/offline` result JSONs.

    .venv/bin/python benchmarks/tables.py serve results/sweep/*.json
    .venv/bin/python benchmarks/tables.py offline results/offline*/offline_*.json
    .venv/bin/python benchmarks/tables.py turns results/sessions/*.json

`serve`: one row per (label, concurrency), medians over rounds when several,
with every latency percentile the issue asks for (the `bench report` table
leaves out TPOT p50 and ITL p99). `offline`: tok/s and the ratio to
transformers and vLLM. `turns`: TTFT and cached-token share by turn index.

Every kind prints one table per CPU class the files were measured on (files
from before runs recorded their CPU form an "unknown" class), so a ratio never
divides a number from one CPU class by a number from another.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from threefold.bench.report import by_cpu_class, cpu_class_of, cpu_heading


def _load(paths: list[str]) -> list[dict]:
    docs = []
    for p in paths:
        d = json.loads(Path(p).read_text())
        d["_path"] = p
        docs.append(d)
    return docs


def _ms(dist: dict | None, key: str) -> float | None:
    return dist[key] * 1e3 if dist else None


def _f(v, fmt="{:.1f}") -> str:
    return fmt.format(v) if v is not None else "-"


def _med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def serve_table(docs: list[dict]) -> str:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for d in docs:
        if d.get("kind") == "serve":
            groups[(d["label"], d["config"].get("max_concurrency") or 0, cpu_class_of(d))].append(d)
    head = ["server", "conc", "N ok/fail", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
            "TPOT p99 ms", "ITL p50 ms", "ITL p99 ms", "E2E p50 s", "cached %", "runs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (label, conc, _), ds in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        s = [d["summary"] for d in ds]
        cached = _med([x.get("cached_token_ratio") for x in s])
        row = [label, str(conc or "inf"), f"{sum(x['completed'] for x in s)}/{sum(x['failed'] for x in s)}",
               _f(_med([x["request_throughput"] for x in s]), "{:.3f}"),
               _f(_med([x["output_throughput"] for x in s])),
               _f(_med([_ms(x["ttft"], "p50") for x in s]), "{:.0f}"),
               _f(_med([_ms(x["ttft"], "p99") for x in s]), "{:.0f}"),
               _f(_med([_ms(x["tpot"], "p50") for x in s])), _f(_med([_ms(x["tpot"], "p99") for x in s])),
               _f(_med([_ms(x["itl"], "p50") for x in s])), _f(_med([_ms(x["itl"], "p99") for x in s])),
               _f(_med([x["e2e"]["p50"] if x["e2e"] else None for x in s]), "{:.2f}"),
               _f(cached * 100 if cached is not None else None), str(len(ds))]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def offline_table(docs: list[dict]) -> str:
    """Ratios divide rows of one CPU class only (the class is part of every group key)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for d in docs:
        if d.get("kind") == "offline":
            groups[(cpu_class_of(d), d["engine"], d["num_prompts"])].append(d)
    rows = {k: _med([d["output_tokens_per_s"] for d in ds]) for k, ds in groups.items()}
    head = ["engine", "prompts", "output tokens", "seconds (median)", "out tok/s", "req/s", "x transformers (same N)",
            "x vLLM (same N)", "runs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (cpu, engine, n), ds in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        tps = rows[(cpu, engine, n)]
        hf, vl = rows.get((cpu, "transformers", n)), rows.get((cpu, "vllm", n))
        lines.append("| " + " | ".join([
            engine, str(n), str(ds[0]["output_tokens"]), _f(_med([d["elapsed_s"] for d in ds])), _f(tps),
            _f(_med([d["requests_per_s"] for d in ds]), "{:.3f}"), _f(tps / hf if hf else None, "{:.2f}"),
            _f(tps / vl if vl else None, "{:.2f}"), str(len(ds))]) + " |")
    return "\n".join(lines)


def turns_table(docs: list[dict]) -> str:
    head = ["run", "turn", "requests", "mean prompt tokens", "TTFT p50 ms", "TTFT mean ms", "cached %"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in docs:
        for t in d["summary"].get("per_turn", []):
            c = t["cached_token_ratio"]
            lines.append("| " + " | ".join([d["label"], str(t["turn"]), str(t["completed"]),
                                            _f(t["mean_prompt_tokens"], "{:.0f}"), _f(_ms(t["ttft"], "p50"), "{:.0f}"),
                                            _f(_ms(t["ttft"], "mean"), "{:.0f}"),
                                            _f(c * 100 if c is not None else None)]) + " |")
        s = d["summary"]
        c = s.get("cached_token_ratio")
        lines.append("| " + " | ".join([f"**{d['label']} all**", "-", str(s["completed"]), "-",
                                        _f(_ms(s["ttft"], "p50"), "{:.0f}"), _f(_ms(s["ttft"], "mean"), "{:.0f}"),
                                        _f(c * 100 if c is not None else None)]) + " |")
    return "\n".join(lines)


TABLES = {"serve": serve_table, "offline": offline_table, "turns": turns_table}


def tables_by_cpu(kind: str, docs: list[dict]) -> str:
    """One `kind` table per CPU class, each under a heading naming the class and the CPU models."""
    parts = []
    for cpu_class, group in by_cpu_class(docs).items():
        parts += [f"#### {cpu_heading(cpu_class, group)}", "", TABLES[kind](group), ""]
    return "\n".join(parts)


if __name__ == "__main__":
    kind, paths = sys.argv[1], sys.argv[2:]
    print(tables_by_cpu(kind, _load(paths)))
