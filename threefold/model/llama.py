"""The Llama-family forward (Llama, Mistral, Qwen2, Qwen3) over a flattened token batch.

The model knows nothing about requests or the KV cache: every layer hands its
RoPE'd q, k and v to an `AttentionFn` the caller supplies, which owns the
cache, causality and the softmax scale. Weights arrive fused at load time
(q/k/v into one `qkv_proj`, gate/up into one `gate_up_proj`) so a layer is
four matmuls.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from threefold.errors import ThreefoldError
from threefold.kernels import few_rows_max, has_few_row_linear, has_int8_linear
from threefold.model.config import ModelArchConfig

AttentionFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]
"""attention(layer_idx, q [T, num_heads, head_dim], k [T, num_kv_heads, head_dim],
v [T, num_kv_heads, head_dim]) -> [T, num_heads, head_dim].

q and k are RoPE'd (and q/k-normed for qwen3). q, k and v may be strided
views into one buffer, not contiguous: use .reshape or .contiguous, not .view.

An AttentionFn may also carry `decode_step` (a `DecodeStep` or `KiviDecodeStep`, or None): where
every row of the step decodes over a dense paged cache (or a KIVI one), the model then runs all its
layers in one native call (kernels/decode_layers.cpp) instead of calling it layer by layer.
"""


@dataclass
class DecodeStep:
    """What kernels.decode_layers needs of a step's attention: the per-layer dense caches
    [num_blocks, block_size, num_kv_heads, head_dim], where each token's K/V goes, and the
    decode groups as paged_decode_attention takes them (empty tensors: no tree mask)."""

    k_caches: list[Tensor]
    v_caches: list[Tensor]
    slot_mapping: Tensor
    group_starts: list[int]
    group_tables: list[Tensor]
    group_lens: list[Tensor]
    group_tree_starts: list[Tensor]
    group_tree_bits: list[Tensor]
    scale: float
    window: int


@dataclass
class KiviDecodeStep:
    """What kernels.decode_layers_kivi needs of a decode-only step over a KIVI cache (kivi2 or kivi4 in
    every layer; worker/kivi_attention.py builds it): per layer the packed blocks (k codes, v codes, k
    scales, k zeros, v scales, v zeros: 6 tensors a layer, flat) and the windows' ring; kivi_attention's
    block tables and meta [4, rows]; the rows whose token completes a block, and that block's id."""

    blocks: list[Tensor]
    rings: list[Tensor]
    block_tables: Tensor
    meta: Tensor
    encode_rows: Tensor
    encode_blocks: Tensor
    scale: float


