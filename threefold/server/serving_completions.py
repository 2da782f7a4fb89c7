"""POST /v1/completions: one engine request per prompt, `n` completions each.

Choice index = prompt_index * n + completion_index (as vLLM and OpenAI number them).
`echo` with `logprobs` returns the prompt's token logprobs in front (the first
is null), which is how lm-eval's local-completions scores log-likelihoods;
`max_tokens=0` with echo asks the engine for one token and drops it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import cast

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from threefold.engine.async_engine import RequestStream
from threefold.engine.outputs import CompletionOutput, RequestOutput
from threefold.errors import ThreefoldError
from threefold.server.logprobs import LegacyLogprobs, concat_legacy
from threefold.server.protocol import CompletionRequest
from threefold.server.serving_common import (
    ServerState,
    check_model,
    check_stream_options,
    check_token_ids,
    final_output,
    guarded_sse,
    ledger_usage,
    merge_streams,
    now_s,
    raise_if_failed,
    random_id,
    sampling_params,
    sse,
    submit,
    unless_disconnected,
    usage,
)


@dataclass
class _Prompt:
    text: str
    token_ids: list[int]


@dataclass
class _Plan:
    """What the request asks of each engine request, resolved once."""

    request_id: str
    prompts: list[_Prompt]
    n: int
    echo: bool
    drop_generated: bool
    """max_tokens=0 with echo: one token is generated for the engine's sake, then dropped."""
    num_logprobs: int | None


