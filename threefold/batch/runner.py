"""BatchRunner: takes active batches from the store, runs their pending lines, finalizes the files.

Engine-agnostic: a line is run by an `execute(url, body)` coroutine the
caller provides (the server's own completion/chat handlers), which returns
the HTTP status, request id and JSON body the online endpoint would send.

    validating ─► in_progress ─► finalizing ─► completed
        │              │ cancel                  (expired: past the 24h window)
        ▼              ▼
      failed       cancelling ─► cancelled

Lines in flight are bounded by an estimate of their tokens (prompt +
max_tokens), so a 50,000-line batch never holds more than
`max_inflight_tokens` of work in the engine at once.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NamedTuple

from threefold.batch.store import Batch, BatchStore, Line, new_id
from threefold.batch.validate import BatchLimits, error_result, parse_lines
from threefold.errors import ThreefoldError

logger = logging.getLogger(__name__)


class Execution(NamedTuple):
    status_code: int
    request_id: str
    body: dict


class Retry(Exception):
    """The line could not run now (engine draining, dead, or the request was aborted): it stays pending."""


Execute = Callable[[str, dict], Awaitable[Execution]]
EstimateTokens = Callable[[str, dict], int]


@dataclass(frozen=True)
class RunnerConfig:
    max_inflight_tokens: int = 65536
    """Estimated tokens (prompt + max_tokens) of batch lines in the engine at once; one line always runs."""
    max_inflight_lines: int = 256
    poll_s: float = 0.2
    """How often an idle runner looks for work, and a busy one for a cancel."""

    def __post_init__(self) -> None:
        if self.max_inflight_tokens < 1 or self.max_inflight_lines < 1 or self.poll_s <= 0:
            raise ThreefoldError(f"batch runner limits must be positive, got {self}.")


def output_line(line: Line, execution: Execution) -> dict:
    """A line of the output (or error) file, in OpenAI's format."""
    return {"id": new_id("batch_req_"), "custom_id": line.custom_id, "error": None,
            "response": {"status_code": execution.status_code, "request_id": execution.request_id,
                         "body": execution.body}}


