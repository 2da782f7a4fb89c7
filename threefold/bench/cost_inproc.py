"""`bench cost --in-process`: the threefold rungs as servers in this process, over one loaded model.

The same server app (`threefold.server.app`) and router app run in uvicorn threads, and the
same bench client drives them over HTTP, but nothing is started as a process: the model loads
once for every rung. For quick runs and the end-to-end test. What it cannot give: peak memory
per rung (one process holds every rung; reported as absent), and fully honest latencies (the
client shares the interpreter with the servers). Measurements use the default, process mode.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import uvicorn

from threefold.bench.cost_run import RunConfig, RungRun, ledger_totals, routed_counts, warm_up
from threefold.bench.cost_rungs import Rung
from threefold.bench.cost_workload import Traffic, Workload, play
from threefold.bench.sweep import free_port


class _AppThread:
    """An ASGI app served by uvicorn in a daemon thread on a free port."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="bench-cost-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise TimeoutError(f"in-process server on {self.base_url} did not come up")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def engine_args(rung: Rung, cfg: RunConfig):
    """The EngineArgs `threefold serve` would build from cost_run.serve_command's flags."""
    from threefold.engine.llm_engine import EngineArgs
    from threefold.kvstore import OffloadConfig

    return EngineArgs(model=cfg.model, dtype=cfg.dtype, kv_cache_memory=cfg.kv_cache_memory,
                      max_model_len=cfg.max_model_len, block_size=cfg.block_size(rung),
                      enable_prefix_caching=rung.has("prefix"),
                      kv_cache_dtype=cfg.codec if rung.has("codec") else "auto",
                      speculative_config=json.loads(cfg.spec_config) if rung.has("spec") else None,
                      kv_offload=OffloadConfig(cpu_bytes=cfg.tier_cpu_bytes) if rung.has("tiers") else None)


def _server(loaded, rung: Rung, cfg: RunConfig) -> tuple[_AppThread, Any]:
    from threefold.engine.llm_engine import LLMEngine
    from threefold.server.app import build_app, make_state
    from threefold.server.config import ServerConfig

    engine = LLMEngine(loaded, engine_args(rung, cfg))
    state = make_state(engine, ServerConfig(served_model_names=(cfg.model,), cost_per_hour=cfg.cost_per_hour))
    return _AppThread(build_app(state)), state


def _router(rung: Rung, cfg: RunConfig, backends: list[str]) -> _AppThread:
    from threefold.router.app import build_app
    from threefold.router.config import RouterConfig
    from threefold.router.keys import PromptKeyer
    from threefold.router.proxy import Router

    policy = "round_robin" if rung.has("rr") else cfg.router_policy
    router = Router(backends, policy, RouterConfig(block_size=cfg.block_size(rung)), PromptKeyer(cfg.model))
    return _AppThread(build_app(router))


def run_in_process(loaded, rung: Rung, cfg: RunConfig, workload: Workload, traffic: Traffic) -> RungRun:
    threads: list[_AppThread] = []
    states = []
    try:
        for _ in range(rung.replicas):
            thread, state = _server(loaded, rung, cfg)
            threads.append(thread)
            states.append(state)
        backends = [t.base_url for t in threads]
        front = _router(rung, cfg, backends) if rung.replicas > 1 else threads[0]
        if front is not threads[0]:
            threads.append(front)
        for url in backends:
            warm_up(url, cfg.model)
        played = play(front.base_url, cfg.model, workload, traffic)
        routed = routed_counts(front.base_url) if rung.replicas > 1 else None
        return RungRun(played, 0, 0, [ledger_totals(url) for url in backends], routed)
    finally:
        for thread in threads:
            thread.stop()
        for state in states:
            state.engine.shutdown()
