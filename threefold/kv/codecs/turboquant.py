"""TurboQuant (Zandieh et al., ICLR 2026): a random rotation, a Lloyd-Max scalar quantizer for the
rotated coordinates, and (keys) a 1-bit QJL residual that makes inner products unbiased. No calibration.

Per (token, KV head) vector x of head_dim d (a power of two), with the head's fixed rotation
R = H diag(s) / sqrt(d) (H: Sylvester Hadamard, s: random signs from `seed`):

    n = ||x||  (fp16)          y = R x / n: a uniform point on the sphere, so each coordinate has
                               density ~ (1 - t^2)^((d - 3) / 2), known in advance
    codes = nearest centroid of the b-bit Lloyd-Max codebook for that density (b = kbits / vbits)
    x_mse = n R^T c[codes]
    keys, qjl=1 (TurboQuant_prod): r = x - x_mse, stored as sign(S R r) (d bits, S [d, d] ~ N(0, 1)
    from `seed`) and ||r|| (fp16). The read returns the dense, unbiased reconstruction
        k^ = x_mse + ||r|| sqrt(pi / 2) / d R^T S^T sign(S R r)
    since E_S[<q, S^T sign(S r)>] = d sqrt(2 / pi) <q, r> / ||r||: <q, k^> is unbiased for <q, k>.

Storage per layer (codes packed by bit planes: plane j holds bit j of every code, 8 codes a byte
as KIVI packs its 1-bit case):

    k_codes [num_blocks, block_size, kvh, kbits, d / 8]   uint8   (k_signs alike, one plane; qjl=1)
    v_codes [num_blocks, block_size, kvh, vbits, d / 8]   uint8
    norms   [3, num_blocks, block_size, kvh]              fp16    (||k||, ||v||, ||r|| of keys)

A token's codes depend on that token alone, so prefix caching and preemption see plain blocks.
Attention reads the packed blocks in place: kernels/tq_attention.cpp rotates each query once (a fast
Walsh-Hadamard transform), scores a key as ||k|| <R q, c[codes]> plus the QJL term
||r|| sqrt(pi / 2) / d <S R q, sign>, and accumulates values rotated, turning them back once per
query head (tq_decode_attention from kv/native.py: decode rows, prefill chunks, sliding window,
candidate trees). `read` (the dense reconstruction) stays as the plain-torch reference path.
`residual` > 0 puts KIVI's full-precision window (kv/window.py) in front: blocks are then encoded
whole (in torch) as they leave it, and read through worker/kivi_attention.py (tq_window_attention).
Measured on SmolLM2 (BENCHMARKS.md): without a window every token, the current one included, is
compressed (+78% perplexity); with residual=128 and qjl=0 it beats kivi2 on both bytes and
perplexity (+2.5%).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from threefold.errors import ThreefoldError
from threefold.kv.codec import KVCodec, KVLayout
from threefold.kv.codecs.kivi import pack, unpack
from threefold.kv.spec import KVSpec
from threefold.kv.window import window_size


@functools.lru_cache(maxsize=16)
def lloyd_max(dim: int, bits: int, iterations: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """Centroids [2^b] and decision boundaries [2^b - 1] (fp32) minimizing the MSE of one coordinate
    of a uniform point on the unit sphere in R^dim (Lloyd's algorithm on a fine grid of its density)."""
    grid = torch.linspace(-1, 1, 1 << 14, dtype=torch.float64)[1:-1]
    density = (1 - grid ** 2) ** ((dim - 3) / 2)
    cdf = torch.cumsum(density, 0) / density.sum()
    levels = 1 << bits
    centroids = grid[torch.searchsorted(cdf, (torch.arange(levels, dtype=torch.float64) + 0.5) / levels)]
    for _ in range(iterations):
        bounds = (centroids[1:] + centroids[:-1]) / 2
        cell = torch.bucketize(grid, bounds)
        mass = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, density)
        centroids = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, density * grid) / mass
    return centroids.float(), ((centroids[1:] + centroids[:-1]) / 2).float()


