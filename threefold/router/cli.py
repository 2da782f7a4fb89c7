"""`threefold router` (a front door over running engines) and `threefold cluster` (N local
`threefold serve` processes on free ports plus the router; Ctrl-C stops them all)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlparse

import httpx

from threefold.errors import ThreefoldError
from threefold.router.config import RouterConfig
from threefold.router.policies import policy_names


def check_backend_url(url: str) -> str:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path not in ("", "/"):
        raise ThreefoldError(f"--backend {url!r} is not a base URL like http://127.0.0.1:8001", param="backend")
    return url.rstrip("/")


def _common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", default="dualmap", help=f"one of {', '.join(policy_names())}")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="smollm2-135m", help="whose tokenizer keys the prefixes")
    parser.add_argument("--tokenizer", default=None, help="HF directory or .gguf (default: the model's)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="the engines' KV block size (default: the calibration's, else 16)")
    parser.add_argument("--slo", type=float, default=5.0, help="DualMap TTFT SLO, seconds")
    parser.add_argument("--tpct", type=float, default=None,
                        help="DualMap prefill seconds per uncached token, the starting value it refits to observed "
                             "TTFTs (default: from --calibration, else 0.0005)")
    parser.add_argument("--calibration", default=None,
                        help="engine model JSON from `threefold bench calibrate`: tpct, block size, prefix-cache size")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    router = subparsers.add_parser("router", help="OpenAI-compatible router over running engines")
    router.add_argument("--backend", action="append", default=[], help="engine base URL; repeat per engine")
    _common_args(router)
    router.set_defaults(func=cmd_router)
    cluster = subparsers.add_parser("cluster", help="N local engines on free ports behind a router")
    cluster.add_argument("--replicas", type=int, default=2)
    cluster.add_argument("--ray", action="store_true", help="one Ray actor per replica (threefold[cluster])")
    cluster.add_argument("--address", default=None, help="Ray cluster address (e.g. auto after `ray start --head`)")
    cluster.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs reserved per replica")
    cluster.add_argument("--serve-arg", action="append", default=[],
                         help="extra argument for each `threefold serve` (repeat), e.g. --serve-arg=--max-num-seqs=8")
    _common_args(cluster)
    cluster.set_defaults(func=cmd_cluster)


def router_config(ns: argparse.Namespace) -> RouterConfig:
    if ns.policy not in policy_names():
        raise ThreefoldError(f"unknown routing policy {ns.policy!r}; choose one of {policy_names()}", param="policy")
    if ns.calibration:
        from threefold.sim.engine_model import EngineModel
        from threefold.sim.simulator import router_config as calibrated

        model = EngineModel.load(ns.calibration)
        if ns.block_size is not None and ns.block_size != model.block_size:
            raise ThreefoldError(f"--block-size {ns.block_size} conflicts with the block size {model.block_size} "
                                 f"of --calibration {ns.calibration}: the engines have one block size; drop "
                                 "--block-size or calibrate engines with that block size", param="block_size")
        config = calibrated(model, ns.slo, 0)
        return config if ns.tpct is None else dataclasses.replace(config, tpct_s=ns.tpct)
    return RouterConfig(block_size=ns.block_size or 16, slo_s=ns.slo, tpct_s=0.0005 if ns.tpct is None else ns.tpct)


def cmd_router(ns: argparse.Namespace) -> int:
    if not ns.backend:
        raise ThreefoldError("threefold router needs at least one --backend URL", param="backend")
    backends = [check_backend_url(url) for url in ns.backend]
    config = router_config(ns)
    import uvicorn

    from threefold.router.app import build_app
    from threefold.router.keys import PromptKeyer
    from threefold.router.proxy import Router

    router = Router(backends, ns.policy, config, PromptKeyer(ns.model, ns.tokenizer))
    print(f"threefold router ({ns.policy}) on http://{ns.host}:{ns.port} over {', '.join(backends)}", flush=True)
    uvicorn.run(build_app(router), host=ns.host, port=ns.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ThreefoldError(f"the engine for {url} exited with {process.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ThreefoldError(f"the engine at {url} was not healthy after {timeout_s} s")


def cmd_cluster(ns: argparse.Namespace) -> int:
    if ns.replicas < 1:
        raise ThreefoldError(f"--replicas {ns.replicas} must be >= 1", param="replicas")
    router_config(ns)
    if ns.ray:
        return _cluster_on_ray(ns)
    # SIGTERM (kill, timeout, systemd) must stop the engines too: turn it into an exit that runs `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    engines: list[subprocess.Popen] = []
    try:
        urls = []
        for _ in range(ns.replicas):
            port = free_port()
            cmd = [sys.executable, "-m", "threefold.cli", "serve", "--model", ns.model, "--port", str(port),
                   *ns.serve_arg]
            engines.append(subprocess.Popen(cmd, env=dict(os.environ), start_new_session=True))
            urls.append(f"http://127.0.0.1:{port}")
        for url, process in zip(urls, engines, strict=True):
            wait_healthy(url, process)
            print(f"engine ready at {url}", flush=True)
        ns.backend = urls
        return cmd_router(ns)
    finally:
        for process in engines:  # the engines drain on SIGTERM; kill what is still there after 15 s
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in engines:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()


def _cluster_on_ray(ns: argparse.Namespace) -> int:
    from threefold.router.ray_cluster import start_replicas, stop_replicas

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    urls, handles = start_replicas(ns.replicas, ns.model, ns.serve_arg, ns.address, ns.replica_cpus)
    try:
        for url in urls:
            print(f"engine ready at {url} (Ray actor)", flush=True)
        ns.backend = urls
        return cmd_router(ns)
    finally:
        stop_replicas(handles)