class Linear(nn.Linear):
    """nn.Linear whose bf16 CPU weight can be prepacked once for oneDNN, and whose few-row
    calls can stream a weight of their own through threefold.kernels.

    F.linear in bf16 reorders the weight into oneDNN's blocked layout on every
    call; `pack` does it once at load (what inductor's freezing pass does), and
    the packed call computes the same values (checked bit-exact in the tests)
    1.3-1.5x faster at every batch size on the 2-core Xeon (microbenchmark with
    SmolLM2's 30 layers of weights, cold). fp32 weights are packed too: F.linear
    in fp32 is MKL, which on the AMD EPYC (AVX-512 and AVX2 classes) ran SmolLM2's
    linears 2-3x slower than oneDNN's packed fp32 GEMM at 16-48 rows (BENCHMARKS.md).

    With `kernels` set, a call of at most `few_rows_max(kernels)` rows (small decode batches)
    takes threefold.kernels' linear_small over `stream_weight` instead: a plain
    prefetched stream over the row-major weight, 1.4x oneDNN's GEMV at one row
    (SmolLM2's 30 layers, cold); oneDNN/MKL win from a few rows up, where each
    weight is reused. `stream_weight` is the plain weight, or, with bf16 weights
    and fp32 compute (`store_bf16`), a bf16 copy holding the very values of the
    fp32 weight, which the kernel widens in registers at half the bytes.
    """

    packed: Tensor | None = None
    stream_weight: Tensor | None = None
    stream_scale: Tensor | None = None
    """Per-row fp32 scales of an int8 `stream_weight` (`store_int8`); None for a float stream."""
    kernels: ModuleType | None = None
    max_rows: int = 0
    """Calls of at most this many rows take the few-row kernel."""

    def pack(self) -> bool:
        """Prepack a bf16 or fp32 CPU weight; False (nothing changes) where oneDNN can't take it."""
        weight = self.weight
        if (weight.dtype not in (torch.bfloat16, torch.float32) or weight.device.type != "cpu"
                or not torch.backends.mkldnn.is_available()):
            return False
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        except (RuntimeError, AttributeError):  # a torch build without the oneDNN linear ops
            return False
        return True

    def store_bf16(self) -> None:
        """Round the fp32 weight to bf16 in place and keep that bf16 form to stream: the
        few-row kernel (bf16) and F.linear (fp32) then multiply identical values."""
        if self.stream_weight is None:  # a tied weight is rounded once
            self.stream_weight = self.weight.data.to(torch.bfloat16)
            self.weight.data.copy_(self.stream_weight)

    def store_int8(self) -> None:
        """Keep an int8 copy of the weight for the few-row kernel to stream (weight-only, symmetric,
        one fp32 scale per output row: w ~ scale[n] q[n, k], |error| <= scale / 2): a quarter of
        fp32's bytes, half of bf16's. Lossy, so for a draft model (whose drafts the target checks),
        not the target; calls of more rows keep the packed (or plain) weight."""
        if self.stream_scale is not None:  # a tied weight is quantized once
            return
        source = self.weight if self.weight.device.type != "meta" else self.stream_weight
        assert source is not None and source.device.type != "meta", "store_int8 needs the plain weight"
        weight = source.detach().float()
        scale = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        self.stream_weight = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.stream_scale = scale

    def use_kernels(self, kernels: ModuleType | None, compute: torch.dtype) -> None:
        """Take the few-row kernel where it runs for this compute dtype, streaming the plain weight
        (or the bf16 copy `store_bf16` kept, or the int8 one `store_int8` kept); None: never."""
        if self.stream_weight is None and self.weight.device.type != "meta":
            self.stream_weight = self.weight.detach()  # a plain view: no second Parameter
        stream = self.stream_weight
        if self.stream_scale is not None:
            runs = has_int8_linear(kernels)
            self.kernels = kernels if runs else None
            self.max_rows = few_rows_max(kernels) if runs else 0
            return
        runs = stream is not None and has_few_row_linear(kernels, compute, stream.dtype)
        self.kernels = kernels if runs else None
        self.max_rows = few_rows_max(kernels) if runs else 0

    def rows(self, ids: Tensor) -> Linear:
        """A Linear computing only these output rows of this one (a draft vocabulary's slice of an
        LM head), set up as this one is: prepacked for oneDNN, and streamed by the few-row kernel
        (in the same storage dtype) where this one is. Needs the plain weight, or its bf16 stream."""
        source = self.weight if self.weight.device.type != "meta" else self.stream_weight
        if source is None or source.device.type == "meta":
            raise ThreefoldError("this Linear keeps only its packed weight; its rows cannot be taken.")
        if source is self.stream_weight and self.stream_scale is not None:  # int8 codes: their values
            source = source.float() * self.stream_scale[:, None]
        ids = ids.to(source.device)
        sliced = Linear(self.in_features, len(ids), bias=self.bias is not None, device="meta")
        sliced.weight = nn.Parameter(source.index_select(0, ids).to(self.weight.dtype), requires_grad=False)
        if self.bias is not None:
            sliced.bias = nn.Parameter(self.bias.detach().index_select(0, ids), requires_grad=False)
        if self.packed is not None:
            sliced.pack()
        if self.kernels is not None and self.stream_weight is not None:
            stream = self.stream_weight
            sliced.stream_weight = sliced.weight.detach() if stream.dtype == sliced.weight.dtype \
                else stream.index_select(0, ids)
            if self.stream_scale is not None:
                sliced.stream_scale = self.stream_scale.index_select(0, ids)
            sliced.kernels, sliced.max_rows = self.kernels, self.max_rows
        return sliced

    def forward(self, x: Tensor) -> Tensor:
        if self.kernels is not None and x.dim() == 2 and x.shape[0] <= self.max_rows:
            out = x.new_empty(x.shape[0], self.out_features)
            if (self.kernels.linear_small(out, x, self.stream_weight, self.bias) if self.stream_scale is None
                    else self.kernels.linear_small_int8(out, x, self.stream_weight, self.stream_scale, self.bias)):
                return out
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


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