def hadamard(dim: int) -> torch.Tensor:
    """Sylvester's H [dim, dim] of +-1 (dim a power of two); H H^T = dim I."""
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def pack_planes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., d] -> [..., bits, d / 8]."""
    return torch.stack([pack((codes >> j) & 1, 1) for j in range(bits)], dim=-2)


def unpack_planes(planes: torch.Tensor) -> torch.Tensor:
    """[..., bits, d / 8] -> uint8 codes [..., d]."""
    codes = unpack(planes[..., 0, :], 1)
    for j in range(1, planes.shape[-2]):
        codes |= unpack(planes[..., j, :], 1) << j
    return codes


@dataclass
class TurboStorage:
    k_codes: torch.Tensor
    k_signs: torch.Tensor
    v_codes: torch.Tensor
    norms: torch.Tensor


class TurboQuantCodec(KVCodec[TurboStorage]):
    """turboquant: see the module docstring."""

    def __init__(self, spec: KVSpec, num_kv_heads: int, head_dim: int, compute_dtype: torch.dtype) -> None:
        super().__init__(spec, num_kv_heads, head_dim, compute_dtype)
        if head_dim & (head_dim - 1) or head_dim < 8:
            raise ThreefoldError(f"kv_cache_dtype {spec} needs head_dim a power of two >= 8 (the Hadamard "
                                 f"rotation); this model's is {head_dim}.", param="kv_cache_dtype")
        self.kbits, self.vbits, self.qjl = spec["kbits"], spec["vbits"], bool(spec["qjl"])
        self.residual = spec["residual"]
        gen = torch.Generator().manual_seed(spec["seed"])
        self.signs = torch.randint(0, 2, (num_kv_heads, head_dim), generator=gen).float() * 2 - 1  # s [kvh, d]
        self.rotation = hadamard(head_dim) * self.signs.unsqueeze(1) / math.sqrt(head_dim)  # [kvh, d, d]: y = x @ R^T
        self.projection = torch.randn(num_kv_heads, head_dim, head_dim, generator=gen)  # S [kvh, m = d, d]
        self.k_book = lloyd_max(head_dim, self.kbits)
        self.v_book = lloyd_max(head_dim, self.vbits)

    def window_tokens(self, block_size: int) -> int:
        """residual > 0: KIVI's window (kv/window.py): at most R recent tokens stay exact."""
        return window_size(self.residual, block_size) if self.residual else 0

    def encode(self, storage: TurboStorage, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Whole blocks k, v [n, block_size, kvh, d] (the windowed path): each token as `write`s."""
        block_size = k.shape[1]
        slots = (block_ids.unsqueeze(1) * block_size + torch.arange(block_size, device=k.device)).flatten()
        self.write(storage, slots, k.flatten(0, 1), v.flatten(0, 1))

    def read_blocks(self, storage: TurboStorage, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks [n] -> K, V [n * block_size, kvh, d] in the compute dtype."""
        k, v = self.read(storage, block_ids.unsqueeze(0))  # [1, kvh, n * bs, d]
        return k[0].transpose(0, 1), v[0].transpose(0, 1)

    def bytes_per_block(self, block_size: int) -> int:
        planes = self.kbits + self.vbits + (1 if self.qjl else 0)
        per_row = planes * self.head_dim // 8 + 2 * (3 if self.qjl else 2)
        return block_size * self.num_kv_heads * per_row

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> TurboStorage:
        rows, width = (num_blocks, block_size, self.num_kv_heads), self.head_dim // 8

        def planes(n: int) -> torch.Tensor:
            return torch.zeros(*rows, n, width, dtype=torch.uint8, device=device)

        return TurboStorage(planes(self.kbits), planes(1 if self.qjl else 0), planes(self.vbits),
                            torch.zeros(3 if self.qjl else 2, *rows, dtype=torch.float16, device=device))

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., kvh, d] -> R x per head."""
        return torch.einsum("...hd,hed->...he", x, self.rotation.to(x.device))

    def _unrotate(self, y: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...he,hed->...hd", y, self.rotation.to(y.device))

    def quantize(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """k, v [..., kvh, d] -> K code planes, K sign plane ([..., kvh, 0, d / 8] without QJL),
        V code planes, norms [2 or 3, ..., kvh] fp16."""
        k_codes, k_norm, k_rot = self._quantize_rows(k.float(), self.k_book)
        v_codes, v_norm, _ = self._quantize_rows(v.float(), self.v_book)
        if not self.qjl:
            return (pack_planes(k_codes, self.kbits), k_codes.new_zeros(*k_codes.shape[:-1], 0, k.shape[-1] // 8),
                    pack_planes(v_codes, self.vbits), torch.stack([k_norm, v_norm]))
        residual = k_rot - k_norm.float().unsqueeze(-1) * self.k_book[0][k_codes.long()]  # R (k - k_mse)
        projected = torch.einsum("...hd,hmd->...hm", residual, self.projection.to(k.device))
        signs = (projected >= 0).to(torch.uint8)
        return (pack_planes(k_codes, self.kbits), pack_planes(signs, 1), pack_planes(v_codes, self.vbits),
                torch.stack([k_norm, v_norm, residual.norm(dim=-1).half()]))

    def _quantize_rows(self, x: torch.Tensor, book) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> codes uint8 [..., kvh, d], the norm (fp16, as stored), R x (fp32)."""
        norm = x.norm(dim=-1, keepdim=True)
        rotated = self._rotate(x)
        unit = rotated / torch.where(norm > 0, norm, torch.ones_like(norm))
        codes = torch.bucketize(unit.contiguous(), book[1].to(x.device)).to(torch.uint8)
        return codes, norm.squeeze(-1).half(), rotated

    def dequantize(self, k_codes, k_signs, v_codes, norms) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse of `quantize` (fp32): K, V [..., kvh, d]."""
        k_rot = norms[0].float().unsqueeze(-1) * self.k_book[0].to(k_codes.device)[unpack_planes(k_codes).long()]
        v_rot = norms[1].float().unsqueeze(-1) * self.v_book[0].to(v_codes.device)[unpack_planes(v_codes).long()]
        if self.qjl:
            signs = unpack_planes(k_signs).float() * 2 - 1  # [..., kvh, m]
            back = torch.einsum("...hm,hmd->...hd", signs, self.projection.to(signs.device))
            k_rot = k_rot + norms[2].float().unsqueeze(-1) * math.sqrt(math.pi / 2) / self.head_dim * back
        return self._unrotate(k_rot), self._unrotate(v_rot)

    def write(self, storage: TurboStorage, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_codes, k_signs, v_codes, norms = self.quantize(k, v)
        for dst, src in ((storage.k_codes, k_codes), (storage.k_signs, k_signs), (storage.v_codes, v_codes)):
            if dst.numel():  # (no sign plane without QJL)
                dst.view(-1, *dst.shape[2:]).index_copy_(0, slot_mapping, src)
        storage.norms.view(len(norms), -1, self.num_kv_heads).index_copy_(1, slot_mapping, norms)

    def read(self, storage: TurboStorage, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_seqs, blocks = block_table.shape[0], block_table.flatten()
        k, v = self.dequantize(storage.k_codes.index_select(0, blocks), storage.k_signs.index_select(0, blocks),
                               storage.v_codes.index_select(0, blocks), storage.norms.index_select(1, blocks))
        shape = (num_seqs, -1, self.num_kv_heads, self.head_dim)  # [B, nb * bs, kvh, d] -> [B, kvh, L, d]
        k, v = (t.to(self.compute_dtype).view(shape).transpose(1, 2) for t in (k, v))
        return k, v

    def round_trip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_hat, v_hat = self.dequantize(*self.quantize(k, v))
        return k_hat.to(self.compute_dtype), v_hat.to(self.compute_dtype)

    def layout(self, storage: TurboStorage) -> KVLayout:
        device = storage.k_codes.device
        aux = (storage.k_signs, storage.norms, self.signs.to(device), self.projection.to(device),
               self.k_book[0].to(device), self.v_book[0].to(device))
        return KVLayout("turboquant", storage.k_codes, storage.v_codes, read=functools.partial(self.read, storage),
                        aux=aux)
