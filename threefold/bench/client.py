"""One streamed OpenAI request, timed chunk by chunk.

Works against any OpenAI-compatible server: `/v1/completions` (prompt text or
token ids) and `/v1/chat/completions` (messages). We ask for
`stream_options.include_usage` so the last chunk carries the server's own
token counts (and `prompt_tokens_details.cached_tokens` where it reports
prefix-cache hits); a server that ignores it gets counted by content chunks.

Times are `time.perf_counter()` seconds. TTFT is to the first chunk that
carries text (a chat server's opening role-only chunk does not count).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    """What one request measured; `error` is set (and the timings partial) when it failed."""

    ok: bool = False
    error: str | None = None
    start: float = 0.0
    """perf_counter at send, relative to the benchmark start."""
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    """Gaps between consecutive text chunks (a chunk may hold several tokens)."""
    prompt_tokens: int | None = None
    """From usage; None when the server gave none."""
    output_tokens: int = 0
    """usage.completion_tokens, or the number of text chunks when no usage came."""
    cached_tokens: int | None = None
    cached_tokens_by_tier: dict[str, int] | None = None
    """usage.prompt_tokens_details.cached_tokens_by_tier (threefold's KV tiers: pool, cpu, disk, redis)."""
    text: str = ""
    prompt_len: int = 0
    """The benchmark's own count of the prompt (for throughput when usage is missing)."""
    turn: int | None = None
    """Turn index within a session (0-based); None for single-turn workloads."""
    session_id: str | None = None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (n - 1)."""
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def _chunk_text(chunk: dict, chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        delta = choices[0].get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choices[0].get("text") or ""


def _apply_usage(result: RequestResult, usage: dict) -> None:
    result.prompt_tokens = usage.get("prompt_tokens")
    if usage.get("completion_tokens") is not None:
        result.output_tokens = usage["completion_tokens"]
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        result.cached_tokens = details["cached_tokens"]
    if isinstance(details.get("cached_tokens_by_tier"), dict):
        result.cached_tokens_by_tier = {str(k): int(v) for k, v in details["cached_tokens_by_tier"].items()}


def _finish_reason(chunk: dict) -> str | None:
    choices = chunk.get("choices") or []
    return choices[0].get("finish_reason") if choices else None


async def _read_stream(response: httpx.Response, result: RequestResult, chat: bool, t0: float) -> bool:
    """Consume the SSE stream into `result`; True when it ended cleanly ([DONE] or a finish_reason)."""
    num_chunks, last, clean = 0, t0, False
    first_choice: float | None = None
    usage: dict | None = None
    async for raw_line in response.aiter_lines():
        line = raw_line.strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            clean = True
            break
        chunk = json.loads(payload)
        if chunk.get("error"):
            raise RuntimeError(f"error in stream: {chunk['error']}")
        usage = chunk.get("usage") or usage
        clean = clean or _finish_reason(chunk) is not None
        now = time.perf_counter()
        if first_choice is None and chunk.get("choices"):
            first_choice = now
        text = _chunk_text(chunk, chat)
        if not text:
            continue
        if result.ttft is None:
            result.ttft = now - t0
        else:
            result.itl.append(now - last)
        last = now
        num_chunks += 1
        result.text += text
    result.e2e = time.perf_counter() - t0
    if result.ttft is None and clean:
        # An empty completion (EOS first) is a success; its "first token" is the finishing chunk.
        result.ttft = (first_choice or time.perf_counter()) - t0
    result.output_tokens = num_chunks
    if usage:
        _apply_usage(result, usage)
    return clean


async def stream_request(client: httpx.AsyncClient, url: str, body: dict, chat: bool,
                         result: RequestResult, t_origin: float) -> RequestResult:
    """POST `body` with stream=True to `url` and fill `result`; never raises for a failed request."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    result.start = t0 - t_origin
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                result.error = f"HTTP {response.status_code}: {detail}"
                return result
            clean = await _read_stream(response, result, chat, t0)
        result.ok = clean
        if not clean:
            result.error = "the stream ended before [DONE] or a finish_reason"
    except (httpx.HTTPError, json.JSONDecodeError, RuntimeError) as err:
        result.error = f"{type(err).__name__}: {err}"
    if result.e2e is None:
        result.e2e = time.perf_counter() - t0
    return result


def _extras(body: dict, ignore_eos: bool, logit_bias: dict[str, float] | None) -> dict:
    if ignore_eos:
        body["ignore_eos"] = True  # a vLLM/threefold extension; llama.cpp ignores it
    if logit_bias:
        body["logit_bias"] = logit_bias  # standard OpenAI: how llama.cpp is kept from stopping
    return body


def completion_body(model: str, prompt: str | list[int], max_tokens: int, ignore_eos: bool,
                    temperature: float, logit_bias: dict[str, float] | None = None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
    return _extras(body, ignore_eos, logit_bias)


def chat_body(model: str, messages: list[dict], max_tokens: int, ignore_eos: bool, temperature: float,
              logit_bias: dict[str, float] | None = None) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
    return _extras(body, ignore_eos, logit_bias)
