"""Hybrid offline/online scheduling: online latency and offline throughput, three schedules side by side.

    flock /tmp/threefold-bench.lock .venv/bin/python benchmarks/hybrid.py --duration 60 --loads 0.3,0.6,0.9 \
        --offline 2000 --out results/hybrid.json

One process, one loaded model. First the online capacity is measured (ShareGPT test-split first
turns, all submitted at once: completed requests per second). Then, for each load (a share of that
capacity), online requests arrive as a Poisson process for --duration seconds under three schedules:

    online-only  no batch work
    hybrid       a batch of --offline lines (HumanEval + ShareGPT) submitted at t=0 as request_class
                 "offline" under scheduling_policy="hybrid"
    naive        the same batch as plain requests in arrival order (scheduling_policy="fcfs")

    TTFT / ITL p50, p99   online requests, from their arrival time (engine-side, no HTTP)
    offline tok/s         offline output tokens / run time
    util                  share of the run's wall time spent in engine steps with work
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time

from threefold.bench.datasets import LengthLimits, SampleRequest, load_humaneval, load_sharegpt
from threefold.bench.tokenizer import load_tokenizer
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


def measure_capacity(loaded, base: dict, online: list[SampleRequest]) -> float:
    """Online requests per second with everything queued at once (the saturated rate)."""
    engine = LLMEngine(loaded, EngineArgs(**base))
    for i, sample in enumerate(online):
        engine.add_request(f"c{i}", sample.prompt, params(sample))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return len(online) / (time.perf_counter() - start)


def run(loaded, base: dict, policy: str, rate: float, duration: float, online: list[SampleRequest],
        offline: list[SampleRequest], seed: int) -> dict:
    engine = LLMEngine(loaded, EngineArgs(**base, scheduling_policy=policy))
    for i, sample in enumerate(offline):
        engine.add_request(f"off{i}", sample.prompt, params(sample), output_kind=RequestOutputKind.DELTA,
                           request_class="offline")
    rng = random.Random(seed)
    arrivals, t = [], rng.expovariate(rate)
    while t < duration:
        arrivals.append(t)
        t += rng.expovariate(rate)
    arrival_of: dict[str, float] = {}
    last_token: dict[str, float] = {}
    ttft: list[float] = []
    itl: list[float] = []
    offline_tokens, busy, next_online = 0, 0.0, 0
    start = time.perf_counter()
    while True:
        now = time.perf_counter() - start
        while next_online < len(arrivals) and arrivals[next_online] <= now:
            sample, rid = online[next_online % len(online)], f"on{next_online}"
            engine.add_request(rid, sample.prompt, params(sample), arrival_time=start + arrivals[next_online],
                               output_kind=RequestOutputKind.DELTA)
            arrival_of[rid] = arrivals[next_online]
            next_online += 1
        if now >= duration and not any(rid in engine.requests for rid in arrival_of):
            break
        if not engine.has_unfinished_requests():
            time.sleep(min(0.005, max(arrivals[next_online] - now, 0)) if next_online < len(arrivals) else 0.005)
            continue
        step_start = time.perf_counter()
        outputs = engine.step()
        stamp = time.perf_counter() - start
        busy += stamp - (step_start - start)
        for output in outputs:
            num_new = sum(len(c.token_ids) for c in output.outputs)
            if output.request_id.startswith("off"):
                offline_tokens += num_new if stamp <= duration else 0
            elif num_new:
                rid = output.request_id
                if rid in last_token:
                    itl.append((stamp - last_token[rid]) / num_new)
                else:
                    ttft.append(stamp - arrival_of[rid])
                last_token[rid] = stamp
    wall = time.perf_counter() - start
    stats = engine.get_stats()
    return {"policy": policy, "rate": rate, "online_requests": len(arrivals), "ttft_p50": percentile(ttft, 50),
            "ttft_p99": percentile(ttft, 99), "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99),
            "offline_tok_s": offline_tokens / duration, "util": busy / wall,
            "preemptions_online": stats.num_preemptions_online, "preemptions_offline": stats.num_preemptions_offline}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--loads", default="0.3,0.6,0.9")
    parser.add_argument("--offline", type=int, default=2000, help="batch lines (half HumanEval, half ShareGPT)")
    parser.add_argument("--online-prompts", type=int, default=200)
    parser.add_argument("--max-output-len", type=int, default=128)
    parser.add_argument("--kv-cache-memory", type=int, default=512 << 20)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--online-itl-slo", default="100ms")
    parser.add_argument("--online-ttft-slo", default="1s")
    parser.add_argument("--out", default=None)
    ns = parser.parse_args()
    loaded = load_model(ns.model)
    tokenizer = load_tokenizer(ns.model)
    limits = LengthLimits(max_output_len=ns.max_output_len, max_prompt_len=512)
    online = load_sharegpt(ns.online_prompts, tokenizer, limits, seed=0)
    offline = (load_humaneval(ns.offline // 2, tokenizer, limits, seed=1)
               + load_sharegpt(ns.offline - ns.offline // 2, tokenizer, limits, seed=2, split="train"))
    base = {"model": ns.model, "kv_cache_memory": ns.kv_cache_memory, "max_model_len": ns.max_model_len,
            "online_itl_slo": ns.online_itl_slo,
            "online_ttft_slo": ns.online_ttft_slo, "max_offline_queued_tokens": 1 << 30}
    capacity = measure_capacity(loaded, base, online[: max(8, ns.online_prompts // 4)])
    cpu = cpu_info()
    print(f"capacity: {capacity:.3f} online requests/s on {cpu.model} ({platform.machine()})", flush=True)
    rows = []
    for load in (float(x) for x in ns.loads.split(",")):
        for name, policy, batch in (("online-only", "hybrid", []), ("hybrid", "hybrid", offline),
                                    ("naive", "fcfs", offline)):
            row = run(loaded, base, policy, load * capacity, ns.duration, online, batch, seed=int(load * 100))
            row.update(schedule=name, load=load)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| load | schedule | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | offline tok/s | util |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['load']:.0%} | {r['schedule']} | {r['ttft_p50']:.3f} | {r['ttft_p99']:.3f} | "
              f"{r['itl_p50'] * 1e3:.1f} ms | {r['itl_p99'] * 1e3:.1f} ms | {r['offline_tok_s']:.1f} | "
              f"{r['util']:.0%} |")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"cpu": str(cpu), "capacity_rps": capacity, "args": vars(ns), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
