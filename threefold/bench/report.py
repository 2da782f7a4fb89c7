"""`threefold bench report`: result JSONs -> a markdown table and PNG plots in one folder.

    DIR/report.md                     per CPU class: one row per serve run (+ offline rows)
    DIR/throughput_vs_concurrency.png output tok/s against max concurrency, a line per label
    DIR/ttft_cdf.png, tpot_cdf.png    per-request CDFs, a line per run
    DIR/goodput_vs_rate.png           goodput against request rate (runs with SLOs)
    DIR/ttft_per_turn.png             mean TTFT by turn index (session runs)
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from threefold.errors import ThreefoldError

UNKNOWN_CPU = {"cpu_class": "unknown", "model": "not recorded"}
"""What a result file written before runs recorded their CPU is grouped under."""


def cpu_record() -> dict:
    """The CPU this process runs on, as every result file records it (see threefold/cpu.py)."""
    from threefold.cpu import cpu_info

    return cpu_info().as_dict()


def cpu_of(doc: dict) -> dict:
    return doc.get("cpu") or UNKNOWN_CPU


def cpu_class_of(doc: dict) -> str:
    return cpu_of(doc)["cpu_class"]


def by_cpu_class(docs: list[dict]) -> dict[str, list[dict]]:
    """Docs grouped by CPU class, in first-seen order: numbers from different classes never share a table."""
    groups: dict[str, list[dict]] = {}
    for doc in docs:
        groups.setdefault(cpu_class_of(doc), []).append(doc)
    return groups


def cpu_heading(cpu_class: str, docs: list[dict]) -> str:
    """`CPU class avx2: AMD EPYC 7B13 (torch AVX2, 2 threads)`, listing every model seen in the group."""
    described = []
    for doc in docs:
        cpu = cpu_of(doc)
        text = cpu["model"]
        if cpu.get("torch_capability"):
            text += f" (torch {cpu['torch_capability']}, {cpu.get('num_threads')} threads)"
        if text not in described:
            described.append(text)
    return f"CPU class {cpu_class}: " + "; ".join(described)

SERVE_COLUMNS = ("label", "dataset", "rate", "conc", "ok", "fail", "req/s", "out tok/s", "TTFT mean ms",
                 "TTFT p50", "TTFT p99", "TPOT mean ms", "TPOT p99", "ITL p50 ms", "E2E p50 s",
                 "goodput req/s", "cached %")


def load_results(paths: list[str | Path]) -> list[dict]:
    docs = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        if doc.get("kind") not in ("serve", "offline"):
            raise ThreefoldError(f"{path} is not a threefold bench result (no kind serve/offline)", param="results")
        doc["_path"] = str(path)
        docs.append(doc)
    return docs


def _ms(dist: dict | None, key: str) -> str:
    return f"{dist[key] * 1e3:.1f}" if dist else "-"


def _num(value: float | None, fmt: str = "{:.2f}") -> str:
    return fmt.format(value) if value is not None else "-"


def _rate(doc: dict) -> float:
    rate = doc["config"].get("request_rate", "inf")
    return math.inf if rate in (None, "inf") else float(rate)


def _conc(doc: dict) -> int | None:
    return doc["config"].get("max_concurrency")


def serve_row(doc: dict) -> list[str]:
    s, cfg = doc["summary"], doc["config"]
    cached = s.get("cached_token_ratio")
    return [doc["label"], cfg.get("dataset", "-"), str(cfg.get("request_rate", "inf")), str(_conc(doc) or "-"),
            str(s["completed"]), str(s["failed"]), f"{s['request_throughput']:.3f}",
            f"{s['output_throughput']:.1f}", _ms(s["ttft"], "mean"), _ms(s["ttft"], "p50"), _ms(s["ttft"], "p99"),
            _ms(s["tpot"], "mean"), _ms(s["tpot"], "p99"), _ms(s["itl"], "p50"),
            _num(s["e2e"]["p50"] if s["e2e"] else None), _num(s.get("goodput"), "{:.3f}"),
            _num(cached * 100 if cached is not None else None, "{:.1f}")]


def markdown_table(header: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _offline_table(docs: list[dict]) -> str:
    header = ["label", "engine", "prompts", "output tokens", "seconds", "out tok/s", "req/s"]
    rows = [[d["label"], d.get("engine", "-"), str(d.get("num_prompts", "-")), str(d.get("output_tokens", "-")),
             f"{d.get('elapsed_s', 0):.2f}", f"{d.get('output_tokens_per_s', 0):.1f}",
             f"{d.get('requests_per_s', 0):.3f}"] for d in docs]
    return markdown_table(header, rows)


def _per_turn_table(docs: list[dict]) -> str:
    rows = []
    for doc in docs:
        for turn in doc["summary"].get("per_turn", []):
            cached = turn["cached_token_ratio"]
            rows.append([_run_name(doc), str(turn["turn"]), str(turn["completed"]),
                         _num(turn["mean_prompt_tokens"], "{:.0f}"), _ms(turn["ttft"], "mean"),
                         _ms(turn["ttft"], "p90"), _num(cached * 100 if cached is not None else None, "{:.1f}")])
    return markdown_table(["run", "turn", "ok", "prompt tokens", "TTFT mean ms", "TTFT p90 ms", "cached %"], rows)


def _class_sections(docs: list[dict]) -> list[str]:
    """The tables of one CPU class."""
    serve = [d for d in docs if d["kind"] == "serve"]
    offline = [d for d in docs if d["kind"] == "offline"]
    parts = []
    if serve:
        serve.sort(key=lambda d: (d["label"], _conc(d) or 0, _rate(d)))
        parts += ["### Serving", "", markdown_table(SERVE_COLUMNS, [serve_row(d) for d in serve]), ""]
        if any(d["summary"].get("per_turn") for d in serve):
            parts += ["### TTFT by session turn", "", _per_turn_table(serve), ""]
    if offline:
        parts += ["### Offline throughput", "", _offline_table(offline), ""]
    return parts


def markdown(docs: list[dict], plots: list[str]) -> str:
    parts = ["# threefold bench report", ""]
    for cpu_class, group in by_cpu_class(docs).items():
        parts += [f"## {cpu_heading(cpu_class, group)}", "", *_class_sections(group)]
    parts += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    parts += ["", "Sources: " + ", ".join(Path(d["_path"]).name for d in docs)]
    return "\n".join(parts) + "\n"


def _cdf(ax, values: list[float], label: str, scale: float) -> None:
    values = sorted(v * scale for v in values)
    if values:
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)


def _run_name(doc: dict) -> str:
    conc, rate = _conc(doc), _rate(doc)
    return doc["label"] + (f" c={conc}" if conc else "") + ("" if math.isinf(rate) else f" r={rate:g}")


def _line_label(doc: dict, mixed: bool, name: str | None = None) -> str:
    """A plot line's label; with several CPU classes in one report, the class is part of it."""
    name = name or doc["label"]
    return f"{name} [{cpu_class_of(doc)}]" if mixed else name


