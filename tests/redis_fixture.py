"""A real redis-server on a free loopback port, for the KV tier tests (Debian's package: `make redis`)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One redis-server process without persistence; `stop()` kills it as a crash would, `start()`
    brings it back on the same port (empty, as after a crash without persistence)."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir, self.port = workdir, port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ping():
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode} on port {self.port}")
            time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer PING on port {self.port} within {timeout} s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None


@pytest.fixture
def redis_server(tmp_path):
    """A started RedisServer, killed at the end of the test."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (`make redis` installs Debian's redis-server)")
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()
