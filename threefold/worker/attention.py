"""Paged attention in plain PyTorch: the reference backend (CPU and any torch device).

The step's flattened tokens are ordered decodes first, then prefill chunks:

    tokens  [d0 d1 d2 | p0 p0 p0 p0 | p1 p1 p1]
             one each   request A     request B (a chunk resuming at pos 40)

Every layer first writes the step's K/V into the cache, then attends, so a
request may read blocks another request fills in this very step (prefix
hits published at allocation rely on this). Each prefill chunk is one SDPA call
with a causal mask offset by its already-computed context; over a compressed
cache with the native kernel, a chunk with context instead runs as query_len
decode rows over the cache (row i sees context + i + 1 keys): no dense copy
of the context is built. Decodes take one of
two paths that compute the same thing:

    native kernel   paged_decode_attention (dense) or kv_decode_attention (int8,
                    fp8, int4: dequantized row by row in registers) reads K/V in
                    place through the block tables: one group, no copies, no padding
    plain torch     decodes bucketed by context length, one SDPA call per bucket
                    over blocks gathered with index_select and an additive mask
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.nn.functional as F

from threefold.kv.native import decode_attention
from threefold.kv.paged import PagedKVCache
from threefold.model.llama import DecodeStep
from threefold.worker.tree_verify import TreeGroup

_EMPTY_LONG = torch.empty(0, dtype=torch.long)
IN_PLACE_CHUNK = 16
"""A chunk with context of at most this many tokens runs as decode rows over a dense cache too: the
gather, mask and SDPA call of the torch path cost a few decodes' worth per layer (an offline prompt
taken a few tokens a step beside online decodes paid that every step)."""


@dataclass
class PrefillChunk:
    query_start: int
    query_len: int
    context_len: int
    """Tokens before this chunk that are already in the cache."""
    block_table: torch.Tensor
    """[1, num_blocks] blocks covering context + chunk."""


@dataclass
class DecodeGroup:
    """Decodes of similar context length, attended in one call."""

    query_start: int
    num_seqs: int
    block_table: torch.Tensor
    """[num_seqs, max_blocks] int64, padded with the null block."""
    seq_lens: torch.Tensor
    """[num_seqs] int64: keys each query sees (its context plus itself)."""
    mask: torch.Tensor | None
    """Torch path only: [num_seqs, 1, 1, max_blocks * block_size] additive, 0 where a key
    exists (and is inside the sliding window), -inf elsewhere."""
    tree_starts: torch.Tensor | None = None
    """Native path, candidate-tree rows (worker/tree_verify.py): [num_seqs] int64, each row's first tree key."""
    tree_bits: torch.Tensor | None = None
    """[num_seqs, words] int64: of the tree keys, those each row sees (itself and its ancestors)."""


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[num_tokens] cache slot of every token of the step."""
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    sliding_window: int | None = None
    """Mistral-style: a token sees only the `sliding_window` most recent positions (itself included)."""
    tree_groups: list[TreeGroup] = field(default_factory=list)
    """Speculative candidate trees on the torch path, one masked call each (worker/tree_verify.py);
    with the native kernel they are a decode group with an ancestor mask instead."""


class PagedAttention:
    """The AttentionFn the model calls, bound to one step's metadata."""

    def __init__(self, cache: PagedKVCache, meta: AttentionMetadata, scale: float, dtype: torch.dtype,
                 kernels: ModuleType | None = None) -> None:
        self.cache = cache
        self.meta = meta
        self.scale = scale
        self.kernels = kernels
        self.decode_masks = [None if group.mask is None else group.mask.to(dtype) for group in meta.decode_groups]
        self.decode_step = self._decode_step(dtype) if kernels is not None else None
        """Where every row of the step decodes over uncompressed caches: the model runs its layers
        in one native call (model.llama.DecodeStep), which computes exactly what this object does."""

    def _decode_step(self, dtype: torch.dtype) -> DecodeStep | None:
        meta, dense = self.meta, self.cache.dense_kv
        if meta.prefills or meta.tree_groups or not meta.decode_groups or dense is None or dense[0][0].dtype != dtype:
            return None
        groups = meta.decode_groups
        return DecodeStep(dense[0], dense[1], meta.slot_mapping, [g.query_start for g in groups],
                          [g.block_table for g in groups], [g.seq_lens for g in groups],
                          [_EMPTY_LONG if g.tree_starts is None else g.tree_starts for g in groups],
                          [_EMPTY_LONG if g.tree_bits is None else g.tree_bits for g in groups],
                          self.scale, meta.sliding_window or 0)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]
        meta = self.meta
        self.cache.write(layer_idx, meta.slot_mapping, k, v)
        out = torch.empty_like(q)
        for group, mask in zip(meta.decode_groups, self.decode_masks, strict=True):
            span = slice(group.query_start, group.query_start + group.num_seqs)
            self._decode(layer_idx, q[span], group, mask, out[span])
        for chunk in meta.prefills:
            span = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[span] = self._prefill(layer_idx, chunk, q[span], k[span], v[span])
        for tree in meta.tree_groups:
            span = slice(tree.query_start, tree.query_start + tree.num_rows)
            keys, values = self.cache.read(layer_idx, tree.block_table)  # [1, kvh, L, d]
            attn = F.scaled_dot_product_attention(q[span].transpose(0, 1).unsqueeze(0), keys, values,
                                                  attn_mask=tree.mask, scale=self.scale, enable_gqa=True)
            out[span] = attn[0].transpose(0, 1)
        return out

    def _decode(self, layer_idx: int, q: torch.Tensor, group: DecodeGroup,
                mask: torch.Tensor | None, out: torch.Tensor) -> None:
        """Attention for one decode group, written into `out` (a view of the step's output)."""
        if self.kernels is not None:
            decode_attention(self.kernels, out, q, self.cache.layout(layer_idx), group.block_table,
                             group.seq_lens, self.scale, self.meta.sliding_window or 0, group.tree_starts,
                             group.tree_bits)
            return
        assert mask is not None, "the torch decode path needs the group's mask"
        keys, values = self.cache.read(layer_idx, group.block_table)  # [B, kvh, L, d] views
        # SDPA reads the strided views directly and does GQA itself: ~2x faster on CPU
        # than explicit matmul + softmax over copies (measured).
        attn = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values,
                                              attn_mask=mask,
                                              scale=self.scale, enable_gqa=True)  # [B, H, 1, d]
        out.copy_(attn.squeeze(2))

    def _prefill(self, layer_idx: int, chunk: PrefillChunk, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        if chunk.context_len and self.kernels is not None and (
                chunk.query_len <= IN_PLACE_CHUNK or self.cache.layout(layer_idx).kind != "dense"):
            return self._prefill_in_place(layer_idx, chunk, q, self.kernels)
        q = q.transpose(0, 1).unsqueeze(0)  # [1, H, q_len, d]
        window = self.meta.sliding_window
        total = chunk.context_len + chunk.query_len
        if chunk.context_len == 0:
            # Nothing cached before the chunk: attend over its fresh K/V as the cache holds them
            # (a lossy codec's round trip), the values any later chunk or decode reads back.
            k, v = self.cache.codecs[layer_idx].round_trip(k, v)
            keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        else:
            keys, values = self.cache.read(layer_idx, chunk.block_table)
            keys, values = keys[:, :, :total], values[:, :, :total]
        if chunk.context_len == 0 and (window is None or total <= window):
            mask, causal = None, True  # plain causal: SDPA's fast path
        else:
            mask, causal = _offset_causal_mask(chunk.query_len, total, window, q.device), False
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal,
                                             scale=self.scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)

    def _prefill_in_place(self, layer_idx: int, chunk: PrefillChunk, q: torch.Tensor,
                          kernels: ModuleType) -> torch.Tensor:
        """A chunk over a compressed cache: q_len decode rows sharing the chunk's block table."""
        out = torch.empty_like(q)
        tables = chunk.block_table.expand(chunk.query_len, -1).contiguous()  # [q_len, nb] block ids
        seq_lens = torch.arange(chunk.context_len + 1, chunk.context_len + chunk.query_len + 1, device=q.device)
        decode_attention(kernels, out, q, self.cache.layout(layer_idx), tables, seq_lens, self.scale,
                         self.meta.sliding_window or 0)
        return out


def _offset_causal_mask(query_len: int, total_len: int, window: int | None,
                        device: torch.device) -> torch.Tensor:
    """Query i (absolute position p = total - query_len + i) sees keys j <= p (and j > p - window)."""
    rows = torch.arange(total_len - query_len, total_len, device=device).unsqueeze(1)
    keys = torch.arange(total_len, device=device).unsqueeze(0)
    visible = keys <= rows
    if window is not None:
        visible &= keys > rows - window
    return visible


class LayerDispatch:
    """A per-layer codec mix with windowed (KIVI) and windowless layers: each layer goes to the
    attention of its kind (the cache's per-layer codecs do the rest)."""

    def __init__(self, windowed, paged: PagedAttention, windowed_layers: set[int]) -> None:
        self.windowed, self.paged, self.windowed_layers = windowed, paged, windowed_layers

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        attention = self.windowed if layer_idx in self.windowed_layers else self.paged
        return attention(layer_idx, q, k, v)
