"""Run a real threefold server inside the test process (a uvicorn thread) or as a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from threefold.server.app import build_app, make_state
from threefold.server.config import ServerConfig
from threefold.server.serving_common import ServerState


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(base_url: str, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before becoming healthy")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server at {base_url} not healthy after {timeout_s} s")


class ServerThread:
    """An in-process server around an already-loaded LLMEngine: `with ServerThread(engine) as s: s.url`.

    Tests can reach `s.state` (the async engine, metrics) to inject faults.
    """

    def __init__(self, engine: Any, **config: Any) -> None:
        config.setdefault("served_model_names", (engine.model_name,))
        self.port = free_port()
        self.state: ServerState = make_state(engine, ServerConfig(port=self.port, **config))
        uv_config = uvicorn.Config(build_app(self.state), host="127.0.0.1", port=self.port, log_level="warning",
                                   lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(uv_config)
        self.thread = threading.Thread(target=self.server.run, name="threefold-uvicorn", daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        wait_healthy(self.url, timeout_s=30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.state.engine.shutdown()


class ServerProcess:
    """`python -m threefold.server.cli ARGS` on a free port; its log goes to `log_path`."""

    def __init__(self, args: list[str], log_path: Path, startup_timeout_s: float = 300) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.args = [sys.executable, "-m", "threefold.server.cli", "--port", str(self.port), *args]
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ))
        try:
            wait_healthy(self.url, self.startup_timeout_s, self.process)
        except Exception:
            self.__exit__()
            raise
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self._log.close()
