"""Validate the simulator against real replicas: the same trace, real cluster vs `threefold simulate`.

    flock /tmp/threefold-bench.lock python benchmarks/sim_validation.py --replicas 2 --sessions 16 \\
        --turns 3 --rate 0.4 --policies round_robin,dualmap --out results/sim_validation

1. Calibrate (`threefold bench calibrate`, one thread pinned to core 0, the replicas' KV budget),
   unless --calibration names a file.
2. Start N `threefold serve` replicas, replica i pinned to core i mod #cores with one thread each,
   so that replicas are the independent machines the simulator assumes. Measure the HTTP path's
   dispatch and report delays with short requests one at a time (`threefold.sim.delays.probe`)
   and add them to the engine model (also measured again over each policy's run, for the record).
3. Per policy: a router configured from the calibration (block size, cache size, tpct), and
   ShareGPT sessions replayed on the simulator's own schedule (`Trace.arrivals`: Poisson session
   starts at rate / turns, each later turn an exponential think time after the previous answer).
   Each policy's first user messages carry a tag, so its sessions start cold.
4. The trace the real run produced (each prompt's real token ids, hashed into blocks as the router
   and engines do; each answer's real length) is simulated with the same policy, rate and seed.
   Twice: with the arrival times the real run had (`replayed`: the simulator's engine, cache and
   router model on the same requests in the same order), and on the simulator's own closed-loop
   schedule (`own schedule`: think times after simulated answers, as `threefold simulate` runs).
5. TTFT p50/p90/p99/mean and prefix hit rate, real against simulated, and the relative error.
6. The replicas log every step (`--step-log`): per policy, how much slower or faster their real steps ran
   than the calibration prices the same shapes (`EngineModel.drift`), which is the part of the error
   that is the calibration's rather than the simulator's.

Out of sample (`--calibration-from DIR`): the engine model is fitted to the step logs an earlier run left
in DIR (`threefold.sim.step_fit`) instead of a startup calibration, and this run (another seed: other
sessions, another schedule) validates it; the router is configured from it too. With --resimulate the
other way round: an earlier run's records simulated with the model fitted to a later run's logs.

    tfquiet timeout 700 python benchmarks/sim_validation.py ... --seed 1 --out results/valA
    tfquiet timeout 700 python benchmarks/sim_validation.py ... --seed 2 --calibration-from results/valA \
        --out results/valB                                                                      # A -> B
    python benchmarks/sim_validation.py --resimulate --calibration-from results/valB --out results/valA  # B -> A
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import uvicorn
from routing import stream_turn  # benchmarks/ is on sys.path: this script's own folder

from threefold.bench.datasets import LengthLimits, load_sharegpt_sessions
from threefold.bench.tokenizer import load_tokenizer
from threefold.engine.step_log import read_step_log
from threefold.router.app import build_app
from threefold.router.cli import free_port, wait_healthy
from threefold.router.keys import PromptKeyer
from threefold.router.proxy import ProxyConfig, Router
from threefold.router.radix import block_hashes, prefix_key
from threefold.sim.delays import Delays, delays_between, probe, scrape
from threefold.sim.engine_model import EngineModel
from threefold.sim.simulator import Simulator, router_config
from threefold.sim.step_fit import calibrate_from_step_logs
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


def step_log_model(dirs: str, base: EngineModel | None) -> EngineModel:
    """The engine model fitted to every replica step log (steps_*.jsonl) in these comma-separated folders."""
    logs = sorted(log for folder in dirs.split(",") for log in Path(folder).glob("steps_*.jsonl"))
    if not logs:
        raise SystemExit(f"no steps_*.jsonl in {dirs}")
    return calibrate_from_step_logs(logs, base)


def base_model(ns: argparse.Namespace) -> EngineModel | None:
    """Where a step-log fit takes the pool, block size and batch limits from: --calibration, or the
    first --calibration-from folder's own calibration.json (the replicas' pool is measured anyway)."""
    if ns.calibration:
        return EngineModel.load(ns.calibration)
    first = Path(ns.calibration_from.split(",")[0]) / "calibration.json"
    return EngineModel.load(first) if first.exists() else None


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
                sent = time.perf_counter() - t0
                result = stream_turn(client, url, ns.model, messages, ns.max_tokens)
                result["sent"] = sent
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


def trace_of(records: list[list[dict]], model: EngineModel, key_tokens: int, think_s: float,
             replayed: bool = False) -> Trace:
    """The real run's requests; `replayed`: at the times they were sent (else the simulator's schedule)."""
    bs = model.block_size
    sessions = [[Turn(len(r["prompt_ids"]), max(1, r["output"]), block_hashes(r["prompt_ids"], bs),
                      block_hashes(r["prompt_ids"] + r["answer_ids"], bs), prefix_key(r["prompt_ids"], bs, key_tokens))
                 for r in session] for session in records]
    times = [[r["sent"] for r in session] for session in records] if replayed else None
    return Trace("replayed" if replayed else "scheduled", sessions, think_s, times)


def summary(ttfts: list[float], hit_rate: float) -> dict:
    p50, p90, p99 = np.percentile(ttfts, [50, 90, 99]).tolist()
    return {"ttft_p50": p50, "ttft_p90": p90, "ttft_p99": p99, "ttft_mean": statistics.fmean(ttfts),
            "hit_rate": hit_rate}


def run_policy(policy: str, urls: list[str], ns, sessions, keyer, model: EngineModel, schedule) -> dict:
    with serving_router(Router(urls, policy, router_config(model, ns.slo, ns.seed), keyer, ProxyConfig())) as url:
        before, began = scrape(url, urls), time.time()
        records = replay(url, ns, sessions, f"{policy}-{ns.seed}", keyer, *schedule)
        in_run, ended = delays_between(before, scrape(url, urls)), time.time()
        state = httpx.get(f"{url}/router/state").json()["backends"]
    (Path(ns.out) / f"records_{policy}.json").write_text(json.dumps(records))  # to re-simulate without a rerun
    steps = [step for i in range(len(urls)) for step in read_step_log(step_log(ns, i), began, ended)]
    return {**compare(policy, records, ns, model, len(urls)), "routed": [s.get("routed", 0) for s in state.values()],
            "delays_in_run": dataclasses.asdict(in_run) if in_run else None, "drift": model.drift(steps),
            "window": [began, ended]}


def step_log(ns, replica: int) -> Path:
    return Path(ns.out) / f"steps_{replica}.jsonl"


def compare(policy: str, records: list[list[dict]], ns, model: EngineModel, num_replicas: int) -> dict:
    rows = [r for s in records for r in s]
    mismatched = sum(len(r["prompt_ids"]) != r["prompt"] for r in rows)
    real = summary([r["ttft"] for r in rows if r["ttft"] is not None],
                   sum(r["cached"] for r in rows) / max(1, sum(r["prompt"] for r in rows)))
    key_tokens = router_config(model, ns.slo, ns.seed).key_tokens
    row = {"policy": policy, "requests": len(rows), "prompt_len_mismatches": mismatched, "real": real}
    for name, replayed in (("replayed", True), ("scheduled", False)):
        if replayed and any("sent" not in r for r in rows):
            continue  # records of an older run
        sim = Simulator(model, num_replicas, policy, ns.slo, ns.seed).run(
            trace_of(records, model, key_tokens, ns.think, replayed), ns.rate)
        simulated = {"ttft_p50": sim.ttft_p50, "ttft_p90": sim.ttft_p90, "ttft_p99": sim.ttft_p99,
                     "ttft_mean": sim.ttft_mean, "hit_rate": sim.hit_rate}
        row[name] = {"sim": simulated, "error": {k: simulated[k] / real[k] - 1 if real[k] else None for k in real}}
    return row


def probe_delays(urls: list[str], ns, keyer, model: EngineModel) -> Delays:
    """The dispatch and report delays on idle replicas, through a round-robin router (2 requests each)."""
    with serving_router(Router(urls, "round_robin", router_config(model, ns.slo, ns.seed), keyer,
                               ProxyConfig())) as url:
        probe(url, urls, ns.model, 2)  # warm-up: first requests build caches
        return probe(url, urls, ns.model, 4 * len(urls))


@contextlib.contextmanager
def serving_router(router: Router) -> Iterator[str]:
    """The router's app on a free loopback port, in a thread, for the block's duration -> its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(router), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    while not _healthy(url):
        time.sleep(0.1)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(10)


