"""What a KV budget holds under each codec (`threefold info`): bytes per token and tokens."""

from __future__ import annotations

import math

import torch

from threefold.kv.codecs.kivi import KiviCodec
from threefold.kv.mix import layer_specs, mix_text
from threefold.kv.registry import make_codec
from threefold.kv.window import ArenaShape, window_dtype, window_slots

SHOWN_CODECS = ("auto", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "kivi2", "kivi4", "tiered")


def arch_config(model: str, dtype: str = "auto"):
    """The model's architecture config (layers, KV heads, head_dim, compute dtype) without its weights."""
    from threefold.model import gguf_loader, hf_loader
    from threefold.model.loader import choose_precision
    from threefold.model.registry import resolve

    path = resolve(model)
    if path.is_dir():
        raw = hf_loader.read_config(path)
        precision, _ = choose_precision(dtype, hf_loader.checkpoint_dtype(raw), "cpu")
        return hf_loader.hf_arch_config(raw, precision.compute)
    reader = gguf_loader.open_gguf(path)
    checkpoint = torch.float32 if gguf_loader.gguf_is_full_precision(reader) else torch.bfloat16
    precision, _ = choose_precision(dtype, checkpoint, "cpu")  # the KV cache holds the compute dtype
    return gguf_loader.gguf_arch_config(reader, precision.compute)


def mix_geometry(config, spec: str, block_size: int) -> tuple[int, int, int]:
    """(block size, bytes per block of all layers, one request's window bytes) of a plain spec or a
    per-layer mix, at a block size that is a multiple of every KIVI layer's group."""
    specs = layer_specs(spec, config.num_layers)
    made = {text: make_codec(s, config.num_kv_heads, config.head_dim, config.dtype)
            for text, s in {str(s): s for s in specs}.items()}  # one codec per distinct spec
    codecs = [made[str(s)] for s in specs]
    block = math.lcm(block_size, *(c.group for c in made.values() if isinstance(c, KiviCodec)))
    arena = ArenaShape.of(codecs, block)
    window = arena.bytes_per_slot(config.num_kv_heads, config.head_dim, window_dtype(config.dtype))
    return block, sum(c.bytes_per_block(block) for c in codecs), window


def capacity_rows(config, budget_bytes: int, block_size: int = 16, codecs: tuple[str, ...] = SHOWN_CODECS,
                  max_num_seqs: int = 256, max_model_len: int | None = None) -> list[dict]:
    """Per codec (or per-layer mix): resolved spec, bytes per token (all layers, codes + scales +
    zeros), tokens in the budget. A windowed codec (KIVI) first sets aside its requests'
    full-precision windows, as the engine does (planned for max_model_len; None: the model's
    max_position_embeddings), at a block size that is a multiple of its group."""
    plan_len = max_model_len or int(getattr(config, "max_position_embeddings", 0))
    rows = []
    for spec in codecs:
        block, block_bytes, window = mix_geometry(config, spec, block_size)
        plan_bytes = -(-plan_len // block) * block_bytes
        seqs = window_slots(budget_bytes, window, max_num_seqs, plan_bytes) if window else max_num_seqs
        rows.append({"kv_cache_dtype": mix_text(layer_specs(spec, config.num_layers)),
                     "bytes_per_token": block_bytes / block,
                     "capacity_tokens": (budget_bytes - (seqs * window if window else 0)) // block_bytes * block,
                     "window_bytes_per_seq": window, "max_num_seqs": seqs})
    return rows