class BatchRunner:
    def __init__(self, store: BatchStore, execute: Execute, estimate_tokens: EstimateTokens,
                 model_ok: Callable[[str | None], bool], config: RunnerConfig | None = None,
                 limits: BatchLimits | None = None, on_line: Callable[[bool], None] | None = None) -> None:
        self.store = store
        self.execute = execute
        self.estimate_tokens = estimate_tokens
        self.model_ok = model_ok
        self.config = config or RunnerConfig()
        self.limits = limits or BatchLimits()
        self.on_line = on_line or (lambda ok: None)
        self.stopping = False
        self.num_inflight_lines = 0
        self.num_inflight_tokens = 0

    async def run_forever(self) -> None:
        """Serve batches oldest first until `stopping`; this also resumes what a previous process left."""
        while not self.stopping:
            batch_ids = self.store.active_batch_ids()
            if not batch_ids:
                await asyncio.sleep(self.config.poll_s)
                continue
            try:
                await self.process(batch_ids[0])
            except Exception:  # a store or disk failure: log, wait, try again (never kill the server)
                logger.exception("batch %s failed to process", batch_ids[0])
                await asyncio.sleep(1.0)

    async def process(self, batch_id: str) -> Batch:
        """Take one batch as far as it can go now (to a final status unless the runner is stopping)."""
        batch = self.store.get_batch(batch_id)
        if batch.status == "validating":
            batch = self.validate(batch)
        if batch.status == "in_progress":
            await self.run_lines(batch_id)
        if self.stopping:
            return self.store.get_batch(batch_id)
        return self.finalize(batch_id)

    def validate(self, batch: Batch) -> Batch:
        try:
            lines, errors = parse_lines(self.store.file_content(batch.input_file_id), batch.endpoint or None,
                                        self.model_ok, self.limits)
        except ThreefoldError as exc:
            errors_obj = {"object": "list", "data": [{"code": "invalid_file", "message": exc.message,
                                                      "param": exc.param, "line": None}]}
            return self.store.set_status(batch.id, "failed", errors=errors_obj)
        for _ in errors:
            self.on_line(False)
        return self.store.start_batch(batch.id, lines, errors)

    async def run_lines(self, batch_id: str) -> None:
        pending = collections.deque((line, self._cost(line)) for line in self.store.pending_lines(batch_id))
        tasks: dict[asyncio.Task, tuple[Line, int]] = {}
        try:
            while (pending or tasks) and not self._should_stop_submitting(batch_id):
                while pending and self._admits(pending[0][1]):
                    line, cost = pending.popleft()
                    assert line.request is not None  # pending lines passed validation
                    tasks[asyncio.ensure_future(self.execute(line.request["url"], line.request["body"]))] = (
                        line, cost)
                    self.num_inflight_lines += 1
                    self.num_inflight_tokens += cost
                done, _ = await asyncio.wait(tasks, timeout=self.config.poll_s,
                                             return_when=asyncio.FIRST_COMPLETED) if tasks else (set(), set())
                for task in done:
                    line, cost = tasks.pop(task)
                    self.num_inflight_lines -= 1
                    self.num_inflight_tokens -= cost
                    if not self._record(batch_id, line, task):
                        pending.appendleft((line, cost))
                        await asyncio.sleep(self.config.poll_s)  # the engine said "not now": back off
        finally:
            await self._cancel(tasks)

    def _cost(self, line: Line) -> int:
        assert line.request is not None
        return self.estimate_tokens(line.request["url"], line.request["body"])

    def _admits(self, cost: int) -> bool:
        if self.num_inflight_lines == 0:
            return True  # one line always runs, however large
        return (self.num_inflight_lines < self.config.max_inflight_lines
                and self.num_inflight_tokens + cost <= self.config.max_inflight_tokens)

    def _should_stop_submitting(self, batch_id: str) -> bool:
        if self.stopping:
            return True
        batch = self.store.get_batch(batch_id)
        if batch.status == "in_progress" and time.time() > (batch.timestamps.get("expires_at") or float("inf")):
            self.store.set_status(batch_id, "expired")
            return True
        return batch.status != "in_progress"

    def _record(self, batch_id: str, line: Line, task: asyncio.Task) -> bool:
        """Commit a finished line; False if it must run again later (Retry)."""
        error = task.exception()
        if isinstance(error, Retry):
            return False
        if error is not None:
            logger.error("batch %s line %d failed", batch_id, line.index, exc_info=error)
            execution = Execution(500, new_id("batch_req_"), {"error": {
                "message": f"Internal error: {error!r}", "type": "InternalServerError", "param": None, "code": 500}})
        else:
            execution = task.result()
        ok = execution.status_code == 200
        if self.store.record_result(batch_id, line.index, ok, output_line(line, execution)):
            self.on_line(ok)
        return True

    async def _cancel(self, tasks: dict[asyncio.Task, tuple[Line, int]]) -> None:
        """Cancel lines still running (the executor aborts their engine requests); they stay pending."""
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, cost in tasks.values():
            self.num_inflight_lines -= 1
            self.num_inflight_tokens -= cost
        tasks.clear()

    def finalize(self, batch_id: str) -> Batch:
        """Write the output and error files; the final status follows the one the batch is in."""
        batch = self.store.get_batch(batch_id)
        final = {"in_progress": "completed", "finalizing": "completed", "cancelling": "cancelled",
                 "expired": "expired"}.get(batch.status)
        if final is None:
            return batch  # failed in validation, or already final
        if final == "expired":
            for line in self.store.pending_lines(batch_id):
                self.store.record_result(batch_id, line.index, False, error_result(
                    line.custom_id, "batch_expired", "This line was not run before the batch expired."))
        if batch.status == "in_progress":
            batch = self.store.set_status(batch_id, "finalizing")
        output: list[str] = []
        errors: list[str] = []
        for ok, result in self.store.results(batch_id):
            (output if ok else errors).append(json.dumps(result, ensure_ascii=False) + "\n")
        output_id = self._write(output)
        error_id = self._write(errors)
        return self.store.set_status(batch_id, final, output_file_id=output_id, error_file_id=error_id)

    def _write(self, lines: list[str]) -> str | None:
        if not lines:
            return None
        return self.store.add_file("".join(lines).encode(), "batch_output.jsonl", "batch_output")["id"]
