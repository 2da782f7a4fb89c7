"""Hybrid offline/online scheduling: online latency and offline throughput, three schedules side by side.

    flock /tmp/threefold-bench.lock .venv/bin/python benchmarks/hybrid.py --duration 45 --rounds 2 \
        --loads 0.3,0.6,0.9 --offline 2000 --out results/hybrid.json

One process, one loaded model (engine-side timings, no HTTP).

1. Capacity, latency-bounded: the rate with everything queued at once (the saturated rate) is
   only an upper bound, so the capacity is the highest Poisson rate, by bisection below it, whose
   online-only median ITL meets --online-itl-slo. Not p99 TTFT: with prefill-first chunked
   steps an arrival is admitted at the next step whatever the rate, so TTFT hardly moves with
   the rate (its tail is the long prompts' own prefill) while every decode gap stretches.
2. Offline capacity in tokens: the batch alone for --duration seconds (output tok/s), under fcfs
   (whole 2048-token steps) and under hybrid (steps cut at the cap), both from a fresh engine.
   Online's share of the capacity is its rate over the saturated rate; what it leaves over is
   the better offline-alone tok/s x (1 - that share).
3. For each round and load (a share of the capacity; the same Poisson arrivals for every schedule
   of that round and load, rounds interleaved):

    online-only  no batch work
    hybrid       --offline batch lines (HumanEval + ShareGPT-train) queued at t=0 as request_class
                 "offline" under scheduling_policy="hybrid"
    naive        the same batch under scheduling_policy="fcfs" at priority 1: the engine's plain
                 priorities (online first) with no step-time budget, so offline fills every step

    TTFT / ITL p50, p90, p99   online requests from their arrival time, pooled over the rounds
    ratio CI                   hybrid / online-only p99, 5-95% paired bootstrap over requests
    offline tok/s              offline output tokens in the window / window
    leftover                   best offline-alone tok/s x (1 - online rate / saturated rate)
    util                       share of the window spent in engine steps (a step of 3 decodes is
                               as busy as one of 100: time, not capacity)
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

from threefold.bench.datasets import LengthLimits, SampleRequest, load_humaneval, load_sharegpt
from threefold.bench.tokenizer import load_tokenizer
from threefold.config import SchedulerConfig
from threefold.core.hybrid import step_cap
from threefold.cpu import cpu_info
from threefold.engine.llm_engine import EngineArgs, LLMEngine
from threefold.engine.outputs import RequestOutputKind
from threefold.model.loader import load_model
from threefold.sample.params import SamplingParams


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def params(sample: SampleRequest) -> SamplingParams:
    return SamplingParams(max_tokens=sample.max_tokens, temperature=0, ignore_eos=True)


def poisson(rate: float, duration: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    arrivals, t = [], rng.expovariate(rate)
    while t < duration:
        arrivals.append(t)
        t += rng.expovariate(rate)
    return arrivals


class StepLog:
    """Times every forward and, under hybrid, what the predictor said of it before it ran."""

    def __init__(self, engine: LLMEngine, duration: float, start: float) -> None:
        self.core, self.duration, self.start = engine.core, duration, start
        self.steps: list[tuple] = []
        """kind, predicted s, measured s, offline tokens, offline decodes, online sequences, online prefill?"""
        self.busy = 0.0
        """Seconds of forwards that started inside the window."""
        self.online_queued = 0
        """Steps run while an online request was left waiting (budget, sequences or KV ran out)."""
        self._execute = engine.core.runner.execute
        engine.core.runner.execute = self.execute

    def execute(self, sched):
        if sched.is_empty:
            return self._execute(sched)
        scheduler = self.core.scheduler
        predictor = scheduler.predictor
        predicted = predictor(scheduler.last_shape) if predictor is not None else float("nan")
        offline = sum(n for rid, n in sched.num_scheduled_tokens.items() if scheduler.requests[rid].is_offline)
        online = sched.total_num_scheduled_tokens - offline
        offline_decodes = sum(n == 1 for rid, n in sched.num_scheduled_tokens.items()
                              if scheduler.requests[rid].is_offline)
        online_seqs = [rid for rid in sched.num_scheduled_tokens if not scheduler.requests[rid].is_offline]
        online_prefill = any(sched.num_scheduled_tokens[rid] > 1 for rid in online_seqs)
        kind = "offline-only" if not online else "online-only" if not offline else "mixed"
        self.online_queued += any(r.class_rank == 0 and not r.is_offline for r in scheduler.waiting)
        began = time.perf_counter()
        out = self._execute(sched)
        seconds = time.perf_counter() - began
        if began - self.start < self.duration:
            self.busy += seconds
            self.steps.append((kind, predicted, seconds, offline, offline_decodes, len(online_seqs), online_prefill))
        return out

    def summary(self) -> dict:
        result: dict = {"online_queued_steps": self.online_queued}
        for kind in ("offline-only", "mixed", "online-only"):
            rows = [s for s in self.steps if s[0] == kind]
            ratios = [s[2] / s[1] for s in rows if s[1] == s[1] and s[1] > 0]
            result[kind] = {"steps": len(rows), "seconds": sum(s[2] for s in rows),
                            "offline_tokens": sum(s[3] for s in rows), "offline_decodes": sum(s[4] for s in rows),
                            "online_seqs_mean": statistics.mean(s[5] for s in rows) if rows else 0.0,
                            "with_online_prefill": sum(s[6] for s in rows),
                            "decode_only_p50": percentile([s[2] for s in rows if not s[6]], 50),
                            "measured_p50": percentile([s[2] for s in rows], 50),
                            "measured_p99": percentile([s[2] for s in rows], 99),
                            "measured_over_predicted_p10": percentile(ratios, 10),
                            "measured_over_predicted_p50": percentile(ratios, 50),
                            "measured_over_predicted_p90": percentile(ratios, 90)}
        return result


def run(loaded, base: dict, policy: str, arrivals: list[float], duration: float, online: list[SampleRequest],
        offline: list[SampleRequest]) -> dict:
    """One window: the batch queued at t=0, online requests at their arrival times; until every online one ends.
    Under fcfs the batch lines get priority 1 (the engine's plain priorities: online first, then as
    much offline as the 2048-token budget holds); strict arrival order would put every online request
    behind all of the batch."""
    engine = LLMEngine(loaded, EngineArgs(**base, scheduling_policy=policy))
    for i, sample in enumerate(offline):
        engine.add_request(f"off{i}", sample.prompt, params(sample), output_kind=RequestOutputKind.DELTA,
                           request_class="offline", priority=int(policy == "fcfs"))
    ttft: dict[int, float] = {}
    itl: dict[int, list[float]] = {}
    last_token: dict[int, float] = {}
    offline_tokens, next_online = 0, 0
    start, wall = time.perf_counter(), time.time()  # the engine orders by wall-clock arrival times
    log = StepLog(engine, duration, start)
    while True:
        now = time.perf_counter() - start
        while next_online < len(arrivals) and arrivals[next_online] <= now:
            sample = online[next_online % len(online)]
            engine.add_request(f"on{next_online}", sample.prompt, params(sample),
                               arrival_time=wall + arrivals[next_online], output_kind=RequestOutputKind.DELTA)
            next_online += 1
        if now >= duration and not any(f"on{i}" in engine.requests for i in range(len(arrivals))):
            break
        if not engine.has_unfinished_requests():
            time.sleep(min(0.005, max(arrivals[next_online] - now, 0)) if next_online < len(arrivals) else 0.005)
            continue
        outputs = engine.step()
        stamp = time.perf_counter() - start
        for output in outputs:
            num_new = sum(len(c.token_ids) for c in output.outputs)
            if output.request_id.startswith("off"):
                offline_tokens += num_new if stamp <= duration else 0
            elif num_new:
                index = int(output.request_id[2:])
                if index in last_token:
                    itl.setdefault(index, []).extend([(stamp - last_token[index]) / num_new] * num_new)
                else:
                    ttft[index] = stamp - arrivals[index]
                last_token[index] = stamp
    stats = engine.get_stats()
    engine.close()
    return {"policy": policy, "online_requests": len(arrivals), "ttft": ttft, "itl": itl,
            "offline_tok_s": offline_tokens / duration, "util": min(1.0, log.busy / duration),
            "preemptions_online": stats.num_preemptions_online, "preemptions_offline": stats.num_preemptions_offline,
            "steps": log.summary()}


def saturated_rate(loaded, base: dict, online: list[SampleRequest]) -> float:
    """Online requests per second with everything queued at once: an upper bound for the probe."""
    engine = LLMEngine(loaded, EngineArgs(**base))
    for i, sample in enumerate(online):
        engine.add_request(f"c{i}", sample.prompt, params(sample))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return len(online) / (time.perf_counter() - start)


def probe_capacity(loaded, base: dict, online: list[SampleRequest], upper: float, slo: float, duration: float,
                   steps: int) -> tuple[float, list[dict]]:
    """Highest Poisson rate (bisection in [0, upper]) whose online-only median ITL is within the SLO."""
    low, high, points = 0.0, upper, []
    for step in range(steps):
        rate = (low + high) / 2
        cell = run(loaded, base, "hybrid", poisson(rate, duration, 1000 + step), duration, online, [])
        p99 = percentile(list(cell["ttft"].values()), 99)
        itl = percentile([g for gaps in cell["itl"].values() for g in gaps], 50)
        points.append({"rate": rate, "ttft_p99": p99, "itl_p50": itl, "n": len(cell["ttft"]), "util": cell["util"]})
        print(f"probe: {rate:.3f} req/s -> online-only ITL p50 {itl * 1e3:.0f} ms, TTFT p99 {p99:.2f} s "
              f"(n={len(cell['ttft'])}, util {cell['util']:.0%})", flush=True)
        low, high = (rate, high) if itl <= slo else (low, rate)
    if low == 0.0:  # no probed rate met the SLO: run at the lowest one tried, and say so
        print(f"probe: no rate met the ITL SLO of {slo} s; using {high:.3f} req/s", flush=True)
        return high, points
    return low, points


def pooled(cells: list[dict]) -> tuple[dict, dict]:
    """TTFT and per-request ITL lists of several rounds, keyed (round, request)."""
    ttft = {(c["round"], i): v for c in cells for i, v in c["ttft"].items()}
    itl = {(c["round"], i): v for c in cells for i, v in c["itl"].items()}
    return ttft, itl


def p99_ratio_ci(base: list[dict], other: list[dict], resamples: int = 400) -> dict:
    """5-95% interval of other/base p99 TTFT and ITL, resampling requests (the same arrivals in both)."""
    (ttft_a, itl_a), (ttft_b, itl_b) = pooled(base), pooled(other)
    keys = sorted(set(ttft_a) & set(ttft_b))
    rng = random.Random(0)
    ratios: dict[str, list[float]] = {"ttft": [], "itl": []}
    for _ in range(resamples if keys else 0):
        picked = [keys[rng.randrange(len(keys))] for _ in keys]
        ratios["ttft"].append(percentile([ttft_b[k] for k in picked], 99)
                              / percentile([ttft_a[k] for k in picked], 99))
        gaps_a = [g for k in picked for g in itl_a.get(k, ())]
        gaps_b = [g for k in picked for g in itl_b.get(k, ())]
        if gaps_a and gaps_b:
            ratios["itl"].append(percentile(gaps_b, 99) / percentile(gaps_a, 99))
    return {name: [percentile(v, 5), percentile(v, 95)] for name, v in ratios.items()}


def summarize(load: float, schedule: str, cells: list[dict], leftover: float) -> dict:
    ttft, itl = pooled(cells)
    gaps = [g for v in itl.values() for g in v]
    row = {"load": load, "schedule": schedule, "rounds": len(cells), "n_ttft": len(ttft), "n_itl": len(gaps),
           "offline_tok_s": statistics.mean(c["offline_tok_s"] for c in cells),
           "util": statistics.mean(c["util"] for c in cells), "leftover_tok_s": leftover,
           "preemptions_offline": sum(c["preemptions_offline"] for c in cells),
           "preemptions_online": sum(c["preemptions_online"] for c in cells)}
    for q in (50, 90, 99):
        row[f"ttft_p{q}"] = percentile(list(ttft.values()), q)
        row[f"itl_p{q}"] = percentile(gaps, q)
    return row


def print_table(rows: list[dict]) -> None:
    print("\n| load | schedule | n (TTFT / ITL) | TTFT p50 / p90 / p99 s | ITL p50 / p90 / p99 ms | p99 vs online-only"
          " (TTFT, ITL; 5-95% CI) | offline tok/s | leftover x 0.7 | util |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ci = r.get("ci")
        ratio = "" if ci is None else (
            f"{r['ttft_p99_ratio']:.2f}x [{ci['ttft'][0]:.2f}-{ci['ttft'][1]:.2f}], "
            f"{r['itl_p99_ratio']:.2f}x [{ci['itl'][0]:.2f}-{ci['itl'][1]:.2f}]")
        print(f"| {r['load']:.0%} | {r['schedule']} | {r['n_ttft']} / {r['n_itl']} | "
              f"{r['ttft_p50']:.2f} / {r['ttft_p90']:.2f} / {r['ttft_p99']:.2f} | "
              f"{r['itl_p50'] * 1e3:.0f} / {r['itl_p90'] * 1e3:.0f} / {r['itl_p99'] * 1e3:.0f} | {ratio} | "
              f"{r['offline_tok_s']:.1f} | {0.7 * r['leftover_tok_s']:.1f} | {r['util']:.0%} |")


def print_steps(cells: list[dict]) -> None:
    """The step log, pooled over rounds: what each schedule's steps carried and how long they took."""
    print("\n| load | schedule | steps: offline-only / with online | with an online prompt | online seqs a step "
          "| online-decode step p50 ms | offline tokens alone / beside online (decodes) | measured/predicted p50 "
          "(mixed, offline-only) | offline-only: tokens a step, step p50 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    groups: dict[tuple[float, str], list[dict]] = {}
    for cell in cells:
        groups.setdefault((cell["load"], cell["schedule"]), []).append(cell)
    for (load, name), group in sorted(groups.items(), key=lambda kv: kv[0][0]):
        alone = [c["steps"]["offline-only"] for c in group]
        busy = [c["steps"][kind] for c in group for kind in ("mixed", "online-only")]
        steps = sum(b["steps"] for b in busy)
        seqs = sum(b["online_seqs_mean"] * b["steps"] for b in busy) / max(steps, 1)
        decode_p50s = [b["decode_only_p50"] for b in busy if b["decode_only_p50"] == b["decode_only_p50"]]
        decode_p50 = statistics.median(decode_p50s) if decode_p50s else float("nan")
        error, error_alone = (_mean_ratio(group, kind) for kind in ("mixed", "offline-only"))
        num_alone = sum(a["steps"] for a in alone)
        per_step = sum(a["offline_tokens"] for a in alone) / max(num_alone, 1)
        alone_p50s = [a["measured_p50"] for a in alone if a["steps"]]
        alone_p50 = statistics.median(alone_p50s) if alone_p50s else float("nan")
        print(f"| {load:.0%} | {name} | {sum(a['steps'] for a in alone)} / {steps} | "
              f"{sum(b['with_online_prefill'] for b in busy)} | {seqs:.1f} | {decode_p50 * 1e3:.0f} | "
              f"{sum(a['offline_tokens'] for a in alone)} / {sum(b['offline_tokens'] for b in busy)} "
              f"({sum(b['offline_decodes'] for b in busy)}) | {error:.2f}, {error_alone:.2f} | "
              f"{per_step:.0f}, {alone_p50 * 1e3:.0f} |")


def _mean_ratio(cells: list[dict], kind: str) -> float:
    """Mean over cells of the p50 measured / predicted step time of one kind of step (nan: none ran)."""
    ratios = [c["steps"][kind]["measured_over_predicted_p50"] for c in cells if c["steps"][kind]["steps"]]
    return statistics.mean(ratios) if ratios else float("nan")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals per cell")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of online-only and hybrid (new arrivals each)")
    parser.add_argument("--naive-rounds", type=int, default=1, help="rounds of the naive contrast")
    parser.add_argument("--loads", default="0.3,0.6,0.9")
    parser.add_argument("--offline", type=int, default=2000, help="batch lines (half HumanEval, half ShareGPT)")
    parser.add_argument("--online-prompts", type=int, default=200)
    parser.add_argument("--max-output-len", type=int, default=64)
    parser.add_argument("--kv-cache-memory", type=int, default=512 << 20)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--online-itl-slo", default="100ms")
    parser.add_argument("--online-ttft-slo", default="1s")
    parser.add_argument("--online-slowdown", type=float, default=SchedulerConfig().online_slowdown,
                        help="most offline work may lengthen a step of online decodes (share of its time alone)")
    parser.add_argument("--slowdowns", default="", help="more hybrid schedules at these --online-slowdown values")
    parser.add_argument("--saturated-requests", type=int, default=32, help="queued at once for the upper bound")
    parser.add_argument("--probe-duration", type=float, default=30.0)
    parser.add_argument("--probe-steps", type=int, default=4)
    parser.add_argument("--capacity", type=float, default=None, help="skip the probe: online requests/s")
    parser.add_argument("--capacity-share", type=float, default=None,
                        help="skip the probe: capacity = this share of the saturated rate measured now (the idle "
                             "machine's probe gave 1.5 of 1.97 req/s: 0.76), for a machine whose load moved")
    parser.add_argument("--baseline-from", default=None,
                        help="take the saturated rate, capacity and offline-alone rates from this earlier --out file")
    parser.add_argument("--out", default=None, help="JSON of every cell's samples (rewritten after each cell)")
    parser.add_argument("--report", default=None, help="print the table of a saved --out file and exit")
    return parser.parse_args()


