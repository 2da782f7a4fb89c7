"""KV tiers through real `threefold serve` processes: multi-turn sessions by tier against vLLM CPU's
prefix cache, a warm restart on the disk tier, and two instances sharing one Redis.

    make redis
    flock /tmp/threefold-bench.lock .venv/bin/python benchmarks/kv_tiers_serve.py \\
        --parts sessions,restart,cross --users 8 --turns 3 --context 2048 --out-dir /tmp/kv-tiers-serve

Every part drives its servers with `threefold bench serve`'s own load generator (`run_serve`):
ShareGPT sessions, each opened by its own document of `--context` tokens (a system message), greedy,
every turn `--max-output-len` tokens (ignore_eos), streamed chat.

sessions  More users than the pool (L1) holds; `--concurrency` requests in flight, so while a user
          thinks the others' turns evict its context. Later-turn TTFT p50/p99 and the share of
          prompt tokens each tier served (usage.prompt_tokens_details.cached_tokens_by_tier), for
          L1 only; + L2 host memory; + L3 disk alone; + L4 Redis alone; L2 + L3 + L4 with L2 and L3
          smaller than the sessions' KV (so each catches what the one above let go); and vLLM CPU
          with the same pool size in tokens (its prefix cache, no offload).
restart   First turns on a server with an empty L3 directory (cold), then the same first turns on a
          new server process over the same directory (warm).
cross     Two servers on one Redis: first turns on A, then the same on B. B's hit rate on A's
          prefixes, from its usage and its /metrics.

Redis: a redis-server on a free loopback port, started here (tests/redis_fixture.py), restarted
empty before each run that uses it. The servers' logs and every run's results JSON go to --out-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from threefold.bench.peers import serve_command
from threefold.bench.report import cpu_record
from threefold.bench.serve import add_serve_args, run_serve, write_results
from threefold.bench.sweep import ManagedServer, ServerSpec, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from redis_fixture import RedisServer

MODEL = "smollm2-135m"
BYTES_PER_TOKEN_FP32 = 30 * 2 * 3 * 64 * 4
"""SmolLM2-135M's fp32 KV: 30 layers x (K, V) x 3 KV heads x 64 dims x 4 bytes."""
VLLM_BLOCK = 128
"""vLLM CPU's default block size (its kernels want multiples of 32)."""


