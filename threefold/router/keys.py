"""Prompt token ids for routing keys, from the model's tokenizer (never the engine).

Completions are encoded as the server encodes them; chat requests are keyed after
the chat template is applied (the HF tokenizer carries the GGUF's template), so a
multi-turn session's growing prompt shares its block-aligned prefix with the
previous turn, exactly as in the engines' prefix cache.
"""

from __future__ import annotations

from typing import Any

from threefold.errors import ThreefoldError


class PromptKeyer:
    """Body of an OpenAI request -> the prompt token ids the engine will see (best effort)."""

    def __init__(self, model: str | None, tokenizer: str | None = None) -> None:
        from threefold.bench.tokenizer import load_tokenizer

        self.hf = load_tokenizer(model, tokenizer)

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        if path.endswith("/chat/completions"):
            return self._chat_ids(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0]  # a batch is routed by its first prompt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, str):
            return self.hf.encode(prompt, add_special_tokens=body.get("add_special_tokens", True))
        raise ThreefoldError("'prompt' must be a string, a list of strings or a list of token ids.", param="prompt")

    def _chat_ids(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ThreefoldError("'messages' must be a list of message objects.", param="messages")
        flat = [{**m, "content": _text(m.get("content"))} for m in messages]
        try:
            text = self.hf.apply_chat_template(flat, add_generation_prompt=body.get("add_generation_prompt", True),
                                               tokenize=False)
        except Exception as exc:  # the backend will answer with its own 400; route by the raw text
            text = "\n".join(m["content"] for m in flat) if flat else ""
            if not text:
                raise ThreefoldError(f"The chat template could not render these messages: {exc}",
                                     param="messages") from exc
        return self.hf.encode(text, add_special_tokens=False)


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(part.get("text") or "" for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""
