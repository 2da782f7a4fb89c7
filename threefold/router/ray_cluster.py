"""Replicas on Ray: each replica is a Ray actor that owns one `threefold serve` process.

`threefold cluster --ray` connects with `ray.init(address=...)` (`--address auto` joins a
cluster started with `ray start --head`; no address starts a local one), places one actor
per replica (`--replica-cpus` CPUs each, so Ray spreads them over the nodes that have
room), and puts the router in front of the URLs the actors report. Ray is an optional
extra: `pip install threefold[cluster]`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any

from threefold.errors import ThreefoldError


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ThreefoldError("--ray needs Ray: pip install 'threefold[cluster]'", param="ray") from exc
    return ray


class EngineReplica:
    """One engine server on the actor's node; the actor's life is the server's life."""

    def __init__(self, model: str, serve_args: list[str]) -> None:
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        bind = "127.0.0.1" if host.startswith("127.") else "0.0.0.0"  # reachable from the router's node
        cmd = [sys.executable, "-m", "threefold.cli", "serve", "--model", model, "--host", bind,
               "--port", str(port), *serve_args]
        self.process = subprocess.Popen(cmd, env=dict(os.environ), start_new_session=True)
        self.url = f"http://{host}:{port}"

    def ready(self, timeout_s: float = 900) -> str:
        from threefold.router.cli import wait_healthy

        wait_healthy(self.url, self.process, timeout_s)
        return self.url

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()


def start_replicas(replicas: int, model: str, serve_args: list[str], address: str | None,
                   replica_cpus: float) -> tuple[list[str], list[Any]]:
    """-> (backend URLs, actor handles); the caller stops them with stop_replicas()."""
    ray = _import_ray()
    ray.init(address=address, ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
    actor = ray.remote(num_cpus=replica_cpus)(EngineReplica)
    handles = [actor.remote(model, serve_args) for _ in range(replicas)]
    try:
        return ray.get([h.ready.remote() for h in handles]), handles
    except Exception:
        stop_replicas(handles)
        raise


def stop_replicas(handles: list[Any]) -> None:
    ray = _import_ray()
    try:
        ray.get([h.stop.remote() for h in handles], timeout=60)
    finally:
        ray.shutdown()
