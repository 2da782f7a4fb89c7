"""KIVI (Liu et al., ICML'24): keys per channel, values per token, 2 or 4 bits, a full-precision window.

Quantizer (asymmetric min/max over a group, maths in fp32, scale and zero stored as fp16 as
KIVI does):   s = (max - min) / (2^b - 1),  z = min,  q = clamp(round((x - z) / s), 0, 2^b - 1)
    keys    one group = G consecutive tokens of one (head, channel): scale/zero per (group, head, channel)
    values  one group = G consecutive channels of one (token, head):  scale/zero per (token, head, group)

Storage of one layer's blocks (block_size is a multiple of G, so a block holds whole key groups
and its codes depend on its own tokens only: prefix caching and preemption see plain blocks):

    codes     [2, num_blocks, block_size, kvh, head_dim * b / 8]  uint8, K and V
    k_scales  [num_blocks, block_size / G, kvh, head_dim]          fp16 (k_zeros alike)
    v_scales  [num_blocks, block_size, kvh, head_dim / G]          fp16 (v_zeros alike)

Codes are packed along head_dim by parts: byte i holds code[i + j * d / p] << (j * b) for
j < p = 8 / b (contiguous parts unpack with vector shifts, as int4's halves do).

Blocks are encoded whole (`encode`), once all their tokens are known; until a token leaves the
request's window (kv/window.py) attention reads it in full precision from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from threefold.errors import ThreefoldError
from threefold.kv.codec import KVCodec, KVLayout
from threefold.kv.spec import KVSpec
from threefold.kv.window import window_size


def quantize_minmax(x: torch.Tensor, bits: int, dim: int,
                    keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups along `dim` -> codes uint8 (x's shape), scale and zero fp16 (keepdim). `keep` (bool,
    x's shape): only those entries set the group's range, the others are coded as its minimum
    (GEAR's outliers, stored apart); a group with none kept gets scale and zero 0."""
    x = x.float()
    if keep is None:
        low, high = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    else:
        low = torch.where(keep, x, torch.inf).amin(dim, keepdim=True)
        high = torch.where(keep, x, -torch.inf).amax(dim, keepdim=True)
        low, high = torch.where(low.isinf(), 0, low), torch.where(high.isinf(), 0, high)
        x = torch.where(keep, x, low)
    scale = ((high - low) / (2 ** bits - 1)).half()
    zero = low.half()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).float()  # constant group: exact
    codes = torch.round((x - zero.float()) / safe).clamp_(0, 2 ** bits - 1).to(torch.uint8)
    return codes, scale, zero


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., d] -> [..., d * bits / 8]."""
    parts = codes.unflatten(-1, (8 // bits, -1))
    packed = parts[..., 0, :].clone()
    for j in range(1, 8 // bits):
        packed |= parts[..., j, :] << (j * bits)
    return packed


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    mask = 2 ** bits - 1
    return torch.cat([(packed >> (j * bits)) & mask for j in range(8 // bits)], dim=-1)


@dataclass
class KiviStorage:
    codes: torch.Tensor
    k_scales: torch.Tensor
    k_zeros: torch.Tensor
    v_scales: torch.Tensor
    v_zeros: torch.Tensor


class KiviCodec(KVCodec[KiviStorage]):
    """kivi2 / kivi4: see the module docstring."""

    def __init__(self, spec: KVSpec, num_kv_heads: int, head_dim: int, compute_dtype: torch.dtype) -> None:
        super().__init__(spec, num_kv_heads, head_dim, compute_dtype)
        self.bits = dict(spec.params).get("bits") or int(spec.name.removeprefix("kivi"))
        self.group = spec["group"]
        self.residual = spec["residual"]
        if head_dim % self.group or head_dim % (8 // self.bits):
            raise ThreefoldError(f"kv_cache_dtype {spec}: group={self.group} must divide head_dim={head_dim} "
                                 f"(values are quantized in groups of channels); pick a group that does.",
                                 param="kv_cache_dtype")

    def check_block_size(self, block_size: int) -> None:
        if block_size % self.group:
            raise ThreefoldError(f"kv_cache_dtype {self.spec} needs block_size a multiple of group={self.group} "
                                 f"(got block_size={block_size}): set block_size={self.group} or a group that "
                                 f"divides {block_size}.", param="block_size")

    def window_tokens(self, block_size: int) -> int:
        """Full-precision tokens one running request keeps per layer: at most R (or the block
        being filled, for R < B), kv/window.py."""
        return window_size(self.residual, block_size)

    def bytes_per_block(self, block_size: int) -> int:
        codes = 2 * block_size * self.num_kv_heads * self.head_dim * self.bits // 8
        k_meta = block_size // self.group * self.num_kv_heads * self.head_dim * 2 * 2
        v_meta = block_size * self.num_kv_heads * self.head_dim // self.group * 2 * 2
        return codes + k_meta + v_meta

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> KiviStorage:
        self.check_block_size(block_size)
        kvh, d, g = self.num_kv_heads, self.head_dim, self.group
        k_meta, v_meta = (num_blocks, block_size // g, kvh, d), (num_blocks, block_size, kvh, d // g)
        return KiviStorage(
            torch.zeros(2, num_blocks, block_size, kvh, d * self.bits // 8, dtype=torch.uint8, device=device),
            torch.zeros(k_meta, dtype=torch.float16, device=device), torch.zeros(k_meta, dtype=torch.float16,
                                                                                 device=device),
            torch.zeros(v_meta, dtype=torch.float16, device=device), torch.zeros(v_meta, dtype=torch.float16,
                                                                                 device=device))

    def quantize(self, k: torch.Tensor, v: torch.Tensor, k_keep: torch.Tensor | None = None,
                 v_keep: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """k, v [n, block_size, kvh, d] -> packed K, V codes, K scale/zero [n, bs / G, kvh, d],
        V scale/zero [n, bs, kvh, d / G]. k_keep, v_keep: see `quantize_minmax` (GEAR)."""
        g = self.group
        k_keep = None if k_keep is None else k_keep.unflatten(1, (-1, g))
        v_keep = None if v_keep is None else v_keep.unflatten(-1, (-1, g))
        k_codes, k_scale, k_zero = quantize_minmax(k.unflatten(1, (-1, g)), self.bits, 2, k_keep)
        v_codes, v_scale, v_zero = quantize_minmax(v.unflatten(-1, (-1, g)), self.bits, -1, v_keep)
        return (pack(k_codes.flatten(1, 2), self.bits), pack(v_codes.flatten(-2), self.bits),
                k_scale.squeeze(2), k_zero.squeeze(2), v_scale.squeeze(-1), v_zero.squeeze(-1))

    def dequantize(self, k_codes, v_codes, k_scale, k_zero, v_scale, v_zero) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse of `quantize` (fp32): [n, block_size, kvh, d] each."""
        g = self.group
        k = unpack(k_codes, self.bits).float().unflatten(1, (-1, g))  # [n, bs / G, G, kvh, d]
        k = (k * k_scale.float().unsqueeze(2) + k_zero.float().unsqueeze(2)).flatten(1, 2)
        v = unpack(v_codes, self.bits).float().unflatten(-1, (-1, g))  # [n, bs, kvh, d / G, G]
        v = (v * v_scale.float().unsqueeze(-1) + v_zero.float().unsqueeze(-1)).flatten(-2)
        return k, v

    def encode(self, storage: KiviStorage, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write whole blocks: k, v [n, block_size, kvh, d] into blocks `block_ids` [n]."""
        self.store(storage, block_ids, self.quantize(k, v))

    @staticmethod
    def store(storage: KiviStorage, block_ids: torch.Tensor, quantized: tuple[torch.Tensor, ...]) -> None:
        """Put `quantize`'s output (K, V codes, K scale / zero, V scale / zero) into blocks `block_ids`."""
        k_codes, v_codes, k_scale, k_zero, v_scale, v_zero = quantized
        storage.codes[0].index_copy_(0, block_ids, k_codes)
        storage.codes[1].index_copy_(0, block_ids, v_codes)
        for dst, src in ((storage.k_scales, k_scale), (storage.k_zeros, k_zero),
                         (storage.v_scales, v_scale), (storage.v_zeros, v_zero)):
            dst.index_copy_(0, block_ids, src)

    def read_blocks(self, storage: KiviStorage, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks [n] -> K, V [n * block_size, kvh, d] in the compute dtype (the reference path)."""
        k, v = self.dequantize(storage.codes[0].index_select(0, block_ids), storage.codes[1].index_select(0, block_ids),
                               *(t.index_select(0, block_ids) for t in (storage.k_scales, storage.k_zeros,
                                                                        storage.v_scales, storage.v_zeros)))
        return k.flatten(0, 1).to(self.compute_dtype), v.flatten(0, 1).to(self.compute_dtype)

    def round_trip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [T, kvh, d] as their blocks read once encoded, in blocks of G tokens (the smallest
        block allowed); a last partial block stays exact, as it would in the window."""
        full = k.shape[0] // self.group * self.group
        blocks = (-1, self.group, *k.shape[1:])
        k_hat, v_hat = self.reconstruct(k[:full].reshape(blocks), v[:full].reshape(blocks))
        return (torch.cat([k_hat.flatten(0, 1).to(self.compute_dtype), k[full:]]),
                torch.cat([v_hat.flatten(0, 1).to(self.compute_dtype), v[full:]]))

    def reconstruct(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks k, v [n, bs, kvh, d] -> as read back after `encode` (fp32)."""
        return self.dequantize(*self.quantize(k, v))

    def write(self, storage: KiviStorage, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        raise TypeError("KIVI blocks are encoded whole (encode), through the request's window")

    def read(self, storage: KiviStorage, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_seqs = block_table.shape[0]
        k, v = self.read_blocks(storage, block_table.flatten())
        shape = (num_seqs, -1, self.num_kv_heads, self.head_dim)
        return k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)

    def layout(self, storage: KiviStorage) -> KVLayout:
        return KVLayout("kivi", storage.codes[0], storage.codes[1], storage.k_scales, storage.v_scales,
                        storage.k_zeros, storage.v_zeros)
