"""The native attention kernels over the layout of any codec without a window (threefold/kernels: the
dense paged_decode_attention, kv_attention.cpp's kv_decode_attention for int8 / fp8 / int4, and
tq_attention.cpp's tq_decode_attention for turboquant, its packed blocks read in place).
A codec without a kernel gives its reference read instead, attended in plain torch
(`_reference_decode`, which turboquant's tests compare its kernel against).
Windowed codecs (kivi2/kivi4, tiered, GEAR, turboquant with a residual) attend through
worker/kivi_attention.py instead: kivi_attention / kivi_prefill_attention / gear_attention /
tq_window_attention read their blocks in place."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from threefold.kv.codec import KVLayout

_KINDS = {"int8": 0, "fp8": 1, "int4": 2}
_EMPTY = torch.empty(0)
_EMPTY_LONG = torch.empty(0, dtype=torch.long)


def tree_visible(tree_starts: torch.Tensor, tree_bits: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[B, num_keys] bool: the keys a candidate-tree mask leaves each row (every key before its
    tree_starts; from there on, those whose bit is set)."""
    j = torch.arange(num_keys, device=tree_starts.device)[None, :] - tree_starts[:, None]  # [B, L]
    index = j.clamp(0, 64 * tree_bits.shape[1] - 1)
    words = tree_bits.gather(1, index // 64)
    return (j < 0) | ((words >> (index % 64)) & 1).bool()


def decode_attention(kernels: ModuleType, out: torch.Tensor, q: torch.Tensor, layout: KVLayout,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int,
                     tree_starts: torch.Tensor | None = None, tree_bits: torch.Tensor | None = None) -> None:
    """out, q [B, H, d]; row b attends over its seq_lens[b] keys through block_table[b], in place.
    Candidate-tree rows also pass tree_starts [B] and tree_bits [B, words] int64: row b sees key
    tree_starts[b] + j (and later) only where bit j of its words is set (worker/tree_verify.tree_bits)."""
    starts = _EMPTY_LONG if tree_starts is None else tree_starts
    bits = _EMPTY_LONG if tree_bits is None else tree_bits
    if layout.kind == "turboquant":
        kernels.tq_decode_attention(out, q, layout.k, layout.v, *layout.aux, block_table, seq_lens, scale, window,
                                    starts, bits)
        return
    if layout.read is not None:
        _reference_decode(out, q, layout.read, block_table, seq_lens, scale, window, tree_starts, tree_bits)
        return
    if layout.kind == "dense":
        kernels.paged_decode_attention(out, q, layout.k, layout.v, block_table, seq_lens, scale, window, starts, bits)
        return
    kernels.kv_decode_attention(out, q, layout.k, layout.v, layout.k_scales, layout.v_scales,
                                _EMPTY if layout.k_zeros is None else layout.k_zeros,
                                _EMPTY if layout.v_zeros is None else layout.v_zeros,
                                _EMPTY if layout.lut is None else layout.lut,
                                block_table, seq_lens, scale, window, _KINDS[layout.kind], starts, bits)


def _reference_decode(out: torch.Tensor, q: torch.Tensor, read, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float, window: int, tree_starts: torch.Tensor | None = None,
                      tree_bits: torch.Tensor | None = None) -> None:
    """decode_attention through a codec's dense read. Rows sharing a block table (the rows of a
    prefill chunk read in place) read it once."""
    tables, row_table = torch.unique(block_table, dim=0, return_inverse=True)
    keys, values = read(tables)  # [U, kvh, L, d]
    positions = torch.arange(keys.shape[2], device=q.device)
    visible = positions.unsqueeze(0) < seq_lens.unsqueeze(1)  # [B, L]
    if window:
        visible &= positions.unsqueeze(0) >= (seq_lens - window).unsqueeze(1)
    if tree_starts is not None and tree_bits is not None:
        visible &= tree_visible(tree_starts, tree_bits, keys.shape[2])
    for u in range(len(tables)):
        rows = (row_table == u).nonzero().squeeze(1)
        # each row is its own query of length 1: [1, H, rows, d] over the table's keys, masked per row
        attn = F.scaled_dot_product_attention(q[rows].transpose(0, 1).unsqueeze(0), keys[u:u + 1], values[u:u + 1],
                                              attn_mask=visible[rows].unsqueeze(0).unsqueeze(0), scale=scale,
                                              enable_gqa=True)
        out[rows] = attn[0].transpose(0, 1).to(out.dtype)