@dataclass
class Rotary:
    """One step's RoPE: rotates [T, heads, head_dim] at `positions` [T].

    With `kernels` (threefold.kernels on CPU) the rotation is one native pass in
    place; otherwise `apply_rope` over cos/sin rows gathered once per step.
    """

    positions: Tensor
    cos_table: Tensor
    sin_table: Tensor
    kernels: ModuleType | None = None

    def __post_init__(self) -> None:
        if self.kernels is None:
            self.cos = self.cos_table[self.positions].unsqueeze(1)  # [T, 1, head_dim / 2]
            self.sin = self.sin_table[self.positions].unsqueeze(1)

    def __call__(self, x: Tensor) -> Tensor:
        """Returns the rotated x: x itself (rotated in place) on the kernel path."""
        if self.kernels is not None:
            self.kernels.rotary_embedding(x, self.positions, self.cos_table, self.sin_table)
            return x
        return apply_rope(x, self.cos, self.sin)


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
            self.qk_norm_weight: nn.Parameter | None = nn.Parameter(
                torch.empty(config.num_heads + config.num_kv_heads, config.head_dim))
        else:
            self.qk_norm_weight = None

    def forward(self, hidden: Tensor, rotary: Rotary, attention: AttentionFn) -> Tensor:
        num_tokens = hidden.shape[0]
        num_qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(hidden)  # [T, (num_heads + 2 * num_kv_heads) * head_dim]
        qk = qkv[:, : num_qk_heads * self.head_dim].view(num_tokens, num_qk_heads, self.head_dim)
        v = qkv[:, num_qk_heads * self.head_dim :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm_weight is not None:
            # Norm first, then scale by the weight in the compute dtype: HF's order.
            qk = F.rms_norm(qk, (self.head_dim,), eps=self.eps) * self.qk_norm_weight
        qk = rotary(qk)  # [T, num_heads + num_kv_heads, head_dim]
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = attention(self.layer_idx, q, k, v)  # [T, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    kernels: ModuleType | None = None
    """threefold.kernels: silu(gate) * up in one native pass; None: torch."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(hidden)  # [T, 2 * intermediate]
        if self.kernels is not None:
            act = torch.empty(gate_up.shape[0], self.intermediate_size, dtype=gate_up.dtype, device=gate_up.device)
            self.kernels.silu_and_mul(act, gate_up)
            return self.down_proj(act)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class RMSNorm(nn.Module):
    """RMSNorm, optionally fused with the residual add before it (vLLM's fused_add_rms_norm).

    norm(x) -> normed;  norm(x, residual) -> (norm(x + residual), x + residual).
    With `kernels` set (threefold.kernels on CPU) both run as one native pass
    that writes in place into x and residual; the torch path computes the same.
    """

    kernels: ModuleType | None = None

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    @overload
    def forward(self, x: Tensor, residual: None = None) -> Tensor: ...

    @overload
    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]: ...

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if self.kernels is not None and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16):
            if residual is None:
                x = x.clone()
                self.kernels.add_rms_norm(x, x, self.weight, self.eps, False)
                return x
            self.kernels.add_rms_norm(x, residual, self.weight, self.eps, True)
            return x, residual
        if residual is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        residual = x + residual
        return F.rms_norm(residual, self.weight.shape, self.weight, self.eps), residual


def use_kernels_in(module: nn.Module, kernels: ModuleType | None, compute: torch.dtype) -> None:
    """Route every RMSNorm, MLP and Linear under `module` (a model, or draft heads built of its
    layer classes) through threefold.kernels' native passes where they run for `compute`
    (None: the torch ops)."""
    for sub in module.modules():
        if isinstance(sub, (RMSNorm, MLP)):
            sub.kernels = kernels
        elif isinstance(sub, Linear):
            sub.use_kernels(kernels, compute)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, hidden: Tensor, residual: Tensor | None, rotary: Rotary,
                attention: AttentionFn) -> tuple[Tensor, Tensor]:
        """(hidden, residual) -> (this layer's MLP output, the residual stream before it);
        the caller's next norm adds the two (first layer: residual None, hidden the embeddings)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, attention)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


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
        self.kernels: ModuleType | None = None
        self.rope_cos: Tensor | None = None
        self.rope_sin: Tensor | None = None
        self.native_decode = True
        """Run decode-only steps through kernels.decode_layers where they can (False: always
        the Python loop; the two give identical results, this is for measuring)."""
        self._layer_weights: tuple[list[Tensor | None], list[int]] | None = None

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head (tie_word_embeddings)."""
        self.lm_head.weight = self.embed_tokens.weight

    def store_bf16(self) -> None:
        """bf16 weight storage with fp32 compute (dtype="bf16-weights"): every Linear's fp32
        weight is rounded to bf16 and its bf16 form kept for the few-row kernel to stream.
        The tied embedding is the LM head's weight, so it holds the rounded values too."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.store_bf16()

    def store_int8(self) -> None:
        """int8 few-row streams for every Linear (`Linear.store_int8`): a draft model's weights."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.store_int8()

    def pack_weights(self, keep_plain: bool = False) -> None:
        """Prepack every bf16 Linear for oneDNN (see `Linear`). Unless keep_plain (the
        few-row kernel reads the plain form), a packed matrix no longer needed in its plain
        form (anything but the tied LM head) moves to the meta device, so the weights are
        not held twice."""
        for module in self.modules():
            if (isinstance(module, Linear) and module.pack() and not keep_plain
                    and module.weight is not self.embed_tokens.weight):
                module.weight = nn.Parameter(torch.empty_like(module.weight, device="meta"), requires_grad=False)

    def use_kernels(self, kernels: ModuleType | None) -> None:
        """Run RoPE, the fused add + RMSNorms, silu-and-mul and few-row linears through
        threefold.kernels' native passes (None: the torch ops, which compute the same up
        to rounding)."""
        self.kernels = kernels
        use_kernels_in(self, kernels, self.config.dtype)
        self._layer_weights = self._native_layer_weights()

    @property
    def runs_decode_steps(self) -> bool:
        """Whether a `decode_step` (DecodeStep / KiviDecodeStep) on the attention runs every layer in
        one native call; else forward takes the Python loop through the attention function."""
        return self._layer_weights is not None and self.native_decode

    def _native_layer_weights(self) -> tuple[list[Tensor | None], list[int]] | None:
        """kernels.decode_layers' weights and few-row limits, in its order (see that file), or None
        where it cannot run this model: no kernels, q/k-norm layers, a dtype the norm kernel lacks."""
        kernels = self.kernels
        if (kernels is None or not hasattr(kernels, "decode_layers") or self.config.qk_norm
                or self.config.dtype not in (torch.float32, torch.bfloat16)):
            return None
        weights: list[Tensor | None] = []
        max_rows: list[int] = []
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            weights += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            linears: tuple[Linear, ...] = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                           layer.mlp.down_proj)
            for linear in linears:
                streams = linear.kernels is not None
                weights += [linear.stream_weight if streams else None, linear.stream_scale if streams else None,
                            linear.packed, linear.weight, linear.bias]
                max_rows.append(linear.max_rows)
        return weights, max_rows

    def init_rope(self, max_len: int) -> None:
        """Precompute cos/sin for positions [0, max_len) on the weights' device."""
        device = self.embed_tokens.weight.device
        self.rope_cos, self.rope_sin = rope_tables(self.config, max_len, device)

    def forward(self, input_ids: Tensor, positions: Tensor, attention: AttentionFn) -> Tensor:
        """input_ids, positions: [T] long, a flattened batch. Returns hidden [T, hidden] after the final norm."""
        assert self.rope_cos is not None and self.rope_sin is not None, "call init_rope(max_len) after loading weights"
        step: DecodeStep | KiviDecodeStep | None = getattr(attention, "decode_step", None)
        if step is not None and self.runs_decode_steps:
            assert self.kernels is not None and self._layer_weights is not None
            config = self.config
            if isinstance(step, KiviDecodeStep):
                return self.kernels.decode_layers_kivi(
                    self.embed_tokens(input_ids), positions, self.rope_cos, self.rope_sin, *self._layer_weights,
                    self.norm.weight, config.rms_norm_eps, step.blocks, step.rings, step.block_tables, step.meta,
                    step.encode_rows, step.encode_blocks, config.num_heads, config.num_kv_heads, step.scale)
            return self.kernels.decode_layers(
                self.embed_tokens(input_ids), positions, self.rope_cos, self.rope_sin, *self._layer_weights,
                self.norm.weight, config.rms_norm_eps, step.k_caches, step.v_caches, step.slot_mapping,
                step.group_starts, step.group_tables, step.group_lens, step.group_tree_starts, step.group_tree_bits,
                config.num_heads, config.num_kv_heads, step.scale, step.window)
        rotary = Rotary(positions, self.rope_cos, self.rope_sin, self.kernels)
        hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rotary, attention)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: Tensor, float32: bool = True) -> Tensor:
        """[N, hidden] -> [N, vocab] (matmul in the weight dtype, as HF does), upcast to float32
        unless float32=False: the sampler upcasts only where it edits or normalizes them."""
        logits = self.lm_head(hidden)
        return logits.float() if float32 else logits
