"""Scaled codecs: int8, fp8 (e4m3 / e5m2) and int4, each row quantized on its own.

Storage of one layer (index 0 = K, 1 = V):

    codes   [2, num_blocks, block_size, kvh, code_width]   int8 / fp8 bits / two int4 per byte (by halves)
    scales  [2, num_blocks, block_size, kvh, num_groups]   fp32
    zeros   [2, num_blocks, block_size, kvh, num_groups]   fp32, int4 only

Per-(token, head) scales need no calibration, and a token's codes never change
after it is written, so the prefix cache and preemption treat these blocks
exactly like dense ones. Scales are fp32: at head_dim 64 they cost 1/16 of an
int8 row (measured choice: fp16 scales saved 3% of int8's bytes for a second
rounding step in every read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from threefold.errors import ThreefoldError
from threefold.kv import quant
from threefold.kv.codec import KVCodec, KVLayout
from threefold.kv.spec import KVSpec


@dataclass
class ScaledStorage:
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None


class ScaledCodec(KVCodec):
    """Shared write/read/layout; subclasses give the row quantizer and its shapes."""

    code_dtype: torch.dtype = torch.uint8
    kind = ""
    has_zeros = False

    def code_width(self) -> int:
        return self.head_dim

    def num_groups(self) -> int:
        return 1

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [..., d] -> codes [..., code_width], scales [..., groups], zeros [..., groups] or None."""
        raise NotImplementedError

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def bytes_per_block(self, block_size: int) -> int:
        code_bytes = self.code_width() * torch.empty((), dtype=self.code_dtype).element_size()
        meta_bytes = self.num_groups() * 4 * (2 if self.has_zeros else 1)
        return 2 * block_size * self.num_kv_heads * (code_bytes + meta_bytes)

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> ScaledStorage:
        rows = (2, num_blocks, block_size, self.num_kv_heads)
        zeros = torch.zeros(*rows, self.num_groups(), device=device) if self.has_zeros else None
        return ScaledStorage(torch.zeros(*rows, self.code_width(), dtype=self.code_dtype, device=device),
                             torch.zeros(*rows, self.num_groups(), device=device), zeros)

    def write(self, storage: ScaledStorage, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        codes, scales, zeros = self.quantize(torch.stack([k, v]))  # [2, T, kvh, *]
        for dst, src in ((storage.codes, codes), (storage.scales, scales), (storage.zeros, zeros)):
            if dst is not None:
                dst.view(2, -1, *dst.shape[3:]).index_copy_(1, slot_mapping, src.to(dst.dtype))

    def read(self, storage: ScaledStorage, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_seqs = block_table.shape[0]
        blocks = block_table.flatten()
        zeros = None if storage.zeros is None else storage.zeros.index_select(1, blocks)
        dense = self.dequantize(storage.codes.index_select(1, blocks), storage.scales.index_select(1, blocks), zeros)
        dense = dense.to(self.compute_dtype).view(2, num_seqs, -1, self.num_kv_heads, self.head_dim).transpose(2, 3)
        return dense[0], dense[1]  # [B, kvh, L, d]

    def round_trip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dense = self.dequantize(*self.quantize(torch.stack([k, v]))).to(self.compute_dtype)
        return dense[0], dense[1]

    def layout(self, storage: ScaledStorage) -> KVLayout:
        zeros = storage.zeros
        return KVLayout(self.kind, storage.codes[0], storage.codes[1], storage.scales[0], storage.scales[1],
                        None if zeros is None else zeros[0], None if zeros is None else zeros[1], self.lut())

    def lut(self) -> torch.Tensor | None:
        return None


class Int8Codec(ScaledCodec):
    """Symmetric int8, one scale per (token, head): 1 + 4/head_dim bytes per element."""

    code_dtype = torch.int8
    kind = "int8"

    def quantize(self, x):
        codes, scales = quant.quantize_int8(x)
        return codes, scales, None

    def dequantize(self, codes, scales, zeros):
        return quant.dequantize_int8(codes, scales)


class Fp8Codec(ScaledCodec):
    """fp8 (e4m3 or e5m2) codes with one fp32 scale per (token, head), amax mapped to the format's max."""

    kind = "fp8"

    def __init__(self, spec: KVSpec, num_kv_heads: int, head_dim: int, compute_dtype: torch.dtype) -> None:
        super().__init__(spec, num_kv_heads, head_dim, compute_dtype)
        self.fp8 = quant.FP8_DTYPES[spec.name]
        self._lut = torch.arange(256, dtype=torch.uint8).view(self.fp8).float()

    def quantize(self, x):
        codes, scales = quant.quantize_fp8(x, self.fp8)
        return codes, scales, None

    def dequantize(self, codes, scales, zeros):
        return quant.dequantize_fp8(codes, scales, self.fp8)

    def lut(self) -> torch.Tensor:
        return self._lut


class Int4Codec(ScaledCodec):
    """Asymmetric int4 in groups of `group` head_dim channels, per-group scale and zero point."""

    kind = "int4"
    has_zeros = True

    def __init__(self, spec: KVSpec, num_kv_heads: int, head_dim: int, compute_dtype: torch.dtype) -> None:
        super().__init__(spec, num_kv_heads, head_dim, compute_dtype)
        self.group = spec["group"]
        if head_dim % self.group or self.group % 2:
            raise ThreefoldError(f"kv_cache_dtype {spec}: group={self.group} must divide head_dim={head_dim}; "
                                 f"pick a group that does.", param="kv_cache_dtype")

    def code_width(self) -> int:
        return self.head_dim // 2

    def num_groups(self) -> int:
        return self.head_dim // self.group

    def quantize(self, x):
        return quant.quantize_int4(x, self.group)

    def dequantize(self, codes, scales, zeros):
        return quant.dequantize_int4(codes, scales, zeros)
