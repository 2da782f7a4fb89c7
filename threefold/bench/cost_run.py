"""Running one rung of `bench cost`: start its processes, send the workload, read peak memory.

threefold rungs run as real `threefold serve` processes driven over HTTP by the bench client,
so TTFT and ITL are what a streaming client sees. Two-replica rungs start two servers and a
real `threefold router` process in front of them. The transformers baseline runs in its own
process (bench/cost_hf.py) replaying the same arrival schedule.

Peak memory is the resident-set high-water mark (VmHWM in /proc/PID/status) of every serving
process, summed: each server's process group, plus the router's, read just before they stop.
The bench process itself (client, tokenizer) is not counted.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from threefold.bench.client import RequestResult
from threefold.bench.cost_rungs import Rung
from threefold.bench.cost_workload import HUMANEVAL, Played, Traffic, Workload, play
from threefold.bench.sweep import ManagedServer, ServerSpec, free_port
from threefold.errors import ThreefoldError


@dataclass(frozen=True)
class RunConfig:
    """What every rung shares: the model, the KV budget, and what each technique name means."""

    model: str
    hf_dir: str
    """The model as an HF directory (dequantized GGUF) for the transformers baseline."""
    dtype: str = "auto"
    hf_dtype: str = "float32"
    kv_cache_memory: int = 64 << 20
    max_model_len: int = 1280
    codec: str = "int8"
    spec_config: str = '{"method": "ngram", "num_speculative_tokens": 4}'
    tier_cpu_bytes: int = 1 << 30
    router_policy: str = "dualmap"
    cost_per_hour: float = 0.5
    hf_batch_size: int = 8
    startup_timeout_s: float = 600.0
    log_dir: Path = Path("results/cost/logs")

    def block_size(self, rung: Rung) -> int:
        return 32 if rung.has("codec") and self.codec.startswith("kivi") else 16  # KIVI groups 32 tokens


@dataclass
class RungRun:
    played: Played
    peak_rss_bytes: int
    processes: int
    """Serving processes whose peak RSS is summed."""
    ledgers: list[dict] = dataclasses.field(default_factory=list)
    """Each replica's /v1/ledger totals after the run (threefold rungs)."""
    routed: list[int] | None = None
    error: str | None = None
    """Why the rung could not run (its server failed to start, ...); its row then has no numbers."""


def serve_command(rung: Rung, cfg: RunConfig, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "threefold.cli", "serve", "--model", cfg.model, "--port", str(port),
           "--dtype", cfg.dtype, "--kv-cache-memory", str(cfg.kv_cache_memory),
           "--max-model-len", str(cfg.max_model_len), "--block-size", str(cfg.block_size(rung)),
           "--cost-per-hour", str(cfg.cost_per_hour)]
    if not rung.has("prefix"):
        cmd.append("--no-prefix-caching")
    if rung.has("codec"):
        cmd += ["--kv-cache-dtype", cfg.codec]
    if rung.has("spec"):
        cmd += ["--speculative-config", cfg.spec_config]
    if rung.has("tiers"):
        cmd += ["--kv-offload-cpu-bytes", str(cfg.tier_cpu_bytes)]
    return cmd


