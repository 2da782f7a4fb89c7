"""`threefold simulate`: rate sweeps per (instances, trace, policy), effective capacity, tables, plots.

Rates are given per instance (requests/s per replica) so one list serves 8
and 1000 instances; a run offers rate x instances requests/s. Effective
request capacity is the highest rate at which >= 90% of requests meet the
TTFT SLO: the sweep climbs the rates until one fails (attainment falls with
load), then `bisect_steps` halvings refine the bracket.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from threefold.errors import ThreefoldError
from threefold.router.policies import policy_names
from threefold.sim.engine_model import EngineModel
from threefold.sim.simulator import RunResult, simulate
from threefold.sim.step_fit import calibrate_from_step_logs
from threefold.sim.traces import TRACES, Trace, make_trace

ATTAINMENT_GOAL = 0.9
DEFAULT_POLICIES = "round_robin,least_loaded,prefix_hash,cache_aware,dualmap"


def add_simulate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instances", type=int, action="append", required=True, help="replicas (repeatable)")
    parser.add_argument("--policy", default=DEFAULT_POLICIES, help="comma-separated router policies")
    parser.add_argument("--trace", default="sessions", help=f"comma-separated: {', '.join(TRACES)}")
    parser.add_argument("--rates", default="0.5,1,2,4", help="requests/s PER INSTANCE, comma-separated")
    parser.add_argument("--calibration", default=None,
                        help="engine model JSON from `threefold bench calibrate` (with --calibration-from-step-log: "
                             "only the replicas' KV pool, block size, batch limits and HTTP delays are taken from it)")
    parser.add_argument("--calibration-from-step-log", default=None, metavar="FILE[,FILE...]",
                        help="fit the step prices to real replicas' step logs (`threefold serve --step-log FILE`) "
                             "instead; the fitted model is saved as OUT/engine_model.json")
    parser.add_argument("--ttft-slo", default="1s", help="TTFT SLO, e.g. 1s or 500ms")
    parser.add_argument("--requests-per-instance", type=int, default=40)
    parser.add_argument("--max-requests", type=int, default=20000, help="cap on requests per run")
    parser.add_argument("--bisect-steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="output folder (results.json, results.md, PNG plots)")


def parse_seconds(text: str) -> float:
    text = text.strip()
    try:
        value = float(text[:-2]) / 1000 if text.endswith("ms") else float(text.rstrip("s"))
    except ValueError as err:
        raise ThreefoldError(f"bad duration {text!r}; use e.g. 1s or 500ms", param="ttft_slo") from err
    if value <= 0:
        raise ThreefoldError(f"duration must be > 0, got {text!r}", param="ttft_slo")
    return value


def effective_capacity(run, rates: list[float], bisect_steps: int) -> tuple[float, list[RunResult]]:
    """Highest rate (in `rates`' units) with attainment >= goal; `run(rate)` -> RunResult. 0 if none passes."""
    met: dict[float, bool] = {}
    results = []
    for rate in sorted(rates):
        results.append(run(rate))
        met[rate] = results[-1].slo_attainment >= ATTAINMENT_GOAL
        if not met[rate]:
            break  # attainment falls with rate: higher rates (the slowest runs, deep queues) fail too
    passing = [rate for rate, ok in met.items() if ok]
    if not passing:
        return 0.0, results
    low = max(passing)
    above = [rate for rate, ok in met.items() if not ok and rate > low]
    if not above:
        return low, results
    high = min(above)
    for _ in range(bisect_steps):
        mid = (low + high) / 2
        results.append(run(mid))
        low, high = (mid, high) if results[-1].slo_attainment >= ATTAINMENT_GOAL else (low, mid)
    return low, results


def engine_model(ns: argparse.Namespace) -> EngineModel:
    """--calibration, or the step prices fitted to --calibration-from-step-log over its pool and limits."""
    if not ns.calibration_from_step_log:
        if not ns.calibration:
            raise ThreefoldError("give --calibration FILE (`threefold bench calibrate`) or "
                                 "--calibration-from-step-log FILE[,FILE...] with --calibration", param="calibration")
        return EngineModel.load(ns.calibration)
    if not ns.calibration:
        raise ThreefoldError("--calibration-from-step-log also needs --calibration FILE: a step log holds step "
                             "times, not the replicas' KV pool, block size and batch limits", param="calibration")
    paths = [p.strip() for p in ns.calibration_from_step_log.split(",") if p.strip()]
    model = calibrate_from_step_logs(paths, EngineModel.load(ns.calibration))
    print(f"engine model fitted to {model.source}: a {model.max_num_batched_tokens}-token prefill "
          f"{model.prefill_seconds(model.max_num_batched_tokens):.3f} s, decode context "
          f"{model.per_context_s * 1e9:.1f} ns/token; the pool from {ns.calibration}", flush=True)
    return model


def run_simulate(ns: argparse.Namespace) -> dict:
    model = engine_model(ns)
    slo = parse_seconds(ns.ttft_slo)
    policies = [p.strip() for p in ns.policy.split(",") if p.strip()]
    traces = [t.strip() for t in ns.trace.split(",") if t.strip()]
    try:
        rates = [float(r) for r in ns.rates.split(",")]
    except ValueError as err:
        raise ThreefoldError(f"--rates must be numbers, got {ns.rates!r}", param="rates") from err
    unknown = [p for p in policies if p not in policy_names()] + [t for t in traces if t not in TRACES]
    if unknown or not rates or min(rates) <= 0 or min(ns.instances) < 1:
        raise ThreefoldError(f"bad simulate arguments: unknown {unknown}, rates {rates}, instances {ns.instances}; "
                             f"policies: {policy_names()}, traces: {list(TRACES)}", param="simulate")
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    if model.source:
        model.save(out / "engine_model.json")
    calibration = f"{model.source} over {ns.calibration}" if model.source else ns.calibration
    report: dict = {"calibration": calibration, "model": model.model, "cpu": model.cpu, "ttft_slo_s": slo,
                    "seed": ns.seed, "runs": [], "capacity": []}
    for n in ns.instances:
        for trace_name in traces:
            num = min(ns.max_requests, ns.requests_per_instance * n)
            trace = make_trace(trace_name, num, ns.seed, model.block_size, 64)
            for policy in policies:
                _sweep_one(report, model, trace, n, policy, rates, slo, ns)
    _save(report, out)
    plot(report, out)
    print(markdown(report))
    return report


def _sweep_one(report: dict, model: EngineModel, trace: Trace, n: int, policy: str, rates: list[float],
               slo: float, ns: argparse.Namespace) -> None:
    started = time.perf_counter()

    def run(rate: float) -> RunResult:
        result = simulate(model, trace, n, policy, rate * n, slo, ns.seed)
        print(f"{n:5d} inst {trace.name:9s} {policy:13s} rate {rate:.3f}: SLO attainment {result.slo_attainment:.3f}, "
              f"TTFT p50 {result.ttft_p50:.2f} s, hit rate {result.hit_rate:.3f} "
              f"({time.perf_counter() - started:.0f}s)", flush=True)  # long sweeps: each run as it ends
        report["runs"].append(asdict(result))
        _save(report, Path(ns.out))  # a sweep stopped part way keeps every run that ended
        return result

    capacity, results = effective_capacity(run, rates, ns.bisect_steps)
    report["capacity"].append({"instances": n, "trace": trace.name, "policy": policy,
                               "capacity_per_instance": capacity, "capacity_total": capacity * n})
    print(f"{n:5d} inst {trace.name:9s} {policy:13s} capacity {capacity:.3f} req/s/inst "
          f"({len(results)} runs, {time.perf_counter() - started:.1f}s)", flush=True)


def _save(report: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "results.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    lines = [f"TTFT SLO {report['ttft_slo_s']} s, model {report['model']} [{report['cpu']}], seed {report['seed']}", "",
             "| instances | trace | policy | capacity (req/s/inst) | x round_robin |", "|---|---|---|---|---|"]
    base = {(c["instances"], c["trace"]): c["capacity_per_instance"]
            for c in report["capacity"] if c["policy"] == "round_robin"}
    for c in report["capacity"]:
        rr = base.get((c["instances"], c["trace"]))
        ratio = f"{c['capacity_per_instance'] / rr:.2f}" if rr else "-"
        cap = c["capacity_per_instance"]
        lines.append(f"| {c['instances']} | {c['trace']} | {c['policy']} | {cap:.3f} | {ratio} |")
    header = ("| instances | trace | policy | rate/inst | SLO att. | TTFT p50 | TTFT p99 | ITL mean | hit rate "
              "| imbalance | migrations |")
    lines += ["", header, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(report["runs"], key=lambda r: (r["instances"], r["trace"], r["policy"], r["rate"])):
        lines.append(f"| {r['instances']} | {r['trace']} | {r['policy']} | {r['rate'] / r['instances']:.3f} "
                     f"| {r['slo_attainment']:.3f} | {r['ttft_p50']:.3f} | {r['ttft_p99']:.3f} | {r['itl_mean']:.4f} "
                     f"| {r['hit_rate']:.3f} | {r['imbalance']:.2f} | {r['migrations']} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, out: Path) -> None:
    """SLO attainment vs per-instance rate, one PNG per (instances, trace); skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install threefold[bench]); no plots")
        return
    groups = sorted({(r["instances"], r["trace"]) for r in report["runs"]})
    for n, trace in groups:
        fig, ax = plt.subplots(figsize=(6, 4))
        for policy in sorted({r["policy"] for r in report["runs"]}):
            points = sorted((r["rate"] / n, r["slo_attainment"]) for r in report["runs"]
                            if r["instances"] == n and r["trace"] == trace and r["policy"] == policy)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=policy)
        ax.axhline(ATTAINMENT_GOAL, color="grey", linestyle="--", linewidth=0.8)
        ax.set(xlabel="request rate per instance (req/s)", ylabel=f"fraction TTFT <= {report['ttft_slo_s']} s",
               title=f"{n} instances, {trace}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"slo_{trace}_{n}.png", dpi=100)
        plt.close(fig)
