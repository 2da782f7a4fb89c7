"""The native attention kernels over any codec's layout (threefold/kernels: the dense
paged_decode_attention, and kv_attention.cpp's kv_decode_attention for int8 / fp8 / int4)."""

from __future__ import annotations

from types import ModuleType

import torch

from threefold.kv.codec import KVLayout

_KINDS = {"int8": 0, "fp8": 1, "int4": 2}
_EMPTY = torch.empty(0)


def decode_attention(kernels: ModuleType, out: torch.Tensor, q: torch.Tensor, layout: KVLayout,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int) -> None:
    """out, q [B, H, d]; row b attends over its seq_lens[b] keys through block_table[b], in place."""
    if layout.kind == "dense":
        kernels.paged_decode_attention(out, q, layout.k, layout.v, block_table, seq_lens, scale, window)
        return
    kernels.kv_decode_attention(out, q, layout.k, layout.v, layout.k_scales, layout.v_scales,
                                _EMPTY if layout.k_zeros is None else layout.k_zeros,
                                _EMPTY if layout.v_zeros is None else layout.v_zeros,
                                _EMPTY if layout.lut is None else layout.lut,
                                block_table, seq_lens, scale, window, _KINDS[layout.kind])
