"""Quantizers for the scaled KV codecs, in plain torch: the codecs' write path and the
read path of the reference attention. All maths in fp32.

    int8   symmetric per (token, head):  s = amax / 127,  q = round(x / s)      |x - q s| <= s / 2
    fp8    per (token, head) scale:      s = amax / FMAX, q = fp8(x / s)        |x - q s| <= |x| 2^-(m+1) + s sub / 2
    int4   asymmetric, groups of g channels:  s = (max - min) / 15, z = min,
           q = round((x - z) / s) in [0, 15]                                        |x - (q s + z)| <= s / 2
           packed by halves: byte i = q[i] | q[i + d/2] << 4 (unpacking is two contiguous,
           vectorizable loops in the kernel, where interleaved nibbles would not vectorize)

A zero scale (an all-zero row or a constant group) is stored as is and divides as 1,
so such rows round-trip exactly.
"""

from __future__ import annotations

import torch

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _safe(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> codes int8 [..., d], scales fp32 [..., 1]."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    codes = torch.round(x / _safe(scale)).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale


def quantize_fp8(x: torch.Tensor, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> codes (raw fp8 bits as uint8) [..., d], scales fp32 [..., 1]."""
    x = x.float()
    fmax = torch.finfo(fp8).max
    scale = x.abs().amax(dim=-1, keepdim=True) / fmax
    # x / s can land a rounding step above FMAX; e4m3fn has no inf and would give NaN.
    codes = (x / _safe(scale)).clamp_(-fmax, fmax).to(fp8)
    return codes.view(torch.uint8), scale


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    return codes.view(fp8).float() * scale


def quantize_int4(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., d] -> packed codes uint8 [..., d / 2], scales and zeros fp32 [..., d / group]."""
    x = x.float()
    grouped = x.unflatten(-1, (-1, group))  # [..., d / group, group]
    low = grouped.amin(dim=-1, keepdim=True)
    scale = (grouped.amax(dim=-1, keepdim=True) - low) / 15
    codes = torch.round((grouped - low) / _safe(scale)).clamp_(0, 15).to(torch.uint8).flatten(-2)
    half = codes.shape[-1] // 2
    packed = codes[..., :half] | (codes[..., half:] << 4)
    return packed, scale.squeeze(-1), low.squeeze(-1)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., d / 2] -> codes uint8 [..., d]."""
    return torch.cat([packed & 15, packed >> 4], dim=-1)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    codes = unpack_int4(packed).float().unflatten(-1, (scale.shape[-1], -1))  # [..., groups, group]
    return (codes * scale.unsqueeze(-1) + zero.unsqueeze(-1)).flatten(-2)