def table(run_info: dict, cells: list[dict]) -> list[dict]:
    """Rows per load and schedule, pooled over rounds; ratios against online-only in the same rounds."""
    capacity, upper, alone = run_info["capacity_rps"], run_info["saturated_rps"], run_info["offline_alone_tok_s"]
    by_cell: dict[tuple[float, str], list[dict]] = {}
    for cell in cells:
        by_cell.setdefault((cell["load"], cell["schedule"]), []).append(cell)
    rows = []
    for load in sorted({load for load, _ in by_cell}):
        base_cells = by_cell[(load, "online-only")]
        leftover = max(alone.values()) * max(0.0, 1 - load * capacity / upper)
        for name in dict.fromkeys(c["schedule"] for c in cells):  # in the order they ran
            if (load, name) not in by_cell:
                continue
            row = summarize(load, name, by_cell[(load, name)], leftover)
            if name != "online-only":
                paired = [c for c in base_cells if c["round"] in {o["round"] for o in by_cell[(load, name)]}]
                head = summarize(load, "online-only", paired, leftover)
                row["ttft_p99_ratio"] = row["ttft_p99"] / head["ttft_p99"]
                row["itl_p99_ratio"] = row["itl_p99"] / head["itl_p99"]
                row["ci"] = p99_ratio_ci(paired, by_cell[(load, name)])
            rows.append(row)
    return rows


