"""AsyncEngine: the LLMEngine driven from its own thread, fed and drained by asyncio.

    event loop (many coroutines)             engine thread (the only LLMEngine caller)
    ───────────────────────────             ─────────────────────────────────────────
    add_request() ─► command queue ───────►  engine.add_request()  (errors come back
                 ◄── Future (validated) ◄──     through the Future: 400s stay 400s)
    abort()       ─► command queue ───────►  engine.abort_request()
    async for out in stream  ◄── call_soon_threadsafe ◄── engine.step() outputs

The LLMEngine is not thread-safe, so everything that touches it runs on the
engine thread; the event loop never blocks on a forward pass. If the loop
dies (an exception escapes `step()`), every open stream fails with
EngineDeadError and `is_healthy` turns False.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, NamedTuple

from threefold.core.request import check_request_class
from threefold.engine.outputs import CompletionOutput, RequestOutput, RequestOutputKind, merge_deltas
from threefold.errors import ThreefoldError
from threefold.sample.params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 0.5  # how long the idle engine thread sleeps on an empty command queue


class EngineDeadError(ThreefoldError):
    """The engine loop has stopped; no request can be served until a restart."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status_code=503)


class RequestFailedError(ThreefoldError):
    """One request failed inside the engine; the others carry on."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status_code=500)


class StatLogger:
    """Observer of engine steps (the server's Prometheus metrics are one).

    Rules: every method runs on the engine thread, right after the engine call
    it describes; it must be quick and must not raise (errors are logged and
    dropped, never allowed to kill the loop).
    """

    def on_added(self, request_id: str, arrival_time: float) -> None:
        """A request was accepted by the engine."""

    def on_step(self, stats: Any, outputs: Sequence[RequestOutput], now: float) -> None:
        """After each engine step (outputs may be empty) or command batch; `stats` is EngineStats.
        `outputs` are deltas (RequestOutputKind.DELTA): each carries only that step's news."""

    def on_aborted(self, request_ids: Sequence[str], now: float) -> None:
        """Live requests that were aborted (they produce no further outputs)."""


class RequestStream:
    """One request's outputs, handed from the engine thread to one asyncio consumer.

    The engine hands over deltas (RequestOutputKind.DELTA): each carries only
    what is new, so a step costs the same however long the completion is. A
    slow consumer gets the deltas that piled up merged into one (never
    skipping text). Iterate it with `async for`; iteration ends after the
    finished output.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.finished = False
        """True once the final output (or an error) has been handed over."""
        self.last_output: RequestOutput | None = None
        """Engine thread: the newest delta handed over (its completions' finish state bases an abort's output)."""
        self._loop = loop
        self._pending: list[RequestOutput] = []
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Engine thread: hand over the next delta, or an exception that ends the stream."""
        if isinstance(item, BaseException) or item.finished:
            self.finished = True
        if isinstance(item, RequestOutput):
            self.last_output = item
        self._loop.call_soon_threadsafe(self._deliver, item)

    def _deliver(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = self._error or item  # an error is final: never overwrite it
        elif self._error is None:
            self._pending.append(item)
        self._ready.set()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while True:
            await self._ready.wait()
            self._ready.clear()
            if self._error is not None:
                raise self._error
            if not self._pending:
                continue
            items, self._pending = self._pending, []
            item = merge_deltas(items)
            yield item
            if item.finished:
                return


class _Add(NamedTuple):
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    stream: RequestStream
    accepted: concurrent.futures.Future
    request_class: str = "online"


class _Abort(NamedTuple):
    request_ids: list[str]


class _Call(NamedTuple):
    fn: Callable[[], Any]
    done: concurrent.futures.Future


_STOP = object()


class AsyncEngine:
    """Owns the engine thread. Create it, then `start()`; `shutdown()` stops the thread."""

    def __init__(self, engine: Any, stat_loggers: Iterable[StatLogger] = ()) -> None:
        self.engine = engine
        self.stat_loggers = list(stat_loggers)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._stopping = False
        self._lock = threading.Lock()
        self._num_queued_adds = 0  # submitted, not yet taken by the engine thread
        self._stats: Any = None

    # ---- lifecycle -------------------------------------------------------

    def start(self) -> AsyncEngine:
        self._stats = self.engine.get_stats()
        self._thread = threading.Thread(target=self._run, name="threefold-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread after its current step (open streams are aborted)."""
        self._stopping = True
        self._commands.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        if self._dead is not None:
            return repr(self._dead)
        return None if self.is_healthy else "the engine thread is not running"

    # ---- event-loop side API --------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: the engine's waiting queue plus adds still in flight to it."""
        with self._lock:
            queued = self._num_queued_adds
        return queued + (self._stats.num_waiting if self._stats is not None else 0)

    @property
    def stats(self) -> Any:
        """The EngineStats of the last step (refreshed by the engine thread)."""
        return self._stats

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0, arrival_time: float | None = None,
                          request_class: str = "online") -> RequestStream:
        """Queue a request; returns its stream once the engine has validated and accepted it.

        Raises the engine's ThreefoldError (bad prompt, context too long) or
        EngineDeadError. The caller must `abort()` the stream if it stops reading early.
        """
        self._raise_if_dead()
        check_request_class(request_class)
        stream = RequestStream(request_id, asyncio.get_running_loop())
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._num_queued_adds += 1
        self._commands.put(_Add(request_id, prompt, params, priority,
                                arrival_time if arrival_time is not None else time.time(), stream, accepted,
                                request_class))
        if self._dead is not None:  # the loop died after the check above: nobody will take the command
            self._fail_queued(EngineDeadError(f"The engine loop died: {self._dead!r}"))
        await asyncio.wrap_future(accepted)
        return stream

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored). Non-blocking, any thread."""
        ids = list(request_ids)
        if ids:
            self._commands.put(_Abort(ids))

    def abort_all(self) -> None:
        self._commands.put(_Call(lambda: self._abort_on_thread(list(self._streams)), concurrent.futures.Future()))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the engine thread (between steps) and return its result."""
        self._raise_if_dead()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Call(fn, done))
        return await asyncio.wrap_future(done)

    def _raise_if_dead(self) -> None:
        if self._dead is not None or self._stopping:
            raise EngineDeadError(f"The engine loop is not running ({self.dead_reason or 'shutting down'}).")

    # ---- engine thread ---------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if not self._drain_commands(block=not busy):
                    break
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
                now = time.time()
                self._publish(outputs)
                self._stats = self.engine.get_stats()
                self._notify("on_step", self._stats, outputs, now)
        except BaseException as exc:  # the loop must report its own death
            logger.exception("engine loop died")
            self._die(exc)
            return
        self._die(EngineDeadError("The engine was shut down."))

    def _drain_commands(self, block: bool) -> bool:
        """Apply every queued command; when idle, wait for the first one. False means stop."""
        try:
            command = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Add):
            self._add_on_thread(command)
        elif isinstance(command, _Abort):
            self._abort_on_thread(command.request_ids)
        else:
            try:
                command.done.set_result(command.fn())
            except Exception as exc:  # noqa: BLE001 — handed to the caller
                command.done.set_exception(exc)

    def _add_on_thread(self, add: _Add) -> None:
        with self._lock:
            self._num_queued_adds -= 1
        try:
            self.engine.add_request(add.request_id, add.prompt, add.params, priority=add.priority,
                                    arrival_time=add.arrival_time, output_kind=RequestOutputKind.DELTA,
                                    request_class=add.request_class)
        except Exception as exc:  # noqa: BLE001 — a rejected request, handed back to its caller
            add.accepted.set_exception(exc)
            return
        self._streams[add.request_id] = add.stream
        self._notify("on_added", add.request_id, add.arrival_time)
        add.accepted.set_result(None)

    def _abort_on_thread(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if rid in self._streams]
        if not live:
            return
        self.engine.abort_request(live)
        for rid in live:
            stream = self._streams.pop(rid)
            if not stream.finished:
                stream.put(_aborted_output(rid, stream.last_output))
        self._notify("on_aborted", live, time.time())

    def _publish(self, outputs: Sequence[RequestOutput]) -> None:
        """Hand each delta to its stream as it is: the engine built it this step and never touches it again."""
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted while the step ran
            if output.finished:
                del self._streams[output.request_id]
            stream.put(output)

    def _notify(self, method: str, *args: Any) -> None:
        for stat_logger in self.stat_loggers:
            try:
                getattr(stat_logger, method)(*args)
            except Exception:  # metrics must never kill the engine loop
                logger.exception("stat logger %s.%s failed", type(stat_logger).__name__, method)

    def _die(self, exc: BaseException) -> None:
        self._dead = exc
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"The engine loop died: {exc!r}")
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()
        self._fail_queued(error)

    def _fail_queued(self, error: EngineDeadError) -> None:
        """Fail the commands nobody will apply (safe from any thread once the loop is dead)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                command.accepted.set_exception(error)
            elif isinstance(command, _Call) and not command.done.done():
                command.done.set_exception(error)


def _aborted_output(request_id: str, last: RequestOutput | None) -> RequestOutput:
    """The final delta of an aborted request: nothing new, unfinished completions marked "abort"."""
    if last is None:
        return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[], prompt_logprobs=None,
                             outputs=[CompletionOutput(0, "", [], None, None, finish_reason="abort")],
                             finished=True)
    completions = [dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                                       finish_reason=c.finish_reason or "abort") for c in last.outputs]
    return dataclasses.replace(last, outputs=completions, prompt_logprobs=None, finished=True)
