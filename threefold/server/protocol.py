"""Request bodies of the OpenAI-compatible API (pydantic), field for field as vLLM accepts them.

Unknown fields are ignored, not rejected (pydantic's default), so clients that
send `user`, `tools`, `logit_bias`... keep working. Value checks live in
SamplingParams; pydantic only checks types, so a wrong type and a bad value
both come back as a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False
    """Send a last chunk with `usage` (and `"usage": null` on every other chunk)."""
    continuous_usage_stats: bool = False
    """Accepted for vLLM compatibility; usage is only reported at the end."""


class SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. None means: the model's default."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0
    """Lower runs first (vLLM's convention)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    """Return the prompt in front of the completion (with its logprobs when `logprobs` is set)."""
    logprobs: int | None = None
    """Top logprobs per token, legacy completions format."""
    suffix: str | None = None
    """Not supported (no fill-in-the-middle); rejected with a 400 rather than ignored."""
    add_special_tokens: bool = True


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls... reach the template untouched
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    """The newer name of max_tokens; wins when both are set."""
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: either `prompt` (completion style) or `messages` (chat style)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """Default: True for a prompt, False for messages (the chat template adds its own)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


