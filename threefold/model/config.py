"""The architecture of a loaded model, independent of the file format it came from."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from threefold.errors import ThreefoldError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str
    """Family of the forward: one of SUPPORTED_ARCHITECTURES."""
    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the gated MLP (each of gate and up)."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA: num_heads is a multiple of it)."""
    head_dim: int
    """Width of one head (qwen3 decouples it from hidden_size / num_heads)."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    rope_theta: float
    """RoPE base frequency."""
    rope_scaling: dict | None = field(hash=False)
    """None, or a dict with rope_type "llama3" and its factor, low/high_freq_factor,
    original_max_position_embeddings (transformers' names)."""
    max_position_embeddings: int
    """Longest context the model was trained for."""
    tie_word_embeddings: bool
    """The LM head shares the embedding matrix."""
    attention_bias: bool
    """q/k/v projections carry a bias (qwen2)."""
    qk_norm: bool
    """Per-head RMSNorm on q and k before RoPE (qwen3)."""
    dtype: torch.dtype
    """Weight and compute dtype; logits are always float32."""
    sliding_window: int | None = None
    """Mistral's attention window in tokens, None for full attention. The attention
    backend must honour it for contexts longer than the window."""
    bos_token_id: int | None = None
    """From the checkpoint config, informational (the tokenizer decides what to add)."""
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    """Checkpoint metadata kept for display (e.g. the GGUF general.name)."""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ThreefoldError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
                param="model",
            )
        if self.num_heads % self.num_kv_heads:
            raise ThreefoldError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}", param="model"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ThreefoldError(
                f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}",
                param="model",
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
