"""Recency-tiered precision (PM-KVQ / LogQuant style): exact sinks and recent tokens, a 4-bit
middle band, 2-bit far tokens, each token lowered as it ages.

A request of n tokens reads (R = residual, M = middle, S = sink, B = block_size, KIVI's groups):

    positions [nq, n)             exact, from its window (kv/window.py), as KIVI:
                                  nq(n) = max(start, floor_B(n - max(0, R - B + 1)))
    positions [nm, nq)            4 bits: the middle band, nm(n) = max(start, nq(n) - M)
    positions [0, nm)             2 bits: far
    positions [0, min(S, nq))     exact again: the attention sinks (requests with start = 0)

Every block is quantized once, at 4 bits with KIVI's groups (keys per channel over G tokens,
values per token over G channels: q4 = round((x - z) / s), s = (max - min) / 15), and split in two
bit planes. The high plane is the block: a kivi2 block whose scale and zero are those of the
4-bit grid's coarse cells, so a far block reads as plain kivi2 (and through its kernel):

    hi = q4 >> 2, lo = q4 & 3      scale' = 4 s,  zero' = z + 1.5 s   (fp16, as KIVI stores them)
    far     x^ = zero' + scale' hi                    (the centre of hi's four fine cells)
    middle  x^ = zero' + scale' (hi + lo / 4 - 3 / 8) = z + s q4 (up to zero's fp16 rounding)

The low plane lives beside the request's window, in its band ring (kv/window.py), at position
p % band_size: band_size = M + max(R, B) covers every block from nm to the last one encoded. A block's
low plane is overwritten exactly when the block leaves the band, so aging to 2 bits frees its
bytes without touching the shared block: PM-KVQ's "equivalent right shift", by bit planes.
The sinks are the request's first S tokens, kept exact beside the window once block 0 is encoded.

A prefix hit's tokens (< start) were encoded by another request: they read at 2 bits, sinks
included, as a KIVI hit reads its window's tokens quantized.
"""

from __future__ import annotations

import dataclasses

import torch

from threefold.errors import ThreefoldError
from threefold.kv.codec import KVLayout
from threefold.kv.codecs.kivi import KiviCodec, KiviStorage, pack, quantize_minmax, unpack
from threefold.kv.spec import KVSpec

FINE_BITS = 4
"""Bits of the middle band; the far tokens keep the top 2 of them."""


def _coarse(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-bit grid's (scale, zero) -> its high plane's: scale' = 4 s, zero' = z + 1.5 s (fp16)."""
    return (scale.float() * 4).half(), (zero.float() + 1.5 * scale.float()).half()


class TieredCodec(KiviCodec):
    """`tiered`: see the module docstring."""

    def __init__(self, spec: KVSpec, num_kv_heads: int, head_dim: int, compute_dtype: torch.dtype) -> None:
        super().__init__(KVSpec(spec.name, (("bits", 2), *spec.params)), num_kv_heads, head_dim, compute_dtype)
        self.spec = spec
        self.sink = spec["sink"]
        self.middle = spec["middle"]

    def check_block_size(self, block_size: int) -> None:
        super().check_block_size(block_size)
        if self.middle % block_size:
            raise ThreefoldError(f"kv_cache_dtype {self.spec} needs middle={self.middle} a multiple of "
                                 f"block_size={block_size} (the band ages a whole block at a time).",
                                 param="kv_cache_dtype")
        if self.sink > block_size:
            raise ThreefoldError(f"kv_cache_dtype {self.spec} needs sink={self.sink} at most block_size={block_size} "
                                 f"(the sinks are kept when block 0 is encoded).", param="kv_cache_dtype")

    def band_tokens(self, block_size: int) -> int:
        """Low planes one running request keeps per layer: its middle band plus the window's blocks."""
        return self.middle + self.window_tokens(block_size)

    def sink_tokens(self) -> int:
        return self.sink

    def split(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Whole blocks k, v [n, bs, kvh, d] -> (kivi2 codes, scales and zeros as `quantize`; K, V low
        planes packed [n, bs, kvh, d / 4])."""
        g = self.group
        kq, ks, kz = quantize_minmax(k.unflatten(1, (-1, g)), FINE_BITS, 2)
        vq, vs, vz = quantize_minmax(v.unflatten(-1, (-1, g)), FINE_BITS, -1)
        kq, vq = kq.flatten(1, 2), vq.flatten(-2)
        ks, kz = _coarse(ks.squeeze(2), kz.squeeze(2))
        vs, vz = _coarse(vs.squeeze(-1), vz.squeeze(-1))
        return (pack(kq >> 2, 2), pack(vq >> 2, 2), ks, kz, vs, vz,
                pack(kq & 3, 2), pack(vq & 3, 2))

    def quantize(self, k: torch.Tensor, v: torch.Tensor, k_keep: torch.Tensor | None = None,
                 v_keep: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        assert k_keep is None and v_keep is None
        return self.split(k, v)[:6]

    def encode(self, storage: KiviStorage, block_ids: torch.Tensor, k: torch.Tensor,  # type: ignore[override]
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write whole blocks' high planes (a kivi2 block each); return their low planes (K, V)."""
        *block, k_low, v_low = self.split(k, v)
        self.store(storage, block_ids, tuple(block))
        return k_low, v_low

    def refine(self, k: torch.Tensor, v: torch.Tensor, storage: KiviStorage, block_ids: torch.Tensor,
               k_low: torch.Tensor, v_low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Far K, V [n * bs, kvh, d] of blocks `block_ids` (read_blocks) -> the middle band's, given their
        low planes [n * bs, kvh, d / 4]: x + scale' (lo / 4 - 3 / 8), per element."""
        bs = storage.codes.shape[2]
        g = self.group
        ks = storage.k_scales.index_select(0, block_ids).float().repeat_interleave(g, 1).flatten(0, 1)
        vs = storage.v_scales.index_select(0, block_ids).float().repeat_interleave(g, -1).flatten(0, 1)
        assert ks.shape[0] == len(block_ids) * bs
        k_fix = (unpack(k_low, 2).float() / 4 - 0.375) * ks
        v_fix = (unpack(v_low, 2).float() / 4 - 0.375) * vs
        return (k.float() + k_fix).to(self.compute_dtype), (v.float() + v_fix).to(self.compute_dtype)

    def layout(self, storage: KiviStorage) -> KVLayout:
        """Far blocks as kivi2; the band and the sinks are the request's (kivi_attention reads them)."""
        return dataclasses.replace(super().layout(storage), kind="tiered")

    def round_trip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError("tiered reads depend on a token's age: use the windowed reference (layer_probe)")
