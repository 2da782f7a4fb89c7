"""The Llama-family forward (Llama, Mistral, Qwen2, Qwen3) over a flattened token batch.

The model knows nothing about requests or the KV cache: every layer hands its
RoPE'd q, k and v to an `AttentionFn` the caller supplies, which owns the
cache, causality and the softmax scale. Weights arrive fused at load time
(q/k/v into one `qkv_proj`, gate/up into one `gate_up_proj`) so a layer is
four matmuls.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from threefold.model.config import ModelArchConfig

AttentionFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]
"""attention(layer_idx, q [T, num_heads, head_dim], k [T, num_kv_heads, head_dim],
v [T, num_kv_heads, head_dim]) -> [T, num_heads, head_dim].

q and k are RoPE'd (and q/k-normed for qwen3). q, k and v may be strided
views into one buffer, not contiguous: use .reshape or .contiguous, not .view.
"""


class Linear(nn.Linear):
    """nn.Linear with a matrix-vector path for one bf16 token (batch-1 decode).

    On CPU, torch.mv streams bf16 weights ~1.5x faster than F.linear's GEMM
    path at M = 1 (measured in benchmarks/decode.py's setting); fp32 keeps
    F.linear so results stay bit-identical across batch sizes.
    """

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[0] != 1 or x.dtype != torch.bfloat16:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mv(self.weight, x[0]).unsqueeze(0)
        return torch.addmv(self.bias, self.weight, x[0]).unsqueeze(0)


def rope_inv_freq(config: ModelArchConfig) -> Tensor:
    """Inverse frequencies [head_dim / 2], float32, with llama3 scaling applied.

    llama3: transformers' `_compute_llama3_parameters` (Llama 3.1 paper, sec. 3):
    long wavelengths are slowed by `factor`, short ones kept, the band between
    interpolated smoothly.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", "default") != "llama3":
        return inv_freq
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(config: ModelArchConfig, max_len: int, device: torch.device | str) -> tuple[Tensor, Tensor]:
    """cos and sin [max_len, head_dim / 2] in the compute dtype, computed in float32 as HF does."""
    inv_freq = rope_inv_freq(config)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [max_len, head_dim / 2]
    return freqs.cos().to(device, config.dtype), freqs.sin().to(device, config.dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's rotate_half convention: the two halves of each head are the (re, im) pairs.

    x: [T, heads, head_dim]; cos, sin: [T, 1, head_dim / 2]. Returns a new contiguous tensor.
    """
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1)
    o1.sub_(x2 * sin)  # x1·cos − x2·sin
    torch.mul(x2, cos, out=o2)
    o2.add_(x1 * sin)  # x2·cos + x1·sin
    return out


class Attention(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        qkv_size = config.q_size + 2 * config.kv_size
        self.qkv_proj = Linear(config.hidden_size, qkv_size, bias=config.attention_bias)
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            # qwen3: one [head_dim] weight for q and one for k; stored expanded to
            # [num_heads + num_kv_heads, head_dim] so q and k are normed in one op.
            self.qk_norm_weight = nn.Parameter(torch.empty(config.num_heads + config.num_kv_heads, config.head_dim))
        else:
            self.qk_norm_weight = None

    def forward(self, hidden: Tensor, cos: Tensor, sin: Tensor, attention: AttentionFn) -> Tensor:
        num_tokens = hidden.shape[0]
        num_qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(hidden)  # [T, (num_heads + 2 * num_kv_heads) * head_dim]
        qk = qkv[:, : num_qk_heads * self.head_dim].view(num_tokens, num_qk_heads, self.head_dim)
        v = qkv[:, num_qk_heads * self.head_dim :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm_weight is not None:
            # Norm first, then scale by the weight in the compute dtype: HF's order.
            qk = F.rms_norm(qk, (self.head_dim,), eps=self.eps) * self.qk_norm_weight
        qk = apply_rope(qk, cos, sin)  # [T, num_heads + num_kv_heads, head_dim]
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = attention(self.layer_idx, q, k, v)  # [T, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(hidden)  # [T, 2 * intermediate]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, hidden: Tensor, cos: Tensor, sin: Tensor, attention: AttentionFn) -> Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, attention)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class CausalLM(nn.Module):
    """Embedding → layers → final norm; `compute_logits` applies the LM head.

    Build it on the meta device and load weights with `load_state_dict(assign=True)`
    (see `threefold.model.loader`), then call `init_rope` to build the cos/sin tables.
    """

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope_cos: Tensor | None = None
        self.rope_sin: Tensor | None = None

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head (tie_word_embeddings)."""
        self.lm_head.weight = self.embed_tokens.weight

    def init_rope(self, max_len: int) -> None:
        """Precompute cos/sin for positions [0, max_len) on the weights' device."""
        device = self.embed_tokens.weight.device
        self.rope_cos, self.rope_sin = rope_tables(self.config, max_len, device)

    def forward(self, input_ids: Tensor, positions: Tensor, attention: AttentionFn) -> Tensor:
        """input_ids, positions: [T] long, a flattened batch. Returns hidden [T, hidden] after the final norm."""
        assert self.rope_cos is not None, "call init_rope(max_len) after loading weights"
        cos = self.rope_cos[positions].unsqueeze(1)  # [T, 1, head_dim / 2]
        sin = self.rope_sin[positions].unsqueeze(1)
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, attention)
        return self.norm(hidden)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, hidden] -> [N, vocab] float32 (matmul in the weight dtype, as HF does)."""
        return self.lm_head(hidden).float()