def _save(fig, out: Path, name: str, plots: list[str]) -> None:
    path = out / name
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plots.append(str(path))


def _line_plot(groups: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str, title: str):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, points in sorted(groups.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot(docs: list[dict], out: Path) -> list[str]:
    """Draw every plot the results support; returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    serve, plots = [d for d in docs if d["kind"] == "serve"], []
    mixed = len(by_cpu_class(serve)) > 1
    throughput: dict[str, list] = defaultdict(list)
    goodput: dict[str, list] = defaultdict(list)
    for d in serve:
        if _conc(d):
            throughput[_line_label(d, mixed)].append((_conc(d), d["summary"]["output_throughput"]))
        if d["summary"].get("goodput") is not None and not math.isinf(_rate(d)):
            goodput[_line_label(d, mixed)].append((_rate(d), d["summary"]["goodput"]))
    if throughput:
        _save(_line_plot(throughput, "max concurrency", "output tokens/s", "Throughput vs concurrency"),
              out, "throughput_vs_concurrency.png", plots)
    if goodput:
        _save(_line_plot(goodput, "request rate (req/s)", "goodput (req/s)", "Goodput vs request rate"),
              out, "goodput_vs_rate.png", plots)
    for metric, title in (("ttft", "TTFT"), ("tpot", "TPOT")) if serve else ():
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        values = [v for d in serve for r in d.get("requests", []) if (v := r.get(metric))]
        for d in serve:
            _cdf(ax, [r[metric] for r in d.get("requests", []) if r.get(metric) is not None],
                 _line_label(d, mixed, _run_name(d)), 1e3)
        if values and max(values) > 20 * min(values):
            ax.set_xscale("log")  # runs from idle to overloaded span decades
        ax.set(xlabel=f"{title} (ms)", ylabel="fraction of requests", title=f"{title} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        _save(fig, out, f"{metric}_cdf.png", plots)
    turns = {_line_label(d, mixed, _run_name(d)): [(t["turn"], t["ttft"]["mean"] * 1e3)
                                                   for t in d["summary"].get("per_turn", []) if t["ttft"]]
             for d in serve if d["summary"].get("per_turn")}
    if turns:
        _save(_line_plot(turns, "turn index", "mean TTFT (ms)", "TTFT by session turn"),
              out, "ttft_per_turn.png", plots)
    plt.close("all")
    return plots


def write_report(paths: list[str | Path], out: str | Path) -> Path:
    """Write DIR/report.md and the plots; returns the markdown path."""
    docs = load_results(paths)
    if not docs:
        raise ThreefoldError("no result files given", param="results")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plots = plot(docs, out)
    md = out / "report.md"
    md.write_text(markdown(docs, plots))
    return md
