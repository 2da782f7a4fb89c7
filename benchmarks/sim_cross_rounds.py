"""Out-of-sample validation across rounds: each round's real run simulated with the engine model fitted to
another round's replica step logs, beside its own startup calibration and its own logs (in sample).

    python benchmarks/sim_cross_rounds.py results/val6 results/val7 results/val8 results/val9 results/valA \\
        results/valB --out results/cross.md

Each argument is a folder `benchmarks/sim_validation.py` left (validation.json, records_<policy>.json,
steps_<i>.jsonl); no replica runs, only the simulator. Error = simulated (the real send times replayed) /
real - 1; a cell within 15% is bold. A folder without step logs is only a target; one whose run was
validated on a step-log fit (--calibration-from) has no startup calibration of its own.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sim_validation import resimulate  # benchmarks/ is on sys.path: this script's own folder

from threefold.sim.engine_model import EngineModel

METRICS = ("ttft_p50", "ttft_p90", "ttft_p99", "ttft_mean", "hit_rate")
GOAL = 0.15


def run(target: Path, source: Path | None) -> dict:
    ns = argparse.Namespace(out=str(target), calibration=None, calibration_from=str(source) if source else None,
                            no_delays=False, in_run_delays=False, report=None)
    return resimulate(ns)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rounds", nargs="+", help="sim_validation.py output folders")
    parser.add_argument("--out", default=None, help="also write the table here (markdown)")
    ns = parser.parse_args()
    rounds = [Path(r) for r in ns.rounds]
    sources = [r for r in rounds if list(r.glob("steps_*.jsonl"))]
    lines = ["| validated on | engine model | policy | TTFT p50 | p90 | p99 | mean | hit rate | within 15% |",
             "|---|---|---|---|---|---|---|---|---|"]
    totals: dict[tuple[str, str], list[int]] = {}
    for target in rounds:
        own = json.loads((target / "validation.json").read_text())["calibration"]
        startup = [None] if EngineModel.load(own).source == "" else []  # (a run validated on a step-log fit has none)
        for source in [*startup, *[s for s in sources if s != target], *[s for s in sources if s == target]]:
            kind = "startup calibration" if source is None else "in sample" if source == target else "out of sample"
            label = "its own startup calibration" if source is None else (
                "its own step logs" if source == target else f"step logs of {source.name}")
            for row in run(target, source)["policies"]:
                errors = [row["replayed"]["error"][k] for k in METRICS]
                met = sum(abs(e) <= GOAL for e in errors)
                total = totals.setdefault((kind, row["policy"]), [0, 0])
                total[0], total[1] = total[0] + met, total[1] + len(errors)
                cells = " | ".join(f"**{e:+.1%}**" if abs(e) <= GOAL else f"{e:+.1%}" for e in errors)
                lines.append(f"| {target.name} | {label} | {row['policy']} | {cells} | {met}/{len(errors)} |")
    lines += ["", "| engine model | policy | cells within 15% |", "|---|---|---|"]
    lines += [f"| {kind} | {policy} | {met}/{n} |" for (kind, policy), (met, n) in sorted(totals.items())]
    text = "\n".join(lines) + "\n"
    print(text)
    if ns.out:
        Path(ns.out).write_text(text)


if __name__ == "__main__":
    main()
