"""vLLM's /tokenize, /detokenize and /tokenizer_info."""

from __future__ import annotations

from typing import Any

from threefold.errors import ThreefoldError
from threefold.server.protocol import DetokenizeRequest, TokenizeRequest
from threefold.server.serving_chat import render_chat
from threefold.server.serving_common import ServerState, check_model, check_token_ids

# Tokenizer settings worth showing (the rest of init_kwargs are paths and internals).
_INFO_KEYS = ("add_bos_token", "add_eos_token", "bos_token", "eos_token", "pad_token", "unk_token",
              "clean_up_tokenization_spaces", "model_max_length", "padding_side", "truncation_side")


def tokenize(state: ServerState, req: TokenizeRequest) -> dict:
    check_model(state, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise ThreefoldError("Give exactly one of `prompt` or `messages`.", param="prompt")
    if req.messages is not None:
        text = render_chat(state, req.messages, req.add_generation_prompt, req.continue_final_message,
                           req.chat_template_kwargs)
        add_special = bool(req.add_special_tokens)
    else:
        text = req.prompt or ""
        add_special = req.add_special_tokens is not False
    token_ids = state.tokenizer.encode(text, add_special_tokens=add_special)
    token_strs = state.tokenizer.convert_ids_to_tokens(token_ids) if req.return_token_strs else None
    return {"count": len(token_ids), "max_model_len": state.max_model_len, "tokens": token_ids,
            "token_strs": token_strs}


def detokenize(state: ServerState, req: DetokenizeRequest) -> dict:
    check_model(state, req.model)
    check_token_ids(state, req.tokens, "tokens")
    return {"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def tokenizer_info(state: ServerState) -> dict:
    hf = getattr(state.tokenizer, "hf", None)
    info: dict[str, Any] = {"tokenizer_class": type(hf).__name__ if hf is not None else type(state.tokenizer).__name__}
    init_kwargs = getattr(hf, "init_kwargs", {}) or {}
    for key in _INFO_KEYS:
        value = init_kwargs.get(key, getattr(hf, key, None))
        if value is not None:
            info[key] = value if isinstance(value, (str, int, float, bool)) else str(value)
    info["chat_template"] = getattr(hf, "chat_template", None)
    info["vocab_size"] = state.vocab_size
    info["max_model_len"] = state.max_model_len
    return info
