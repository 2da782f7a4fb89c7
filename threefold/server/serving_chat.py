"""POST /v1/chat/completions: messages through the model's chat template, `n` choices.

Streaming sends, per choice, a first chunk whose delta carries the role, then
content deltas, then a chunk with the finish_reason (OpenAI's order).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from threefold.engine.async_engine import RequestStream
from threefold.engine.outputs import CompletionOutput, RequestOutput
from threefold.errors import ThreefoldError
from threefold.server.logprobs import chat_logprobs
from threefold.server.protocol import ChatCompletionRequest, ChatMessage
from threefold.server.serving_common import (
    ServerState,
    check_model,
    check_stream_options,
    final_output,
    guarded_sse,
    ledger_usage,
    now_s,
    raise_if_failed,
    random_id,
    sampling_params,
    sse,
    submit,
    unless_disconnected,
    usage,
)


def message_dict(message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template expects it (text parts joined, as vLLM does for text models)."""
    out = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        if any(part.type != "text" for part in message.content):
            raise ThreefoldError("Only text content parts are supported by this model.", param="messages")
        out["content"] = "\n".join(part.text or "" for part in message.content)
    return out


def render_chat(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
                continue_final_message: bool, template_kwargs: dict[str, Any] | None) -> str:
    if continue_final_message and add_generation_prompt:
        raise ThreefoldError("continue_final_message and add_generation_prompt cannot both be true.",
                             param="continue_final_message")
    kwargs = dict(template_kwargs or {})
    if continue_final_message:
        kwargs["continue_final_message"] = True
    try:
        return state.tokenizer.apply_chat_template([message_dict(m) for m in messages],
                                                   add_generation_prompt=add_generation_prompt, **kwargs)
    except ThreefoldError:
        raise
    except Exception as exc:  # a template rejecting the conversation is the client's 400
        raise ThreefoldError(f"The chat template could not render these messages: {exc}", param="messages") from exc


@dataclass
class _Plan:
    request_id: str
    prompt_ids: list[int]
    top_logprobs: int | None
    """None: no logprobs; else how many alternatives per token."""


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw_request: Request):
    check_model(state, req.model)
    check_stream_options(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise ThreefoldError("top_logprobs requires logprobs to be true.", param="top_logprobs")
    top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(state, req, max_tokens=max_tokens, logprobs=top_logprobs)
    text = render_chat(state, req.messages, req.add_generation_prompt, req.continue_final_message,
                       req.chat_template_kwargs)
    # The template already holds BOS and friends, so no special tokens are added on top.
    plan = _Plan(random_id("chatcmpl"), state.tokenizer.encode(text, add_special_tokens=False), top_logprobs)
    stream = await submit(state, raw_request, plan.request_id, plan.prompt_ids, params, req.priority)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunks = guarded_sse(_stream(state, plan, stream, req.n, include_usage), "streaming chat completion",
                             plan.request_id)
        return StreamingResponse(chunks, media_type="text/event-stream")
    final = await unless_disconnected(raw_request, final_output(stream))
    return JSONResponse(_response(state, plan, final))


def _logprobs(state: ServerState, plan: _Plan, token_ids: list[int], positions: list | None) -> dict | None:
    if plan.top_logprobs is None:
        return None
    return chat_logprobs(state.tokenizer, token_ids, positions, plan.top_logprobs)


def _response(state: ServerState, plan: _Plan, final: RequestOutput) -> dict:
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": _logprobs(state, plan, c.token_ids, c.logprobs),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in final.outputs]
    num_generated = sum(len(c.token_ids) for c in final.outputs)
    return {"id": plan.request_id, "object": "chat.completion", "created": now_s(),
            "model": state.config.model_name, "choices": choices,
            "usage": usage([len(plan.prompt_ids)], num_generated, final.num_cached_tokens, [final],
                           ledger_usage(state, [final], [num_generated]))}


def _chunk(state: ServerState, plan: _Plan, choices: list[dict], include_usage: bool) -> dict:
    chunk = {"id": plan.request_id, "object": "chat.completion.chunk", "created": now_s(),
             "model": state.config.model_name, "choices": choices}
    if include_usage:
        chunk["usage"] = None
    return chunk


@dataclass
class _Cursor:
    num_tokens: int = 0
    """Tokens generated so far (the stream carries deltas)."""
    finished: bool = False


def _delta_choice(state: ServerState, plan: _Plan, completion: CompletionOutput, cursor: _Cursor) -> dict | None:
    """The chunk for one delta of a completion, or None when it has nothing to show."""
    new_text, new_ids = completion.text, completion.token_ids
    cursor.num_tokens += len(new_ids)
    finish = completion.finish_reason
    if not (new_text or finish or (new_ids and plan.top_logprobs is not None)):
        return None  # text held back (a possible stop-string prefix): nothing to send yet
    choice = {"index": completion.index, "delta": {"content": new_text} if new_text else {},
              "logprobs": _logprobs(state, plan, new_ids, completion.logprobs), "finish_reason": finish,
              "stop_reason": completion.stop_reason if finish else None}
    cursor.finished = finish is not None
    return choice


async def _stream(state: ServerState, plan: _Plan, stream: RequestStream, n: int,
                  include_usage: bool) -> AsyncIterator[str]:
    cursors = [_Cursor() for _ in range(n)]
    final: RequestOutput | None = None
    for index in range(n):
        role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}
        yield sse(_chunk(state, plan, [role], include_usage))
    async for output in stream:
        raise_if_failed(output)
        for completion in output.outputs:
            cursor = cursors[completion.index]
            choice = None if cursor.finished else _delta_choice(state, plan, completion, cursor)
            if choice is not None:
                yield sse(_chunk(state, plan, [choice], include_usage))
        final = output
    if include_usage and final is not None:
        chunk = _chunk(state, plan, [], False)
        num_generated = sum(c.num_tokens for c in cursors)
        chunk["usage"] = usage([len(plan.prompt_ids)], num_generated, final.num_cached_tokens, [final],
                               ledger_usage(state, [final], [num_generated]))
        yield sse(chunk)
