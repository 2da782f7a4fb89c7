"""From per-tensor checkpoint weights (HF names) to the fused state dict `CausalLM` loads.

Both loaders (safetensors and GGUF) expose their tensors under Hugging Face
names through a `TensorSource`; this file is the one place that knows the
fused layout:

    qkv_proj.weight  = [q_proj; k_proj; v_proj]      rows: q_size | kv_size | kv_size
    gate_up_proj     = [gate_proj; up_proj]          rows: intermediate | intermediate
    qk_norm_weight   = [q_norm × num_heads; k_norm × num_kv_heads]   (qwen3)
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from threefold.errors import ThreefoldError
from threefold.model.config import ModelArchConfig


class TensorSource(Protocol):
    """Checkpoint tensors by HF name, converted to the requested dtype on read."""

    def has(self, name: str) -> bool: ...

    def get(self, name: str, dtype: torch.dtype) -> Tensor: ...


def _fused(source: TensorSource, names: list[str], dtype: torch.dtype) -> Tensor:
    """Concatenate along rows into one preallocated tensor (no intermediate list of copies)."""
    parts = [source.get(name, dtype) for name in names]
    out = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=dtype)
    row = 0
    for part in parts:
        out[row : row + part.shape[0]].copy_(part)
        row += part.shape[0]
    return out


def _require(source: TensorSource, name: str) -> None:
    if not source.has(name):
        raise ThreefoldError(f"checkpoint is missing tensor {name!r}", param="model")


def _layer_state(source: TensorSource, config: ModelArchConfig, i: int) -> dict[str, Tensor]:
    dtype = config.dtype
    src, dst = f"model.layers.{i}.", f"layers.{i}."
    attn = src + "self_attn."
    proj_names = [f"{attn}{p}_proj.weight" for p in "qkv"]
    for name in proj_names:
        _require(source, name)
    state = {
        dst + "input_layernorm.weight": source.get(src + "input_layernorm.weight", dtype),
        dst + "post_attention_layernorm.weight": source.get(src + "post_attention_layernorm.weight", dtype),
        dst + "self_attn.qkv_proj.weight": _fused(source, proj_names, dtype),
        dst + "self_attn.o_proj.weight": source.get(attn + "o_proj.weight", dtype),
        dst + "mlp.gate_up_proj.weight": _fused(
            source, [src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"], dtype
        ),
        dst + "mlp.down_proj.weight": source.get(src + "mlp.down_proj.weight", dtype),
    }
    if config.attention_bias:
        state[dst + "self_attn.qkv_proj.bias"] = _fused(source, [f"{attn}{p}_proj.bias" for p in "qkv"], dtype)
    if config.qk_norm:
        q_norm = source.get(attn + "q_norm.weight", dtype)  # [head_dim]
        k_norm = source.get(attn + "k_norm.weight", dtype)
        state[dst + "self_attn.qk_norm_weight"] = torch.cat(
            [q_norm.expand(config.num_heads, -1), k_norm.expand(config.num_kv_heads, -1)]
        )
    return state


def fused_state_dict(source: TensorSource, config: ModelArchConfig) -> dict[str, Tensor]:
    """The full state dict for `CausalLM`; `lm_head.weight` is absent when embeddings are tied."""
    dtype = config.dtype
    state = {
        "embed_tokens.weight": source.get("model.embed_tokens.weight", dtype),
        "norm.weight": source.get("model.norm.weight", dtype),
    }
    for i in range(config.num_layers):
        state.update(_layer_state(source, config, i))
    if not config.tie_word_embeddings:
        _require(source, "lm_head.weight")
        state["lm_head.weight"] = source.get("lm_head.weight", dtype)
    return state
