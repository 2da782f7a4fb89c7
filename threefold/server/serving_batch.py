"""The Batch API in the server: the runner on its own thread, lines run through the online handlers.

Each batch line is handed to the very handler that serves it online
(create_completion / create_chat_completion) with a request object built
here, marked offline in its scope; the JSON that handler returns is the
line's `body`. The runner has a thread and an event loop of its own, so
batch work never waits on HTTP traffic (and the other way round); the
AsyncEngine serves any number of loops.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import threading
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import Counter, Gauge
from pydantic import ValidationError

from threefold.batch.runner import BatchRunner, Execution, Retry, RunnerConfig
from threefold.batch.store import BatchStore, new_id
from threefold.batch.validate import BatchLimits
from threefold.errors import ThreefoldError
from threefold.server.errors import _validation_message, error_body
from threefold.server.protocol import ChatCompletionRequest, CompletionRequest
from threefold.server.serving_chat import create_chat_completion
from threefold.server.serving_common import REQUEST_CLASS_SCOPE_KEY, STREAMS_SCOPE_KEY, ServerState
from threefold.server.serving_completions import create_completion

logger = logging.getLogger(__name__)

_HANDLERS: dict[str, Any] = {"/v1/completions": (CompletionRequest, create_completion),
                             "/v1/chat/completions": (ChatCompletionRequest, create_chat_completion)}


class BatchService:
    """The store, the runner and the thread it runs on; `start()` resumes what a previous server left."""

    def __init__(self, state: ServerState, root: str | Path, limits: BatchLimits | None = None,
                 runner_config: RunnerConfig | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_file = _lock_dir(self.root)
        self.store = BatchStore(self.root)
        self.limits = limits or BatchLimits()
        self.metrics = _BatchMetrics(state, self)
        self.runner = BatchRunner(self.store, lambda url, body: execute_line(state, url, body),
                                  lambda url, body: estimate_tokens(state, body),
                                  lambda model: model is None or model in state.config.served_model_names,
                                  runner_config, self.limits, self.metrics.on_line)
        self._thread: threading.Thread | None = None

    def start(self) -> BatchService:
        self._thread = threading.Thread(target=lambda: asyncio.run(self.runner.run_forever()),
                                        name="threefold-batch", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop taking lines; lines in flight are aborted and stay pending for the next start."""
        self.runner.stopping = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.store.close()
        self._lock_file.close()


def _lock_dir(root: Path) -> Any:
    """One server per batch dir: two runners would run the same lines twice."""
    handle = open(root / ".lock", "w")  # noqa: SIM115 — held open for the service's life
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        handle.close()
        raise ThreefoldError(f"The batch dir {root} is in use by another server; give this one its own "
                             "--batch-dir.", param="batch_dir") from exc
    return handle


def batch_dir_in_use(root: Path) -> bool:
    if not (root / ".lock").exists():
        return False
    try:
        _lock_dir(root).close()
    except ThreefoldError:
        return True
    return False


async def execute_line(state: ServerState, url: str, body: dict) -> Execution:
    """Run one batch line through the online handler for `url`; Retry when the engine cannot take it now."""
    model_cls, handler = _HANDLERS[url]
    streams: list = []
    scope = {"type": "http", "method": "POST", "path": url, "headers": [], "query_string": b"",
             STREAMS_SCOPE_KEY: streams, REQUEST_CLASS_SCOPE_KEY: "offline"}
    try:
        req = model_cls.model_validate(body)
        response = await handler(state, req, Request(scope, receive=_never_disconnects))
        result = json.loads(response.body)
    except ValidationError as exc:
        message, param = _validation_message(RequestValidationError(exc.errors()))
        return Execution(400, new_id("batch_req_"), error_body(message, 400, param))
    except ThreefoldError as exc:
        if exc.status_code in (429, 503):  # offline queue full, engine draining or dead: not the line's fault
            raise Retry(exc.message) from exc
        return Execution(exc.status_code, new_id("batch_req_"), error_body(exc.message, exc.status_code, exc.param))
    finally:
        state.engine.abort([s.request_id for s in streams if not s.finished])
    if any(choice.get("finish_reason") == "abort" for choice in result.get("choices", ())):
        raise Retry("aborted (server shutting down)")  # not a result: the line runs again after a restart
    return Execution(response.status_code, result.get("id", new_id("batch_req_")), result)


async def _never_disconnects() -> dict:
    await asyncio.Event().wait()  # a batch line has no client to hang up; the runner cancels instead
    return {"type": "http.disconnect"}


def estimate_tokens(state: ServerState, body: dict) -> int:
    """Tokens a line may hold in the KV cache: ~4 bytes a prompt token, plus what it may generate."""
    prompt = body.get("prompt", body.get("messages", ""))
    prompt_tokens = len(json.dumps(prompt)) // 4 + 1
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    generated = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else state.max_model_len
    return min(state.max_model_len, prompt_tokens + generated)


class _BatchMetrics:
    """threefold:batch_* series in the server's registry (gauges read the runner when scraped)."""

    def __init__(self, state: ServerState, service: BatchService) -> None:
        registry, labels = state.metrics.registry, {"model_name": state.config.model_name}

        def gauge(name: str, doc: str, read: Any) -> None:
            Gauge(name, doc, ["model_name"], registry=registry).labels(**labels).set_function(read)

        gauge("threefold:batch_queue_lines", "Batch lines waiting to run (the offline queue).",
              lambda: service.store.num_pending() - service.runner.num_inflight_lines)
        gauge("threefold:batch_inflight_lines", "Batch lines running in the engine now.",
              lambda: service.runner.num_inflight_lines)
        gauge("threefold:batch_inflight_tokens", "Estimated tokens of the batch lines in the engine now.",
              lambda: service.runner.num_inflight_tokens)
        lines = Counter("threefold:batch_lines", "Batch lines finished, by outcome.", ["model_name", "outcome"],
                        registry=registry)
        self._completed = lines.labels(outcome="completed", **labels)
        self._failed = lines.labels(outcome="failed", **labels)

    def on_line(self, ok: bool) -> None:
        (self._completed if ok else self._failed).inc()
