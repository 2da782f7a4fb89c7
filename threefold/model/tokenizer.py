"""A thin wrapper over a transformers fast tokenizer, from an HF directory or a GGUF file."""

from __future__ import annotations

import logging
from pathlib import Path

import tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from threefold.errors import ThreefoldError


class Tokenizer:
    """Encode/decode and chat templates; `backend` serves incremental detokenization
    (tokenizers.decoders.DecodeStream)."""

    def __init__(self, hf: PreTrainedTokenizerBase) -> None:
        self.hf = hf
        self.backend: tokenizers.Tokenizer = hf.backend_tokenizer
        self.bos_token_id: int | None = hf.bos_token_id
        self.eos_token_id: int | None = hf.eos_token_id
        self.all_special_ids: list[int] = list(hf.all_special_ids)

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        return cls(AutoTokenizer.from_pretrained(str(path)))

    @classmethod
    def from_gguf(cls, path: Path, chat_template: str | None = None) -> Tokenizer:
        """transformers rebuilds the HF tokenizer from the GGUF vocab/merges metadata;
        the chat template (GGUF key tokenizer.chat_template) is set if it did not carry over."""
        # The conversion logs a warning per call about GGUF support; keep loads quiet.
        log = logging.getLogger("transformers.tokenization_utils_base")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        finally:
            log.setLevel(level)
        if not getattr(hf, "chat_template", None) and chat_template:
            hf.chat_template = chat_template
        return cls(hf)

    @property
    def vocab_size(self) -> int:
        """Number of tokens including added ones (may be below the model's padded vocab)."""
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        return self.hf.convert_ids_to_tokens(ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kw) -> str:
        """Render messages to the prompt text (not ids: the caller encodes with
        add_special_tokens=False, since templates write their own special tokens)."""
        if not self.has_chat_template:
            raise ThreefoldError(
                "this model has no chat template; use the completions API with a plain prompt", param="messages"
            )
        return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kw)
