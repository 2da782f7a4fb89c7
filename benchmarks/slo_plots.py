"""SLO attainment against request rate, one panel per instance count, one SVG per trace.

    python benchmarks/slo_plots.py --out docs/routing results/sim/*/results.json

Reads `threefold simulate` reports (results.json) and merges their runs: the panels of one trace
gather every report with that trace, so a 1000-instance curve can come from several one-rate runs.
Reports of one trace must share its TTFT SLO and calibration CPU class (the panels compare them);
a rate run twice keeps its last report's result. The SVGs keep text as text and carry no date, so
they stay small and a rerun on the same reports writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

ATTAINMENT_GOAL = 0.9
POLICIES = ("round_robin", "least_loaded", "prefix_hash", "cache_aware", "dualmap")


def merge(reports: list[dict]) -> dict[str, dict]:
    """trace -> {"slo", "cpu", "curves": {(instances, policy): [(rate per instance, attainment)]}}."""
    traces: dict[str, dict] = {}
    points: dict[str, dict] = defaultdict(dict)
    for report in reports:
        for run in report["runs"]:
            trace = traces.setdefault(run["trace"], {"slo": report["ttft_slo_s"], "cpu": report["cpu"]})
            if (trace["slo"], trace["cpu"]) != (report["ttft_slo_s"], report["cpu"]):
                raise SystemExit(f"{run['trace']}: reports with SLO {trace['slo']} s [{trace['cpu']}] and "
                                 f"{report['ttft_slo_s']} s [{report['cpu']}] do not belong in one plot")
            key = (run["instances"], run["policy"])
            points[run["trace"]][key, round(run["rate"] / run["instances"], 6)] = run["slo_attainment"]
    for name, trace in traces.items():
        curves: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
        for (key, rate), attainment in sorted(points[name].items()):
            curves[key].append((rate, attainment))
        trace["curves"] = dict(curves)
    return traces


def plot_trace(name: str, trace: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "threefold"})
    sizes = sorted({n for n, _ in trace["curves"]})
    # Shared axes and one colour per policy in every panel, so the panels read side by side.
    fig, axes = plt.subplots(1, len(sizes), figsize=(3.2 * len(sizes), 3.4), sharex=True, sharey=True, squeeze=False)
    for ax, n in zip(axes[0], sizes, strict=True):
        for colour, policy in enumerate(POLICIES):
            curve = trace["curves"].get((n, policy))
            if curve:
                ax.plot(*zip(*curve, strict=True), marker="o", markersize=3, linewidth=1.2, label=policy,
                        color=f"C{colour}")
        ax.axhline(ATTAINMENT_GOAL, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xscale("log")
        ax.set(title=f"{n} instances", xlabel="req/s per instance")
        ax.grid(alpha=0.3, linewidth=0.5)
    axes[0][0].set_ylabel(f"fraction with TTFT <= {trace['slo']:g} s")
    drawn: dict[str, object] = {}  # every policy drawn in any panel, so the legend names them all
    for ax in axes[0]:
        handles, labels = ax.get_legend_handles_labels()
        drawn.update((label, handle) for handle, label in zip(handles, labels, strict=True) if label not in drawn)
    axes[0][0].legend([drawn[p] for p in POLICIES if p in drawn], [p for p in POLICIES if p in drawn], fontsize=7)
    fig.suptitle(f"{name} trace: SLO attainment vs rate (simulated; calibration [{trace['cpu']}])", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for slo_<trace>.svg")
    parser.add_argument("reports", nargs="+", help="results.json files of `threefold simulate`")
    ns = parser.parse_args()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, trace in merge([json.loads(Path(p).read_text()) for p in ns.reports]).items():
        path = out / f"slo_{name}.svg"
        plot_trace(name, trace, path)
        print(f"wrote {path} ({path.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