def group_peak_rss(pgid: int) -> tuple[int, int]:
    """Sum of VmHWM over the live processes of a process group, and how many there are."""
    total = count = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:  # field 5, after "(comm)" and state, ppid
                continue
            for line in (proc / "status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total, count = total + int(line.split()[1]) * 1024, count + 1
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
    return total, count


def ledger_totals(base_url: str) -> dict:
    try:
        return httpx.get(base_url + "/v1/ledger", timeout=10.0, trust_env=False).json()
    except (httpx.HTTPError, ValueError) as err:
        return {"error": f"{type(err).__name__}: {err}"}


def warm_up(base_url: str, model: str) -> None:
    """One short request no workload prompt shares, so kernels and allocators are warm."""
    body = {"model": model, "prompt": "Warm-up: count to five.", "max_tokens": 4, "temperature": 0}
    httpx.post(base_url + "/v1/completions", json=body, timeout=300.0, trust_env=False).raise_for_status()


def run_threefold(rung: Rung, cfg: RunConfig, workload: Workload, traffic: Traffic) -> RungRun:
    servers: list[ManagedServer] = []
    try:
        for replica in range(rung.replicas):
            port = free_port()
            log = cfg.log_dir / f"{rung.name}_replica{replica}.log"
            servers.append(ManagedServer(ServerSpec(rung.name, serve_command(rung, cfg, port)), port, log,
                                         cfg.startup_timeout_s).__enter__())
        front = servers[0]
        if rung.replicas > 1:
            front = _start_router(rung, cfg, [s.base_url for s in servers])
            servers.append(front)
        for server in servers[: rung.replicas]:
            warm_up(server.base_url, cfg.model)
        played = play(front.base_url, cfg.model, workload, traffic)
        routed = routed_counts(front.base_url) if rung.replicas > 1 else None
        ledgers = [ledger_totals(s.base_url) for s in servers[: rung.replicas]]
        peaks = [group_peak_rss(s.proc.pid) for s in servers if s.proc is not None]
        return RungRun(played, sum(p for p, _ in peaks), sum(n for _, n in peaks), ledgers, routed)
    finally:
        for server in servers:
            server.stop()


def _start_router(rung: Rung, cfg: RunConfig, backends: list[str]) -> ManagedServer:
    policy = "round_robin" if rung.has("rr") else cfg.router_policy
    port = free_port()
    cmd = [sys.executable, "-m", "threefold.cli", "router", "--policy", policy, "--port", str(port),
           "--model", cfg.model, "--block-size", str(cfg.block_size(rung))]
    for url in backends:
        cmd += ["--backend", url]
    log = cfg.log_dir / f"{rung.name}_router.log"
    return ManagedServer(ServerSpec(f"{rung.name} router", cmd), port, log, cfg.startup_timeout_s).__enter__()


def routed_counts(router_url: str) -> list[int] | None:
    try:
        state = httpx.get(router_url + "/router/state", timeout=10.0, trust_env=False).json()
        return [backend["routed"] for backend in state["backends"].values()]
    except (httpx.HTTPError, ValueError, KeyError) as err:
        print(f"warning: no routing counts from the router: {err}", file=sys.stderr)
        return None


def _hf_spec(cfg: RunConfig, workload: Workload, traffic: Traffic) -> dict:
    return {"model_dir": cfg.hf_dir, "dtype": cfg.hf_dtype, "batch_size": cfg.hf_batch_size,
            "request_rate": traffic.request_rate, "think_time": traffic.think_time, "seed": traffic.seed,
            "sessions": [{"user_turns": s.user_turns, "max_tokens": s.max_tokens} for s in workload.sessions],
            "first_turns": [{"prompt": r.prompt, "max_tokens": r.max_tokens} for r in workload.first_turns],
            "humaneval": [{"prompt": r.prompt, "max_tokens": r.max_tokens, "task_id": r.source_id}
                          for r in workload.humaneval]}


def run_hf(cfg: RunConfig, workload: Workload, traffic: Traffic) -> RungRun:
    """The transformers static-batching baseline in its own process."""
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(_hf_spec(cfg, workload, traffic)))
        with open(cfg.log_dir / "hf.log", "w") as log:
            proc = subprocess.run([sys.executable, "-m", "threefold.bench.cost_hf", str(spec_path), str(out_path)],
                                  stdout=log, stderr=subprocess.STDOUT, check=False)
        if proc.returncode != 0 or not out_path.is_file():
            tail = (cfg.log_dir / "hf.log").read_text()[-2000:]
            raise ThreefoldError(f"the transformers baseline failed (exit {proc.returncode}):\n{tail}")
        doc = json.loads(out_path.read_text())
    rows = sorted(doc["rows"], key=lambda r: (r["order"], r["turn"] or 0))  # the load generator's order
    results = [RequestResult(ok=True, start=r["start"], ttft=r["ttft"], e2e=r["e2e"], itl=r["itl"],
                             prompt_tokens=r["prompt_tokens"], output_tokens=r["output_tokens"], text=r["text"],
                             prompt_len=r["prompt_tokens"], turn=r["turn"],
                             session_id=None if r["session"] is None else str(r["session"])) for r in rows]
    texts = {r["task_id"]: r["text"] for r in rows if r["class"] == HUMANEVAL}
    played = Played(results, [r["class"] for r in rows], doc["duration_s"], 0, texts)
    return RungRun(played, doc["peak_rss_bytes"], 1)


def run_rung(rung: Rung, cfg: RunConfig, workload: Workload, traffic: Traffic) -> RungRun:
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    return run_hf(cfg, workload, traffic) if rung.is_baseline else run_threefold(rung, cfg, workload, traffic)
