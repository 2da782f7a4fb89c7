"""Every routing policy on the same real replicas and the same multi-turn ShareGPT sessions.

    flock /tmp/threefold-bench.lock python benchmarks/routing.py --replicas 2 --sessions 8 --turns 3

Starts N `threefold serve` processes once; for each policy, an in-process router over them
replays the sessions (each session turn by turn, `--concurrency` sessions at a time,
streamed chat, greedy). Each policy's first user messages carry a per-policy tag, so its
sessions start cold (only the chat template's first block is shared across runs).
Reports TTFT p50/p99, throughput, the backends' prefix hit rate (usage.cached_tokens over
prompt tokens) and load imbalance (max/mean prompt tokens routed per backend).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import uvicorn

from threefold.bench.datasets import LengthLimits, load_sharegpt_sessions
from threefold.bench.tokenizer import load_tokenizer
from threefold.router.app import build_app
from threefold.router.cli import free_port, wait_healthy
from threefold.router.config import RouterConfig
from threefold.router.keys import PromptKeyer
from threefold.router.policies import policy_names
from threefold.router.proxy import ProxyConfig, Router
from threefold.sim.engine_model import EngineModel
from threefold.sim.simulator import router_config


def stream_turn(client: httpx.Client, url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat turn: TTFT and end-to-end seconds, the text, and the usage's token counts."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, ttft, text, usage = time.perf_counter(), None, "", {}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                if choice["delta"].get("content"):
                    ttft = ttft or time.perf_counter() - start
                    text += choice["delta"]["content"]
            usage = chunk.get("usage") or usage
    return {"ttft": ttft, "e2e": time.perf_counter() - start, "text": text, "prompt": usage.get("prompt_tokens", 0),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "output": usage.get("completion_tokens", 0)}


def run_session(url: str, model: str, session, turns: int, tag: str, max_tokens: int) -> list[dict]:
    messages: list[dict] = []
    results = []
    with httpx.Client(timeout=300) as client:
        for i, user in enumerate(session.user_turns[:turns]):
            messages.append({"role": "user", "content": f"[{tag}] {user}" if i == 0 else user})
            result = stream_turn(client, url, model, messages, max_tokens)
            text = result.pop("text")
            results.append(result)
            messages.append({"role": "assistant", "content": text})
    return results


def run_policy(policy: str, urls: list[str], ns, sessions, keyer) -> dict:
    config = RouterConfig(slo_s=ns.slo, tpct_s=ns.tpct)
    if ns.calibration:  # tpct and the pool size measured by `threefold bench calibrate`
        config = router_config(EngineModel.load(ns.calibration), ns.slo, 0)
    router = Router(urls, policy, config, keyer, ProxyConfig())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(router), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    start = time.perf_counter()
    with ThreadPoolExecutor(ns.concurrency) as pool:
        per_session = list(pool.map(lambda s: run_session(url, ns.model, s, ns.turns, policy, ns.max_tokens),
                                    sessions))
    wall = time.perf_counter() - start
    state = httpx.get(f"{url}/router/state").json()["backends"]
    server.should_exit = True
    thread.join(10)
    rows = [r for s in per_session for r in s]
    ttfts = sorted(r["ttft"] for r in rows if r["ttft"] is not None)
    routed = [s["routed"] for s in state.values()]
    return {"policy": policy, "requests": len(rows), "ttft_p50_s": statistics.median(ttfts),
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "output_tok_per_s": sum(r["output"] for r in rows) / wall,
            "hit_rate": sum(r["cached"] for r in rows) / max(1, sum(r["prompt"] for r in rows)),
            "routed_per_backend": routed, "imbalance": max(routed) / (sum(routed) / len(routed)), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--policies", default=",".join(policy_names()))
    parser.add_argument("--slo", type=float, default=5.0)
    parser.add_argument("--tpct", type=float, default=0.0005)
    parser.add_argument("--calibration", default=None, help="engine model JSON: sets tpct (overrides --tpct)")
    parser.add_argument("--serve-arg", action="append", default=["--kv-cache-memory=160MiB", "--max-model-len=2048"])
    ns = parser.parse_args()
    tokenizer = load_tokenizer(ns.model)
    sessions = load_sharegpt_sessions(ns.sessions, tokenizer, LengthLimits(max_output_len=ns.max_tokens,
                                                                           max_total_len=1536),
                                      min_turns=ns.turns)
    keyer = PromptKeyer(ns.model)
    engines, urls = [], []
    try:
        for _ in range(ns.replicas):
            port = free_port()
            cmd = [sys.executable, "-m", "threefold.cli", "serve", "--model", ns.model, "--port", str(port),
                   *ns.serve_arg]
            engines.append(subprocess.Popen(cmd, env=dict(os.environ), stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))
            urls.append(f"http://127.0.0.1:{port}")
        for url, process in zip(urls, engines, strict=True):
            wait_healthy(url, process)
        print(f"# {ns.replicas} replicas, {ns.sessions} sessions x {ns.turns} turns, concurrency {ns.concurrency}, "
              f"max_tokens {ns.max_tokens}", flush=True)
        for policy in ns.policies.split(","):
            print(json.dumps(run_policy(policy, urls, ns, sessions, keyer)), flush=True)
    finally:
        for process in engines:
            process.terminate()
        for process in engines:
            process.wait(30)


if __name__ == "__main__":
    main()
