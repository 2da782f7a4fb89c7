"""The native attention kernels over any codec's layout (threefold/kernels: the dense
paged_decode_attention, and kv_attention.cpp's kv_decode_attention for int8 / fp8 / int4).
A codec without a kernel (turboquant) gives its reference read instead, attended in plain torch."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from threefold.kv.codec import KVLayout

_KINDS = {"int8": 0, "fp8": 1, "int4": 2}
_EMPTY = torch.empty(0)


def decode_attention(kernels: ModuleType, out: torch.Tensor, q: torch.Tensor, layout: KVLayout,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int) -> None:
    """out, q [B, H, d]; row b attends over its seq_lens[b] keys through block_table[b], in place."""
    if layout.read is not None:
        _reference_decode(out, q, layout.read, block_table, seq_lens, scale, window)
        return
    if layout.kind == "dense":
        kernels.paged_decode_attention(out, q, layout.k, layout.v, block_table, seq_lens, scale, window)
        return
    kernels.kv_decode_attention(out, q, layout.k, layout.v, layout.k_scales, layout.v_scales,
                                _EMPTY if layout.k_zeros is None else layout.k_zeros,
                                _EMPTY if layout.v_zeros is None else layout.v_zeros,
                                _EMPTY if layout.lut is None else layout.lut,
                                block_table, seq_lens, scale, window, _KINDS[layout.kind])


def _reference_decode(out: torch.Tensor, q: torch.Tensor, read, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float, window: int) -> None:
    """decode_attention through a codec's dense read. Rows sharing a block table (the rows of a
    prefill chunk read in place) read it once."""
    tables, row_table = torch.unique(block_table, dim=0, return_inverse=True)
    keys, values = read(tables)  # [U, kvh, L, d]
    positions = torch.arange(keys.shape[2], device=q.device)
    visible = positions.unsqueeze(0) < seq_lens.unsqueeze(1)  # [B, L]
    if window:
        visible &= positions.unsqueeze(0) >= (seq_lens - window).unsqueeze(1)
    for u in range(len(tables)):
        rows = (row_table == u).nonzero().squeeze(1)
        # each row is its own query of length 1: [1, H, rows, d] over the table's keys, masked per row
        attn = F.scaled_dot_product_attention(q[rows].transpose(0, 1).unsqueeze(0), keys[u:u + 1], values[u:u + 1],
                                              attn_mask=visible[rows].unsqueeze(0).unsqueeze(0), scale=scale,
                                              enable_gqa=True)
        out[rows] = attn[0].transpose(0, 1).to(out.dtype)
