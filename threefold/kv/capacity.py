"""What a KV budget holds under each codec (`threefold info`): bytes per token and tokens."""

from __future__ import annotations

import torch

from threefold.kv.registry import make_codec

SHOWN_CODECS = ("auto", "int8", "fp8_e4m3", "fp8_e5m2", "int4")


def arch_config(model: str, dtype: str = "auto"):
    """The model's architecture config (layers, KV heads, head_dim, compute dtype) without its weights."""
    from threefold.model import gguf_loader, hf_loader
    from threefold.model.loader import resolve_dtype
    from threefold.model.registry import resolve

    path = resolve(model)
    if path.is_dir():
        raw = hf_loader.read_config(path)
        return hf_loader.hf_arch_config(raw, resolve_dtype(dtype, hf_loader.checkpoint_dtype(raw), "cpu"))
    reader = gguf_loader.open_gguf(path)
    checkpoint = torch.float32 if gguf_loader.gguf_is_full_precision(reader) else torch.bfloat16
    return gguf_loader.gguf_arch_config(reader, resolve_dtype(dtype, checkpoint, "cpu"))


def capacity_rows(config, budget_bytes: int, block_size: int = 16,
                  codecs: tuple[str, ...] = SHOWN_CODECS) -> list[dict]:
    """Per codec: resolved spec, bytes per token (all layers, codes + scales + zeros), tokens in the budget."""
    rows = []
    for spec in codecs:
        codec = make_codec(spec, config.num_kv_heads, config.head_dim, config.dtype)
        block_bytes = config.num_layers * codec.bytes_per_block(block_size)
        rows.append({"kv_cache_dtype": str(codec.spec), "bytes_per_token": block_bytes / block_size,
                     "capacity_tokens": budget_bytes // block_bytes * block_size})
    return rows