def save(path: str | None, run_info: dict, cells: list[dict]) -> None:
    """Everything measured so far (rewritten after each cell, so a cut-short run keeps its data)."""
    if path:
        raw = [{**c, "ttft": list(c["ttft"].items()), "itl": list(c["itl"].items())} for c in cells]
        with open(path, "w") as f:
            json.dump({**run_info, "cells": raw}, f, indent=1)


def load_saved(path: str) -> tuple[dict, list[dict]]:
    with open(path) as f:
        data = json.load(f)
    cells = [{**c, "ttft": dict(c["ttft"]), "itl": dict(c["itl"])} for c in data.pop("cells")]
    return data, cells


def measure_baseline(loaded, base: dict, ns: argparse.Namespace, online: list[SampleRequest],
                     offline: list[SampleRequest], itl_slo: float) -> dict:
    """The saturated rate, the capacity (given, a share of the saturated rate, or probed) and offline alone."""
    upper = saturated_rate(loaded, base, online[: ns.saturated_requests])
    capacity, probe = ns.capacity, []
    if capacity is None and ns.capacity_share is not None:
        capacity = ns.capacity_share * upper
    if capacity is None:
        capacity, probe = probe_capacity(loaded, base, online, upper, itl_slo, ns.probe_duration, ns.probe_steps)
    print(f"capacity: {capacity:.3f} online requests/s (all at once: {upper:.3f})", flush=True)
    alone_cells = {policy: run(loaded, base, policy, [], ns.duration, online, offline) for policy in ("fcfs", "hybrid")}
    alone = {policy: cell["offline_tok_s"] for policy, cell in alone_cells.items()}
    print(f"offline alone: {alone['fcfs']:.1f} tok/s whole steps, {alone['hybrid']:.1f} tok/s capped", flush=True)
    for policy, cell in alone_cells.items():
        steps = cell["steps"]["offline-only"]
        print(f"  {policy}: {steps['steps']} steps, {steps['offline_tokens'] / max(steps['steps'], 1):.0f} tokens "
              f"({steps['offline_decodes'] / max(steps['steps'], 1):.1f} decodes) a step, p50 "
              f"{steps['measured_p50'] * 1e3:.0f} ms, measured/predicted p50 "
              f"{steps['measured_over_predicted_p50']:.2f}", flush=True)
    return {"capacity_rps": capacity, "saturated_rps": upper, "probe": probe, "offline_alone_tok_s": alone,
            "offline_alone_steps": {p: c["steps"] for p, c in alone_cells.items()}}