def _gauge(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return next(s.value for f in text_string_to_metric_families(text) if f.name == name for s in f.samples)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def start_replicas(ns) -> tuple[list[subprocess.Popen], list[str]]:
    engines, urls = [], []
    cores = os.cpu_count() or 1
    for i in range(ns.replicas):
        port = free_port()
        cmd = [sys.executable, "-m", "threefold.cli", "serve", "--model", ns.model, "--port", str(port),
               f"--kv-cache-memory={ns.kv_cache_memory}", "--max-model-len=2048", f"--step-log={step_log(ns, i)}"]
        engines.append(subprocess.Popen(pinned(cmd, i % cores), env={**os.environ, **PINNED_ENV},
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for url, process in zip(urls, engines, strict=True):
            wait_healthy(url, process)
    except BaseException:  # Ctrl-C or a replica that died: leave no orphans
        stop(engines)
        raise
    return engines, urls


def stop(engines: list[subprocess.Popen]) -> None:
    for process in engines:
        process.terminate()
    for process in engines:
        process.wait(30)


def markdown(report: dict) -> str:
    delays = report.get("delays") or {}
    head = (f"idle probe: dispatch delay {delays.get('dispatch_s', 0.0) * 1e3:.1f} ms, "
            f"report delay {delays.get('report_s', 0.0) * 1e3:.1f} ms")
    for row in report["policies"]:
        run = row.get("delays_in_run") or {}
        if run:
            head += (f"; {row['policy']} run: {run['dispatch_s'] * 1e3:.1f} / {run['report_s'] * 1e3:.1f} ms"
                     f" over {run['requests']} requests, routed {row.get('routed')}")
    lines = [head, "", "| policy | metric | real | sim, replayed | error | sim, own schedule | error |",
             "|---|---|---|---|---|---|---|"]
    for row in report["policies"]:
        for key in ("ttft_p50", "ttft_p90", "ttft_p99", "ttft_mean", "hit_rate"):
            cells = []
            for name in ("replayed", "scheduled"):
                sim = row.get(name)
                if sim is None:
                    cells += ["-", "-"]
                    continue
                err = sim["error"][key]
                cells += [f"{sim['sim'][key]:.3f}", "-" if err is None else f"{err:+.1%}"]
            lines.append(f"| {row['policy']} | {key} | {row['real'][key]:.3f} | {' | '.join(cells)} |")
    lines += ["", "Calibration drift: the replicas' steps in each run, measured / modelled seconds (steps)", "",
              "| policy | all | decode only | prefill < 512 | prefill >= 512 |", "|---|---|---|---|---|"]
    for row in report["policies"]:
        drift = row.get("drift") or {}
        cells = [f"{drift[k]['ratio']:.3f} ({drift[k]['steps']})" if k in drift else "-"
                 for k in ("all", "decode only", "prefill < 512", "prefill >= 512")]
        lines.append(f"| {row['policy']} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def resimulate(ns: argparse.Namespace) -> dict:
    """The report of an earlier run (in --out) simulated again, with --calibration or --calibration-from."""
    out = Path(ns.out)
    previous = json.loads((out / "validation.json").read_text())
    for key in ("rate", "slo", "seed", "think", "turns"):  # the run's own schedule and router settings
        setattr(ns, key, previous["args"][key])
    if ns.calibration_from:
        model = step_log_model(ns.calibration_from, EngineModel.load(ns.calibration or previous["calibration"]))
    else:
        model = EngineModel.load(ns.calibration or previous["calibration"])
    delays = Delays(**previous["delays"]) if previous.get("delays") and not ns.no_delays else Delays(0.0, 0.0, 0)
    model = delays.apply(dataclasses.replace(model, num_blocks=previous["num_blocks"]))
    report = {**previous, "calibration": model.source or ns.calibration or previous["calibration"], "policies": [],
              "delays": dataclasses.asdict(delays)}
    for row in previous["policies"]:
        records = json.loads((out / f"records_{row['policy']}.json").read_text())
        in_run = row.get("delays_in_run") if ns.in_run_delays and not ns.no_delays else None
        row_model = Delays(**in_run).apply(model) if in_run else model  # the HTTP path at the run's own load
        replicas = previous["args"]["replicas"]
        logs = [step_log(ns, i) for i in range(replicas) if step_log(ns, i).exists()]
        # this model's drift over the policy's run (runs before the "window" field: over the whole run)
        steps = [step for log in logs for step in read_step_log(log, *row.get("window", []))]
        report["policies"].append({**row, **compare(row["policy"], records, ns, row_model, replicas),
                                   "drift": model.drift(steps) if steps else row.get("drift")})
    if ns.report:
        Path(ns.report).write_text(json.dumps(report, indent=1) + "\n")
    return report


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
    parser.add_argument("--calibration-from", default=None, metavar="DIR[,DIR...]",
                        help="fit the engine model to the replica step logs (steps_*.jsonl) an earlier run left "
                             "in DIR instead (out of sample: validate on another run); the pool and limits from "
                             "--calibration or DIR/calibration.json")
    parser.add_argument("--report", default=None, help="with --resimulate: also write the report's JSON here")
    parser.add_argument("--resimulate", action="store_true",
                        help="no real run: simulate the records_<policy>.json a run left in --out again "
                             "(with --calibration, e.g. a refitted one)")
    parser.add_argument("--no-delays", action="store_true", help="with --resimulate: without the HTTP delays")
    parser.add_argument("--in-run-delays", action="store_true",
                        help="with --resimulate: each policy with the HTTP delays measured over its own run "
                             "(the path's cost at that load) instead of the idle probe's")
    parser.add_argument("--out", required=True)
    ns = parser.parse_args()
    if ns.resimulate:
        report = resimulate(ns)
        print(f"engine model: {report['calibration']}\n\n{markdown(report)}")
        return
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    if ns.calibration_from:
        model = step_log_model(ns.calibration_from, base_model(ns))
        model.save(out / "step_log_model.json")
        cal = out / "step_log_model.json"
    else:
        cal = Path(ns.calibration) if ns.calibration else calibrate(ns, out)
        model = EngineModel.load(cal)
    tokenizer = load_tokenizer(ns.model)
    sessions = load_sharegpt_sessions(ns.sessions, tokenizer, LengthLimits(max_output_len=ns.max_tokens,
                                                                           max_total_len=1536),
                                      seed=ns.seed, min_turns=ns.turns)
    placeholder = Trace("schedule", [[None] * ns.turns for _ in sessions], ns.think)  # type: ignore[list-item]
    schedule = placeholder.arrivals(ns.rate, ns.seed)
    keyer = PromptKeyer(ns.model)
    engines, urls = start_replicas(ns)
    try:
        capacity = _gauge(httpx.get(f"{urls[0]}/metrics").text, "threefold:kv_cache_capacity_tokens")
        model = dataclasses.replace(model, num_blocks=int(capacity) // model.block_size)  # the replicas' pool
        report = {"args": vars(ns), "calibration": str(cal), "cpu": model.cpu, "num_blocks": model.num_blocks,
                  "policies": []}
        delays = probe_delays(urls, ns, keyer, model)
        model = delays.apply(model)
        report["delays"] = dataclasses.asdict(delays)
        print(f"HTTP delays: {report['delays']}", flush=True)
        for policy in ns.policies.split(","):
            report["policies"].append(run_policy(policy, urls, ns, sessions, keyer, model, schedule))
            print(json.dumps(report["policies"][-1]), flush=True)
            (out / "validation.json").write_text(json.dumps(report, indent=1) + "\n")  # (--resimulate reads it)
    finally:
        stop(engines)
    (out / "validation.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