class Bench:
    """One job's shared pieces: the options, the Redis server, the output folder, the rows."""

    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.out = Path(ns.out_dir)
        self.work = Path(tempfile.mkdtemp(prefix="kv-tiers-serve-"))
        self.redis = RedisServer(self.work)
        self.rows: dict[str, list[dict]] = {}
        self.max_model_len = ns.context + 1024

    def fresh_redis(self) -> str:
        self.redis.stop()  # no persistence: the restarted server is empty
        self.redis.start()
        return self.redis.url

    def fresh_dir(self, name: str) -> str:
        path = self.work / name
        shutil.rmtree(path, ignore_errors=True)
        return str(path)

    def threefold(self, label: str, offload: list[str]) -> tuple[ServerSpec, int]:
        port = free_port()
        argv, env = serve_command("threefold", MODEL, port, max_model_len=self.max_model_len, dtype="float32")
        pool = str(self.ns.pool_tokens * BYTES_PER_TOKEN_FP32)
        return ServerSpec(label, [*argv, "--kv-cache-memory", pool, *offload], env), port

    def vllm(self) -> tuple[ServerSpec, int]:
        port = free_port()
        argv, env = serve_command("vllm", MODEL, port, max_model_len=self.max_model_len, dtype="float32")
        blocks = str(self.ns.pool_tokens // VLLM_BLOCK)
        env = {**env, "VLLM_CPU_KVCACHE_SPACE": "1"}  # the override below sets the blocks; keep the allocation small
        return ServerSpec("vllm", [*argv, "--num-gpu-blocks-override", blocks], env), port

    def start(self, spec: ServerSpec, port: int) -> ManagedServer:
        return ManagedServer(spec, port, self.out / "logs" / f"{spec.label}.log", startup_timeout=900)

    def load_args(self, base_url: str, label: str, turns: int, concurrency: int) -> argparse.Namespace:
        ns, parser = self.ns, argparse.ArgumentParser()
        users = ns.users if turns > 1 else ns.first_turn_users
        add_serve_args(parser)
        return parser.parse_args([
            "--base-url", base_url, "--model", MODEL, "--label", label, "--dataset", "sharegpt-sessions",
            "--num-prompts", str(users), "--min-turns", str(turns), "--max-turns", str(turns),
            "--session-context-len", str(ns.context), "--max-total-len", str(self.max_model_len),
            "--max-prompt-len", "1024", "--max-output-len", str(ns.max_output_len), "--ignore-eos",
            "--think-time", str(ns.think_time), "--max-concurrency", str(concurrency), "--seed", str(ns.seed),
            "--no-progress"])

    def play(self, server: ManagedServer, label: str, turns: int, concurrency: int) -> dict:
        before = offload_metrics(server.base_url)
        doc = asyncio.run(run_serve(self.load_args(server.base_url, label, turns, concurrency)))
        doc["config"]["server_command"] = " ".join(server.spec.command)
        doc["offload_metrics"] = {k: v - before.get(k, 0.0) for k, v in offload_metrics(server.base_url).items()}
        write_results(doc, self.out / f"{label}.json")
        summary = doc["summary"]
        print(f"[{label}] {summary['completed']} ok, {summary['failed']} failed; "
              f"{json.dumps(summary.get('later_turns'))}", flush=True)
        return doc


def offload_metrics(base_url: str) -> dict[str, float]:
    """threefold:kv_offload_{hits,hit_tokens,misses}_total by tier, and pending writes (empty for vLLM)."""
    try:
        text = httpx.get(base_url + "/metrics", timeout=10, trust_env=False).text
    except httpx.HTTPError:
        return {}
    wanted = ("threefold:kv_offload_hits_total", "threefold:kv_offload_hit_tokens_total",
              "threefold:kv_offload_misses_total", "threefold:kv_offload_pending_writes")
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                tier = f"/{sample.labels['tier']}" if "tier" in sample.labels else ""
                values[sample.name.split("kv_offload_")[1] + tier] = sample.value
    return values


def wait_written(base_url: str, timeout_s: float = 120.0) -> None:
    """Until the server's writer thread has written every block it queued (write-through is async)."""
    deadline = time.monotonic() + timeout_s
    while offload_metrics(base_url).get("pending_writes", 0.0) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)


def session_modes(bench: Bench) -> list[tuple[str, list[str]]]:
    """(label, offload flags) of each sessions run; Redis and disk are emptied before each."""
    ns = bench.ns
    return [("L1 only", []),
            ("+L2 cpu", ["--kv-offload-cpu-bytes", "4GiB"]),
            ("+L3 disk", ["--kv-offload-disk", "{disk}"]),
            ("+L4 redis", ["--kv-offload-redis", "{redis}"]),
            ("L2+L3+L4 cascade", ["--kv-offload-cpu-bytes", f"{ns.cascade_cpu_mib}MiB", "--kv-offload-disk", "{disk}",
                                  "--kv-offload-disk-bytes", f"{ns.cascade_disk_mib}MiB",
                                  "--kv-offload-redis", "{redis}"])]


def run_sessions_part(bench: Bench) -> None:
    ns = bench.ns
    if "vllm" in ns.modes:  # first: its server compiles for minutes, and a job cut short keeps its row
        spec, port = bench.vllm()
        with bench.start(spec, port) as server:
            bench.rows.setdefault("sessions", []).append(bench.play(server, "sessions_vllm", ns.turns,
                                                                    ns.concurrency))
    for label, template in session_modes(bench):
        if label not in ns.modes:
            continue
        disk = bench.fresh_dir("disk") if "{disk}" in template else ""
        redis = bench.fresh_redis() if "{redis}" in template else ""
        flags = [{"{disk}": disk, "{redis}": redis}.get(f, f) for f in template]
        spec, port = bench.threefold(label.replace(" ", "_"), flags)
        with bench.start(spec, port) as server:
            bench.rows.setdefault("sessions", []).append(bench.play(server, f"sessions_{spec.label}", ns.turns,
                                                                    ns.concurrency))


