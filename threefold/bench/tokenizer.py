"""The tokenizer a benchmark counts dataset lengths with.

A threefold model name (`smollm2-135m`) resolves through threefold's own
registry; anything else needs `--tokenizer PATH` (an HF directory or a .gguf
file). Rebuilding a tokenizer from GGUF metadata takes seconds, so the result
is saved once as an HF directory under $THREEFOLD_HOME/bench/tokenizers/ and
reloaded from there (~0.2 s).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from threefold.env import Env
from threefold.errors import ThreefoldError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def resolve_model_path(model: str, pull_if_missing: bool = False) -> Path:
    """A registry name or a path -> the local .gguf file or HF directory."""
    from threefold.model.registry import resolve

    return resolve(model, pull_if_missing=pull_if_missing)


def _cache_dir(source: Path) -> Path:
    stat = source.stat()
    key = hashlib.sha1(f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return Env.read().home / "bench" / "tokenizers" / f"{source.stem}-{key}"


def load_tokenizer_from_path(path: Path) -> PreTrainedTokenizerBase:
    """An HF directory loads as is; a .gguf is converted once and cached as an HF directory."""
    from transformers import AutoTokenizer

    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    if path.suffix != ".gguf":
        raise ThreefoldError(f"tokenizer path {path} is neither an HF directory nor a .gguf file", param="tokenizer")
    cached = _cache_dir(path)
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    from threefold.model.tokenizer import Tokenizer

    hf = Tokenizer.from_gguf(path).hf
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(cached.name + ".tmp")
    hf.save_pretrained(str(tmp))
    tmp.rename(cached)  # atomic: a concurrent reader never sees half a directory
    return hf


@functools.lru_cache(maxsize=4)
def load_tokenizer(model: str | None, tokenizer: str | None = None) -> PreTrainedTokenizerBase:
    """`--tokenizer` wins; else the model name must be a threefold name or a local path.
    Cached: a sweep asks for the same tokenizer at every point."""
    if tokenizer:
        path = Path(tokenizer).expanduser()
        if not path.exists():
            raise ThreefoldError(f"--tokenizer {tokenizer}: no such file or directory", param="tokenizer")
        return load_tokenizer_from_path(path)
    if not model:
        raise ThreefoldError("need --tokenizer PATH (or a threefold --model name) to count tokens", param="tokenizer")
    try:
        path = resolve_model_path(model, pull_if_missing=True)
    except ThreefoldError as err:
        raise ThreefoldError(
            f"cannot find a tokenizer for model {model!r} ({err.message}); pass --tokenizer "
            "with an HF directory or a .gguf file", param="tokenizer") from err
    return load_tokenizer_from_path(path)