def _prompts(state: ServerState, req: CompletionRequest) -> list[_Prompt]:
    raw = req.prompt
    # The request model validated the union: a list whose first item is an int is all ints.
    items: list[str] | list[list[int]]
    if isinstance(raw, str):
        items = [raw]
    elif raw and isinstance(raw[0], int):
        items = [list(raw)]  # one prompt of token ids
    else:
        items = cast("list[str] | list[list[int]]", raw)
    if not items:
        raise ThreefoldError("prompt must not be empty.", param="prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append(_Prompt(item, state.tokenizer.encode(item, add_special_tokens=req.add_special_tokens)))
        else:
            check_token_ids(state, item, "prompt")
            prompts.append(_Prompt(state.tokenizer.decode(item, skip_special_tokens=False), list(item)))
    return prompts


async def create_completion(state: ServerState, req: CompletionRequest, raw_request: Request):
    check_model(state, req.model)
    check_stream_options(req)
    if req.suffix is not None:
        raise ThreefoldError("suffix is not supported: this server does no fill-in-the-middle completion.",
                             param="suffix")
    drop_generated = req.echo and req.max_tokens == 0
    params = sampling_params(state, req, max_tokens=1 if drop_generated else req.max_tokens,
                             logprobs=req.logprobs, prompt_logprobs=req.logprobs if req.echo else None)
    plan = _Plan(random_id("cmpl"), _prompts(state, req), req.n, req.echo, drop_generated, req.logprobs)
    streams = [await submit(state, raw_request, f"{plan.request_id}-{i}", p.token_ids, params, req.priority)
               for i, p in enumerate(plan.prompts)]
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunks = guarded_sse(_stream(state, plan, streams, include_usage), "streaming completion", plan.request_id)
        return StreamingResponse(chunks, media_type="text/event-stream")
    finals = await unless_disconnected(raw_request, _all_final(streams))
    return JSONResponse(_response(state, plan, finals))


async def _all_final(streams: list[RequestStream]) -> list[RequestOutput]:
    return [await final_output(stream) for stream in streams]


def _generated(plan: _Plan, completion: CompletionOutput) -> tuple[str, list[int], list | None]:
    if plan.drop_generated:
        return "", [], [] if completion.logprobs is not None else None
    return completion.text, completion.token_ids, completion.logprobs


def _response(state: ServerState, plan: _Plan, finals: list[RequestOutput]) -> dict:
    choices, num_generated = [], 0
    for prompt_index, (prompt, output) in enumerate(zip(plan.prompts, finals, strict=True)):
        for completion in output.outputs:
            text, token_ids, positions = _generated(plan, completion)
            num_generated += len(token_ids)
            logprobs = None
            if plan.num_logprobs is not None:
                builder = LegacyLogprobs(state.tokenizer)  # offsets run on from the echoed prompt
                echoed = builder.slice(prompt.token_ids, output.prompt_logprobs) if plan.echo else None
                generated = builder.slice(token_ids, positions)
                logprobs = concat_legacy(echoed, generated) if echoed else generated
            choices.append({"index": prompt_index * plan.n + completion.index,
                            "text": prompt.text + text if plan.echo else text, "logprobs": logprobs,
                            "finish_reason": "length" if plan.drop_generated else completion.finish_reason,
                            "stop_reason": None if plan.drop_generated else completion.stop_reason})
    cached = sum(o.num_cached_tokens for o in finals)
    ledger = ledger_usage(state, finals, [sum(len(c.token_ids) for c in o.outputs) for o in finals])
    return {"id": plan.request_id, "object": "text_completion", "created": now_s(),
            "model": state.config.model_name, "choices": choices,
            "usage": usage([len(p.token_ids) for p in plan.prompts], num_generated, cached, finals, ledger)}


@dataclass
class _ChoiceCursor:
    """How much of one choice the client has already been sent."""

    num_tokens: int = 0
    """Tokens generated so far (the stream carries deltas)."""
    finished: bool = False
    started: bool = False
    logprobs: LegacyLogprobs | None = None


def _chunk(state: ServerState, plan: _Plan, choices: list[dict], include_usage: bool) -> dict:
    chunk = {"id": plan.request_id, "object": "text_completion", "created": now_s(),
             "model": state.config.model_name, "choices": choices}
    if include_usage:
        chunk["usage"] = None
    return chunk


def _delta_choice(state: ServerState, plan: _Plan, prompt_index: int, output: RequestOutput,
                  completion: CompletionOutput, cursor: _ChoiceCursor) -> dict | None:
    text, token_ids, positions = _generated(plan, completion)
    prefix, logprobs = "", None
    if plan.num_logprobs is not None and cursor.logprobs is None:
        cursor.logprobs = LegacyLogprobs(state.tokenizer)
    if plan.echo and not cursor.started:
        prompt = plan.prompts[prompt_index]
        prefix = prompt.text
        if cursor.logprobs is not None:
            logprobs = cursor.logprobs.slice(prompt.token_ids, output.prompt_logprobs)
    cursor.started = True
    new_text, new_ids = text, token_ids
    cursor.num_tokens += len(new_ids)
    finish = completion.finish_reason if not plan.drop_generated else ("length" if completion.finished() else None)
    if not (prefix or new_text or finish or (new_ids and cursor.logprobs is not None)):
        return None  # text held back (a possible stop-string prefix): nothing to send yet
    if cursor.logprobs is not None:
        generated = cursor.logprobs.slice(new_ids, positions)
        logprobs = concat_legacy(logprobs, generated) if logprobs else generated
    cursor.finished = finish is not None
    return {"index": prompt_index * plan.n + completion.index, "text": prefix + new_text, "logprobs": logprobs,
            "finish_reason": finish, "stop_reason": None if finish is None or plan.drop_generated
            else completion.stop_reason}


async def _stream(state: ServerState, plan: _Plan, streams: list[RequestStream],
                  include_usage: bool) -> AsyncIterator[str]:
    cursors: dict[tuple[int, int], _ChoiceCursor] = {}
    finals: dict[int, RequestOutput] = {}
    async for prompt_index, output in merge_streams(streams):
        raise_if_failed(output)
        for completion in output.outputs:
            cursor = cursors.setdefault((prompt_index, completion.index), _ChoiceCursor())
            if cursor.finished:
                continue
            choice = _delta_choice(state, plan, prompt_index, output, completion, cursor)
            if choice is not None:
                yield sse(_chunk(state, plan, [choice], include_usage))
        if output.finished:
            finals[prompt_index] = output
    if include_usage:
        num_generated = sum(c.num_tokens for c in cursors.values())
        cached = sum(o.num_cached_tokens for o in finals.values())
        chunk = _chunk(state, plan, [], False)
        indexes = sorted(finals)
        per_prompt = [sum(c.num_tokens for (i, _), c in cursors.items() if i == index) for index in indexes]
        ledger = ledger_usage(state, [finals[i] for i in indexes], per_prompt)
        chunk["usage"] = usage([len(p.token_ids) for p in plan.prompts], num_generated, cached,
                               [finals[i] for i in indexes], ledger)
        yield sse(chunk)
