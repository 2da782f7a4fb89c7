"""`threefold bench sweep`: launch each server, run `bench serve` at each load point, stop it.

A server is a peer name (`threefold`, `vllm`, `llamacpp`: commands from
bench/peers.py) or `LABEL=COMMAND`, a shell-style command whose `{port}` and
`{model}` are filled in. Each runs alone on the machine (2 cores cannot host
two engines fairly); `--rounds` repeats the whole cycle so engines are
compared across interleaved rounds rather than one lucky minute.

    round 0: [start A: c=1 c=2 c=4 stop] [start B: c=1 c=2 c=4 stop]
    round 1: [start A: ...] [start B: ...]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import math
import os
import shlex
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from threefold.bench.peers import best_dtype, serve_command
from threefold.bench.report import write_report
from threefold.bench.serve import run_serve, write_results
from threefold.errors import ThreefoldError

BUILTIN_SERVERS = ("threefold", "vllm", "llamacpp")


@dataclass(frozen=True)
class ServerSpec:
    label: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_server(text: str, model: str, port: int, max_model_len: int = 2048, dtype: str = "auto") -> ServerSpec:
    """`vllm` / `llamacpp` / `threefold`, or `LABEL=COMMAND` with {port} and {model} placeholders."""
    if text in BUILTIN_SERVERS:
        command, env = serve_command(text, model, port, max_model_len=max_model_len, dtype=dtype)
        return ServerSpec(text, command, env)
    label, sep, command = text.partition("=")
    if not sep or not label or not command.strip():
        raise ThreefoldError(f"--server {text!r}: use one of {', '.join(BUILTIN_SERVERS)} or LABEL=COMMAND",
                             param="server")
    return ServerSpec(label, shlex.split(command.replace("{port}", str(port)).replace("{model}", model)))


def _ready(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/v1/models", timeout=2.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


class ManagedServer:
    """A server process we started: its own process group, its log in a file, stopped on exit."""

    def __init__(self, spec: ServerSpec, port: int, log_path: Path, startup_timeout: float = 600.0) -> None:
        self.spec, self.port, self.log_path, self.startup_timeout = spec, port, log_path, startup_timeout
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ManagedServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        log.write(f"$ {shlex.join(self.spec.command)}\n")
        log.flush()
        self.proc = subprocess.Popen(self.spec.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **self.spec.env}, start_new_session=True)
        log.close()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> None:
        """Poll /v1/models until it answers 200; fail early if the process dies."""
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text()[-2000:]
                raise ThreefoldError(f"server {self.spec.label} exited with {self.proc.returncode}:\n{tail}")
            if _ready(self.base_url):
                return
            time.sleep(0.5)
        raise ThreefoldError(f"server {self.spec.label} not ready after {self.startup_timeout:.0f} s; "
                             f"see {self.log_path}")

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the server's process group (it may have spawned workers), SIGKILL after `grace_s`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __exit__(self, *exc) -> None:
        self.stop()


def _points(args: argparse.Namespace) -> list[tuple[str, float | int | None]]:
    if args.concurrencies:
        return [("max_concurrency", int(c)) for c in args.concurrencies.split(",")]
    if args.rates:
        return [("request_rate", float(r)) for r in args.rates.split(",")]
    raise ThreefoldError("give --concurrencies 1,2,4 or --rates 0.5,1,2", param="concurrencies")


def _point_name(key: str, value) -> str:
    return f"c{value}" if key == "max_concurrency" else f"r{value:g}"


def run_point(args: argparse.Namespace, server: ManagedServer, key: str, value, rnd: int, index: int,
              out_dir: Path) -> Path:
    point = copy.copy(args)
    point.base_url, point.label = server.base_url, server.spec.label
    # The server outlives the points: fresh prompts per point keep one point's prefix-cache
    # hits from flattering the next; the same point index draws the same prompts on every server.
    point.seed = args.seed if args.same_prompts else args.seed + 1000 * index
    point.request_rate = args.request_rate if key == "max_concurrency" else value
    point.max_concurrency = value if key == "max_concurrency" else args.max_concurrency
    doc = asyncio.run(run_serve(point))
    doc["config"]["round"] = rnd
    doc["config"]["server_command"] = shlex.join(server.spec.command)
    path = out_dir / f"{server.spec.label}_{_point_name(key, value)}_round{rnd}.json"
    write_results(doc, path)
    s = doc["summary"]
    print(f"[{server.spec.label} {_point_name(key, value)} round {rnd}] {s['completed']} ok {s['failed']} failed, "
          f"{s['output_throughput']:.1f} out tok/s, TTFT p50 "
          f"{(s['ttft'] or {}).get('p50', math.nan) * 1e3:.0f} ms", flush=True)
    return path


def run_sweep(args: argparse.Namespace) -> list[Path]:
    """Every server x every point x every round; then the report. Returns the result files."""
    if not args.model:
        raise ThreefoldError("sweep needs --model (the name servers are started with)", param="model")
    out_dir, points, paths = Path(args.out_dir), _points(args), []
    args.dtype = best_dtype(args.dtype)  # recorded concrete in every result's config
    for rnd in range(args.rounds):
        for text in args.server:
            port = free_port()
            spec = parse_server(text, args.model, port, args.max_total_len, args.dtype)
            log = out_dir / "logs" / f"{spec.label}_round{rnd}.log"
            with ManagedServer(spec, port, log, args.startup_timeout) as server:
                paths += [run_point(args, server, key, value, rnd, i, out_dir) for i, (key, value) in enumerate(points)]
    print(f"report: {write_report(paths, out_dir)}")
    return paths


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", action="append", required=True,
                        help="threefold | vllm | llamacpp | LABEL='COMMAND {port} {model}' (repeatable)")
    parser.add_argument("--concurrencies", default=None, help="comma-separated max concurrencies")
    parser.add_argument("--rates", default=None, help="comma-separated request rates (req/s)")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="rate used with --concurrencies")
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap used with --rates")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the whole cycle (interleaving engines)")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /v1/models")
    parser.add_argument("--same-prompts", action="store_true",
                        help="send the same prompts at every point (default: a fresh sample per point)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="compute dtype of the built-in servers (threefold, vLLM), the same for both; "
                             "auto: bf16 only on CPUs with native bf16 (AVX512_BF16/AMX), else fp32")
    parser.add_argument("--out-dir", required=True)
