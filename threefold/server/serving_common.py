"""What the completions and chat endpoints share: state, admission, sampling params, SSE, usage."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from threefold.engine.async_engine import AsyncEngine, RequestFailedError, RequestStream
from threefold.engine.outputs import RequestOutput, merge_deltas
from threefold.errors import ModelNotFoundError, ThreefoldError
from threefold.sample.params import SamplingParams
from threefold.server.config import ServerConfig
from threefold.server.errors import ClientDisconnected, ServerError, sse_error
from threefold.server.metrics import ServerMetrics
from threefold.server.protocol import SamplingRequest

logger = logging.getLogger(__name__)

STREAMS_SCOPE_KEY = "threefold.streams"
"""The ASGI scope key under which a request lists its engine streams (aborted when the HTTP call ends)."""
REQUEST_CLASS_SCOPE_KEY = "threefold.request_class"
"""The ASGI scope key naming the request class: absent for HTTP calls ("online"); the batch runner sets
"offline" on the requests it builds for the same handlers."""

# Request fields that fall back to the model's generation_config.json when unset.
_DEFAULTED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty")

T = TypeVar("T")


@dataclass
class ServerState:
    """Everything a handler needs; one per app (app.state.server)."""

    config: ServerConfig
    engine: AsyncEngine
    tokenizer: Any
    metrics: ServerMetrics
    max_model_len: int
    generation_defaults: dict[str, Any]
    vocab_size: int
    draining: bool = False
    """Set on SIGTERM: new requests get 503 while in-flight ones finish."""
    num_inflight: int = 0
    """HTTP requests being served now (the middleware counts them)."""
    batch: Any = None
    """The Batch API service (serving_batch.BatchService) when the server has a batch dir; else None."""
    ledger: Any = None
    """The savings ledger (threefold.ledger.Ledger); None for an engine it cannot price."""


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.config.served_model_names:
        raise ModelNotFoundError(f"The model `{model}` does not exist.")


def check_token_ids(state: ServerState, token_ids: Sequence[int], param: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < state.vocab_size]
    if bad:
        raise ThreefoldError(f"Token id {bad[0]} is out of vocabulary (valid ids are 0 to {state.vocab_size - 1}).",
                             param=param)


def sampling_params(state: ServerState, req: SamplingRequest, *, max_tokens: int | None,
                    logprobs: int | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's sampling fields over the model's defaults; SamplingParams validates (400 on bad values)."""
    values: dict[str, Any] = {}
    for name in _DEFAULTED_FIELDS:
        value = getattr(req, name)
        if value is None:
            value = state.generation_defaults.get(name)
        if value is not None:
            values[name] = value
    if max_tokens is None:
        max_tokens = state.generation_defaults.get("max_tokens")  # None: the rest of the context
    return SamplingParams(
        n=req.n, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids, max_tokens=max_tokens,
        min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
        **values)


def check_stream_options(req: SamplingRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise ThreefoldError("Stream options can only be defined when `stream=True`.", param="stream_options")


async def submit(state: ServerState, raw_request: Request, request_id: str, prompt_ids: list[int],
                 params: SamplingParams, priority: int) -> RequestStream:
    """Admit one engine request; it is aborted automatically if the HTTP call ends before it does."""
    request_class = raw_request.scope.get(REQUEST_CLASS_SCOPE_KEY, "online")  # the one place it is chosen
    limit = state.config.max_queued_requests
    if limit is not None and state.engine.num_waiting >= limit and request_class == "online":
        raise ServerError(f"The server is overloaded: {limit} requests are already waiting. Retry later.",
                          503, retry_after_s=state.config.retry_after_s)  # batch work bounds itself
    stream = await state.engine.add_request(request_id, prompt_ids, params, priority=priority,
                                            arrival_time=time.time(), request_class=request_class)
    raw_request.scope.setdefault(STREAMS_SCOPE_KEY, []).append(stream)
    return stream


def raise_if_failed(output: RequestOutput) -> RequestOutput:
    if output.error:
        raise RequestFailedError(f"Request {output.request_id} failed: {output.error}")
    return output


async def final_output(stream: RequestStream) -> RequestOutput:
    """The whole output of a request, gathered from its deltas."""
    deltas = [raise_if_failed(output) async for output in stream]
    assert deltas and deltas[-1].finished
    return merge_deltas(deltas)


async def unless_disconnected(raw_request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but give up (ClientDisconnected) as soon as the client hangs up.

    Non-streaming handlers would otherwise generate to the end for nobody; the
    middleware then aborts the request's engine streams.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise ClientDisconnected()


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:  # the body is already read, so the next message is the disconnect
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
        except Exception as exc:  # noqa: BLE001 — re-raised by the consumer below
            await queue.put((index, exc))
        await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def guarded_sse(chunks: AsyncIterator[str], what: str, request_id: str) -> AsyncIterator[str]:
    """Relay SSE chunks; an error becomes an OpenAI-shaped error event, and the stream always ends with [DONE]."""
    try:
        async for chunk in chunks:
            yield chunk
    except ThreefoldError as exc:
        yield sse_error(exc)
    except Exception as exc:  # one broken request must not break the server
        logger.exception("%s %s failed", what, request_id)
        yield sse_error(exc)
    yield SSE_DONE


def usage(prompt_lens: Sequence[int], num_completion_tokens: int, num_cached_tokens: int,
          outputs: Sequence[Any] = (), ledger: dict | None = None) -> dict:
    """OpenAI's usage block; with KV offload tiers, cached_tokens is also split by tier
    ("pool" = the engine's prefix cache, "cpu", "disk", "redis") from the final `outputs`."""
    prompt_tokens = sum(prompt_lens)
    details: dict[str, Any] = {"cached_tokens": num_cached_tokens}
    by_tier: dict[str, int] = {}
    for output in outputs:
        for tier, count in (getattr(output, "cached_tokens_by_tier", None) or {}).items():
            by_tier[tier] = by_tier.get(tier, 0) + count
    if any(tier != "pool" for tier in by_tier):
        details["cached_tokens_by_tier"] = by_tier
    data = {"prompt_tokens": prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": prompt_tokens + num_completion_tokens, "prompt_tokens_details": details}
    if ledger is not None:
        data["threefold_ledger"] = ledger  # opt-in (--usage-ledger); OpenAI clients keep unknown usage fields
    return data


def ledger_usage(state: ServerState, finals: Sequence[RequestOutput], num_tokens: Sequence[int]) -> dict | None:
    """The opt-in usage extension of these finished engine requests, or None when it is off."""
    if not state.config.usage_ledger or state.ledger is None:
        return None
    from threefold.server.ledger import usage_extension
    return usage_extension(state.ledger, finals, num_tokens)