def baseline_from(path: str, ns: argparse.Namespace) -> dict:
    """The saturated rate, capacity and offline-alone rates of an earlier run (--out file), so a run split
    in two (e.g. one load at a time) shares one baseline; --capacity still overrides the capacity."""
    saved, _ = load_saved(path)
    keys = ("capacity_rps", "saturated_rps", "probe", "offline_alone_tok_s", "offline_alone_steps")
    info = {key: saved[key] for key in keys} | {"baseline_from": path}
    if ns.capacity is not None:
        info["capacity_rps"] = ns.capacity
    print(f"baseline from {path}: capacity {info['capacity_rps']:.3f} req/s (all at once: "
          f"{info['saturated_rps']:.3f}), offline alone {info['offline_alone_tok_s']}", flush=True)
    return info


def main() -> None:
    ns = parse_args()
    if ns.report:
        run_info, cells = load_saved(ns.report)
        print_table(table(run_info, cells))
        print_steps(cells)
        return
    loaded = load_model(ns.model)
    tokenizer = load_tokenizer(ns.model)
    limits = LengthLimits(max_output_len=ns.max_output_len, max_prompt_len=512)
    online = load_sharegpt(ns.online_prompts, tokenizer, limits, seed=0)
    offline = (load_humaneval(ns.offline // 2, tokenizer, limits, seed=1)
               + load_sharegpt(ns.offline - ns.offline // 2, tokenizer, limits, seed=2, split="train"))
    base = {"model": ns.model, "kv_cache_memory": ns.kv_cache_memory, "max_model_len": ns.max_model_len,
            "online_itl_slo": ns.online_itl_slo, "online_ttft_slo": ns.online_ttft_slo,
            "max_offline_queued_tokens": 1 << 30, "online_slowdown": ns.online_slowdown}
    slo = EngineArgs(**base).configs()[2]
    cpu = cpu_info()
    print(f"{cpu.model} ({platform.machine()}); step cap {step_cap(slo) * 1e3:.0f} ms", flush=True)
    if ns.baseline_from:
        run_info = baseline_from(ns.baseline_from, ns)
    else:
        run_info = measure_baseline(loaded, base, ns, online, offline, slo.online_itl_slo)
    run_info.update(cpu=str(cpu), args=vars(ns))
    capacity = run_info["capacity_rps"]
    cells: list[dict] = []
    extra = [float(x) for x in ns.slowdowns.split(",") if x]
    for round_ in range(ns.rounds):
        for load in (float(x) for x in ns.loads.split(",")):
            arrivals = poisson(load * capacity, ns.duration, seed=round_ * 1000 + int(load * 100))
            schedules = [("online-only", "hybrid", [], base), ("hybrid", "hybrid", offline, base),
                         *((f"hybrid s={x:g}", "hybrid", offline, {**base, "online_slowdown": x}) for x in extra),
                         ("naive", "fcfs", offline, base)]
            for name, policy, batch, args in schedules:
                if name == "naive" and round_ >= ns.naive_rounds:
                    continue
                cell = run(loaded, args, policy, arrivals, ns.duration, online, batch)
                cell.update(round=round_, load=load, schedule=name)
                cells.append(cell)
                save(ns.out, run_info, cells)
                print(json.dumps({k: v for k, v in cell.items() if k not in ("ttft", "itl")}), flush=True)
    print_table(table(run_info, cells))
    print_steps(cells)


if __name__ == "__main__":
    main()
