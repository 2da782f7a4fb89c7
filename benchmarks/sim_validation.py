"""Validate the simulator against real replicas: the same trace, real cluster vs `threefold simulate`.

    flock /tmp/threefold-bench.lock python benchmarks/sim_validation.py --replicas 2 --sessions 16 \\
        --turns 3 --rate 0.4 --policies round_robin,dualmap --out results/sim_validation

1. Calibrate (`threefold bench calibrate`, one thread pinned to core 0, the replicas' KV budget),
   unless --calibration names a file.
2. Start N `threefold serve` replicas, replica i pinned to core i mod #cores with one thread each,
   so that replicas are the independent machines the simulator assumes.
3. Per policy: a router configured from the calibration (block size, cache size, tpct), and
   ShareGPT sessions replayed on the simulator's own schedule (`Trace.arrivals`: Poisson session
   starts at rate / turns, each later turn an exponential think time after the previous answer).
   Each policy's first user messages carry a tag, so its sessions start cold.
4. The trace the real run produced (each prompt's real token ids, hashed into blocks as the router
   and engines do; each answer's real length) is simulated with the same policy, rate and seed.
5. TTFT p50/p90/p99/mean and prefix hit rate, real against simulated, and the relative error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import uvicorn
from routing import stream_turn  # benchmarks/ is on sys.path: this script's own folder

from threefold.bench.datasets import LengthLimits, load_sharegpt_sessions
from threefold.bench.tokenizer import load_tokenizer
from threefold.router.app import build_app
from threefold.router.cli import free_port, wait_healthy
from threefold.router.keys import PromptKeyer
from threefold.router.proxy import ProxyConfig, Router
from threefold.router.radix import block_hashes, prefix_key
from threefold.sim.engine_model import EngineModel
from threefold.sim.simulator import Simulator, router_config
from threefold.sim.traces import Trace, Turn

PINNED_ENV = {"OMP_NUM_THREADS": "1", "THREEFOLD_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def pinned(cmd: list[str], core: int) -> list[str]:
    return ["taskset", "-c", str(core), *cmd]


def calibrate(ns: argparse.Namespace, out: Path) -> Path:
    """The engine's default KV budget here (its decode shapes need it); the pool size is the replicas'."""
    path = out / "calibration.json"
    cmd = [sys.executable, "-m", "threefold.cli", "bench", "calibrate", "--model", ns.model, "--out", str(path)]
    subprocess.run(pinned(cmd, 0), env={**os.environ, **PINNED_ENV}, check=True)
    return path


def replay(url: str, ns, sessions, tag: str, keyer: PromptKeyer, starts, thinks) -> list[list[dict]]:
    """Each session in its own thread on the simulator's schedule; per turn its record."""
    t0 = time.perf_counter()
    records: list[list[dict]] = [[] for _ in sessions]

    def run(index: int) -> None:
        messages: list[dict] = []
        with httpx.Client(timeout=600) as client:
            time.sleep(max(0.0, starts[index] - (time.perf_counter() - t0)))
            for turn, user in enumerate(sessions[index].user_turns[:ns.turns]):
                messages.append({"role": "user", "content": f"[{tag}] {user}" if turn == 0 else user})
                ids = keyer.token_ids("/v1/chat/completions", {"messages": messages})
                result = stream_turn(client, url, ns.model, messages, ns.max_tokens)
                answer_ids = keyer.hf.encode(result["text"], add_special_tokens=False)
                records[index].append({**result, "prompt_ids": ids, "answer_ids": answer_ids})
                messages.append({"role": "assistant", "content": result["text"]})
                if turn + 1 < ns.turns:
                    time.sleep(float(thinks[index * ns.turns + turn]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sessions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return records


def trace_of(records: list[list[dict]], model: EngineModel, key_tokens: int, think_s: float) -> Trace:
    bs = model.block_size
    sessions = [[Turn(len(r["prompt_ids"]), max(1, r["output"]), block_hashes(r["prompt_ids"], bs),
                      block_hashes(r["prompt_ids"] + r["answer_ids"], bs), prefix_key(r["prompt_ids"], bs, key_tokens))
                 for r in session] for session in records]
    return Trace("replayed", sessions, think_s)


def summary(ttfts: list[float], hit_rate: float) -> dict:
    p50, p90, p99 = np.percentile(ttfts, [50, 90, 99]).tolist()
    return {"ttft_p50": p50, "ttft_p90": p90, "ttft_p99": p99, "ttft_mean": statistics.fmean(ttfts),
            "hit_rate": hit_rate}


def run_policy(policy: str, urls: list[str], ns, sessions, keyer, model: EngineModel, schedule) -> dict:
    config = router_config(model, ns.slo, ns.seed)
    router = Router(urls, policy, config, keyer, ProxyConfig())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(router), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    while not _healthy(url):
        time.sleep(0.1)
    records = replay(url, ns, sessions, f"{policy}-{ns.seed}", keyer, *schedule)
    state = httpx.get(f"{url}/router/state").json()["backends"]
    server.should_exit = True
    thread.join(10)
    (Path(ns.out) / f"records_{policy}.json").write_text(json.dumps(records))  # to re-simulate without a rerun
    return {**compare(policy, records, ns, model, len(urls)), "routed": [s.get("routed", 0) for s in state.values()]}


def compare(policy: str, records: list[list[dict]], ns, model: EngineModel, num_replicas: int) -> dict:
    rows = [r for s in records for r in s]
    mismatched = sum(len(r["prompt_ids"]) != r["prompt"] for r in rows)
    real = summary([r["ttft"] for r in rows if r["ttft"] is not None],
                   sum(r["cached"] for r in rows) / max(1, sum(r["prompt"] for r in rows)))
    trace = trace_of(records, model, router_config(model, ns.slo, ns.seed).key_tokens, ns.think)
    sim = Simulator(model, num_replicas, policy, ns.slo, ns.seed).run(trace, ns.rate)
    simulated = {"ttft_p50": sim.ttft_p50, "ttft_p90": sim.ttft_p90, "ttft_p99": sim.ttft_p99,
                 "ttft_mean": sim.ttft_mean, "hit_rate": sim.hit_rate}
    error = {k: simulated[k] / real[k] - 1 if real[k] else None for k in real}
    return {"policy": policy, "requests": len(rows), "prompt_len_mismatches": mismatched, "real": real,
            "sim": simulated, "error": error}


def _gauge(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return next(s.value for f in text_string_to_metric_families(text) if f.name == name for s in f.samples)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def start_replicas(ns, model_path: Path | None = None) -> tuple[list[subprocess.Popen], list[str]]:
    engines, urls = [], []
    cores = os.cpu_count() or 1
    for i in range(ns.replicas):
        port = free_port()
        cmd = [sys.executable, "-m", "threefold.cli", "serve", "--model", ns.model, "--port", str(port),
               f"--kv-cache-memory={ns.kv_cache_memory}", "--max-model-len=2048"]
        engines.append(subprocess.Popen(pinned(cmd, i % cores), env={**os.environ, **PINNED_ENV},
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{port}")
    for url, process in zip(urls, engines, strict=True):
        wait_healthy(url, process)
    return engines, urls


def markdown(report: dict) -> str:
    lines = ["| policy | metric | real | simulated | error |", "|---|---|---|---|---|"]
    for row in report["policies"]:
        for key in ("ttft_p50", "ttft_p90", "ttft_p99", "ttft_mean", "hit_rate"):
            err = row["error"][key]
            lines.append(f"| {row['policy']} | {key} | {row['real'][key]:.3f} | {row['sim'][key]:.3f} "
                         f"| {'-' if err is None else f'{err:+.1%}'} |")
    return "\n".join(lines) + "\n"


def resimulate(ns: argparse.Namespace) -> None:
    out = Path(ns.out)
    previous = json.loads((out / "validation.json").read_text())
    for key in ("rate", "slo", "seed", "think", "turns"):  # the run's own schedule and router settings
        setattr(ns, key, previous["args"][key])
    model = EngineModel.load(ns.calibration or previous["calibration"])
    model = dataclasses.replace(model, num_blocks=previous["num_blocks"])
    report = {**previous, "calibration": ns.calibration or previous["calibration"], "policies": []}
    for row in previous["policies"]:
        records = json.loads((out / f"records_{row['policy']}.json").read_text())
        report["policies"].append({**compare(row["policy"], records, ns, model, previous["args"]["replicas"]),
                                   "routed": row["routed"]})
    print(markdown(report))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--rate", type=float, default=0.4, help="requests/s offered to the whole cluster")
    parser.add_argument("--think", type=float, default=5.0, help="mean think time between turns, s")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--slo", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--policies", default="round_robin,dualmap")
    parser.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    parser.add_argument("--calibration", default=None, help="engine model JSON (default: calibrate first)")
    parser.add_argument("--resimulate", action="store_true",
                        help="no real run: simulate the records_<policy>.json a run left in --out again "
                             "(with --calibration, e.g. a refitted one)")
    parser.add_argument("--out", required=True)
    ns = parser.parse_args()
    if ns.resimulate:
        resimulate(ns)
        return
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    cal = Path(ns.calibration) if ns.calibration else calibrate(ns, out)
    model = EngineModel.load(cal)
    tokenizer = load_tokenizer(ns.model)
    sessions = load_sharegpt_sessions(ns.sessions, tokenizer, LengthLimits(max_output_len=ns.max_tokens,
                                                                           max_total_len=1536), min_turns=ns.turns)
    placeholder = Trace("schedule", [[None] * ns.turns for _ in sessions], ns.think)  # type: ignore[list-item]
    schedule = placeholder.arrivals(ns.rate, ns.seed)
    keyer = PromptKeyer(ns.model)
    engines, urls = start_replicas(ns)
    capacity = _gauge(httpx.get(f"{urls[0]}/metrics").text, "threefold:kv_cache_capacity_tokens")
    model = dataclasses.replace(model, num_blocks=int(capacity) // model.block_size)  # the replicas' pool
    report = {"args": vars(ns), "calibration": str(cal), "cpu": model.cpu, "num_blocks": model.num_blocks,
              "policies": []}
    try:
        for policy in ns.policies.split(","):
            report["policies"].append(run_policy(policy, urls, ns, sessions, keyer, model, schedule))
            print(json.dumps(report["policies"][-1]), flush=True)
    finally:
        for process in engines:
            process.terminate()
        for process in engines:
            process.wait(30)
    (out / "validation.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "validation.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
