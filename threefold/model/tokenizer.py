"""A thin wrapper over a transformers fast tokenizer, from an HF directory or a GGUF file."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from threefold.errors import ThreefoldError

logger = logging.getLogger(__name__)

EOG_TOKEN_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
    "<|end_of_text|>",
)


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
    def from_gguf(cls, path: Path, chat_template: str | None = None, cache_dir: Path | None = None) -> Tokenizer:
        """transformers rebuilds the HF tokenizer from the GGUF vocab/merges metadata
        (seconds for a 150k vocab), so the result is saved under `cache_dir` (keyed by
        the caller, e.g. by file fingerprint) and reloaded from there next time. The chat
        template (GGUF key tokenizer.chat_template) is set if it did not carry over."""
        if cache_dir is not None and (cache_dir / "tokenizer.json").is_file():
            return cls._with_template(AutoTokenizer.from_pretrained(str(cache_dir)), chat_template)
        # The conversion logs a warning per call about GGUF support; keep loads quiet.
        log = logging.getLogger("transformers.tokenization_utils_base")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        finally:
            log.setLevel(level)
        tokenizer = cls._with_template(hf, chat_template)
        if cache_dir is not None:
            _save_atomically(hf, cache_dir)
        return tokenizer

    @classmethod
    def _with_template(cls, hf: PreTrainedTokenizerBase, chat_template: str | None) -> Tokenizer:
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
        text = self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)  # one id list decodes to one string
        return text

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        return self.hf.convert_ids_to_tokens(ids)

    def end_of_generation_ids(self) -> list[int]:
        """Ids of the end-of-turn/end-of-text tokens llama.cpp treats as end of generation
        (llama-vocab.cpp's EOG list); GGUF files carry no generation_config, so e.g.
        Qwen2.5's <|endoftext|> (next to eos <|im_end|>) is found this way."""
        ids = (self.backend.token_to_id(text) for text in EOG_TOKEN_TEXTS)
        return [i for i in ids if i is not None]

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
        text = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kw)
        assert isinstance(text, str)  # tokenize=False renders one conversation to one string
        return text


def _save_atomically(hf: PreTrainedTokenizerBase, cache_dir: Path) -> None:
    """Save into a temp dir and rename, so a concurrent reader never sees half a tokenizer.
    A failure only costs the next load the conversion again, so it is logged, not raised."""
    tmp = cache_dir.with_name(f".{cache_dir.name}.{os.getpid()}.tmp")
    try:
        hf.save_pretrained(str(tmp))
        tmp.rename(cache_dir)
    except OSError as err:
        logger.warning("could not cache the GGUF tokenizer in %s: %s", cache_dir, err)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