def run_restart_part(bench: Bench) -> None:
    disk = bench.fresh_dir("restart-disk")
    docs = []
    for label in ("cold", "warm"):
        spec, port = bench.threefold(f"restart_{label}", ["--kv-offload-disk", disk])
        with bench.start(spec, port) as server:
            docs.append(bench.play(server, f"restart_{label}", 1, 1))
            wait_written(server.base_url)  # then SIGTERM: a graceful stop also closes the store
    bench.rows["restart"] = docs


def run_cross_part(bench: Bench) -> None:
    url = bench.fresh_redis()
    flags = ["--kv-offload-cpu-bytes", "2GiB", "--kv-offload-redis", url]
    spec_a, port_a = bench.threefold("cross_A", flags)
    spec_b, port_b = bench.threefold("cross_B", flags)
    with bench.start(spec_a, port_a) as a, bench.start(spec_b, port_b) as b:
        first = bench.play(a, "cross_A", 1, 1)
        wait_written(a.base_url)
        bench.rows["cross"] = [first, bench.play(b, "cross_B", 1, 1)]


def _ms(dist: dict | None, key: str) -> str:
    return f"{dist[key] * 1e3:,.0f}" if dist else "-"


def _rates(rates: dict | None) -> str:
    return ", ".join(f"{tier} {share:.1%}" for tier, share in (rates or {}).items()) or "-"


def print_tables(bench: Bench) -> None:
    for doc in bench.rows.get("sessions", []):
        later = doc["summary"]["later_turns"]
        print(f"| {doc['label']} | {later['completed']} | {later['mean_prompt_tokens'] or 0:.0f} | "
              f"{_ms(later['ttft'], 'p50')} | {_ms(later['ttft'], 'p99')} | {_rates(later['tier_hit_rates'])} | "
              f"{doc['summary']['failed']} |")
    for doc in bench.rows.get("restart", []) + bench.rows.get("cross", []):
        summary = doc["summary"]
        turn = summary["per_turn"][0]
        print(f"| {doc['label']} | {turn['completed']} | {turn['mean_prompt_tokens'] or 0:.0f} | "
              f"{_ms(turn['ttft'], 'p50')} | {_ms(turn['ttft'], 'p99')} | "
              f"{_rates(summary['tier_hit_rates'])} | {doc['offload_metrics']} | {summary['failed']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="sessions,restart,cross")
    parser.add_argument("--modes", default="L1 only,+L2 cpu,+L3 disk,+L4 redis,L2+L3+L4 cascade,vllm",
                        help="sessions runs (comma-separated labels)")
    parser.add_argument("--users", type=int, default=8, help="sessions (users)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--first-turn-users", type=int, default=6, help="first turns played by restart, cross")
    parser.add_argument("--context", type=int, default=2048, help="each session's document, tokens")
    parser.add_argument("--max-output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight (sessions part)")
    parser.add_argument("--think-time", type=float, default=0.5)
    parser.add_argument("--pool-tokens", type=int, default=7680, help="the L1 pool, tokens (threefold and vLLM)")
    parser.add_argument("--cascade-cpu-mib", type=int, default=256)
    parser.add_argument("--cascade-disk-mib", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="/tmp/kv-tiers-serve")
    ns = parser.parse_args()
    ns.modes = ns.modes.split(",")
    bench = Bench(ns)
    parts = {"sessions": run_sessions_part, "restart": run_restart_part, "cross": run_cross_part}
    try:
        for part in ns.parts.split(","):
            parts[part](bench)
    finally:
        bench.redis.stop()
        shutil.rmtree(bench.work, ignore_errors=True)
    print(f"CPU: {cpu_record()}")
    print_tables(bench)


if __name__ == "__main__":
    main()
