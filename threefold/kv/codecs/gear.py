"""GEAR (Kang et al., arXiv 2403.05527): the KIVI backbone plus a low-rank residual and exact outliers.

Each block is compressed whole as it leaves the request's window (as KIVI's are), separately for
K and V and for each KV head, on the matrix X [block_size, head_dim] of that block and head:

    1. outliers S: the c largest and c smallest entries of X, c = bs * d * outliers / 2000
       (`outliers` is in per-mille: 20 = the paper's s = 2%); fp16 values + int16 indices.
    2. D = KIVI(X without S): keys per channel, values per token, 2 or 4 bits. Outliers take no
       part in their group's min/max (as the simulated GEAR-KIVI path's row-mean stand-in).
    3. L = Q P^T ~ X - D (zero at the outliers), rank r, by power iteration from a fixed random
       P0: `loop` rounds of Q = R P, P = R^T Q, with QR on P and Q in the last (GEAR's
       `fake_poweriteration_group`); Q [bs, r] and P [d, r] in fp16.

    read:  X^ = D + Q P^T, then X^[S's indices] = S's values

Fixed bytes per block (so capacity follows bytes): KIVI's codes + scales/zeros, plus per K/V and
head 2c * (2 + 2) outlier bytes and (bs + d) * r * 2 factor bytes. Why the default is rank 2, not
the paper's prefill rank 4: GEAR factors a whole prefill (n tokens x all heads, n in the
thousands), where r (n + d) is small beside n d; a paged block is only bs = 32 tokens of one
64-wide head, where each rank costs 192 bytes beside kivi2's 768 per block-head. The paper's
decode-time re-compressions (its 64-token streaming buffers, our blocks' case) use rank 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from threefold.errors import ThreefoldError
from threefold.kv.codec import KVLayout
from threefold.kv.codecs.kivi import KiviCodec, KiviStorage
from threefold.kv.spec import KVSpec

_INDEX_LIMIT = 2 ** 15
"""Outlier indices are int16 within one block-head's bs * d entries."""


@dataclass
class GearStorage(KiviStorage):
    outlier_values: torch.Tensor
    """[2, num_blocks, kvh, 2c] fp16 (K, V)."""
    outlier_index: torch.Tensor
    """[2, num_blocks, kvh, 2c] int16: t * head_dim + channel."""
    factor_q: torch.Tensor
    """[2, num_blocks, kvh, block_size, rank] fp16."""
    factor_p: torch.Tensor
    """[2, num_blocks, kvh, head_dim, rank] fp16."""


class GearCodec(KiviCodec):
    """gear: see the module docstring."""

    def __init__(self, spec: KVSpec, num_kv_heads: int, head_dim: int, compute_dtype: torch.dtype) -> None:
        super().__init__(spec, num_kv_heads, head_dim, compute_dtype)
        self.rank, self.loop, self.permille = spec["rank"], spec["loop"], spec["outliers"]
        # The power iteration's start: fixed, so a block's codes depend on its tokens alone.
        self.p0 = torch.randn(head_dim, self.rank, generator=torch.Generator().manual_seed(0))

    def num_outliers(self, block_size: int) -> int:
        """c: outliers kept on each side (largest, smallest) per block-head."""
        return block_size * self.head_dim * self.permille // 2000

    def check_block_size(self, block_size: int) -> None:
        super().check_block_size(block_size)
        if block_size * self.head_dim > _INDEX_LIMIT or self.rank > min(block_size, self.head_dim):
            raise ThreefoldError(f"kv_cache_dtype {self.spec} needs block_size * head_dim <= {_INDEX_LIMIT} "
                                 f"(int16 outlier indices) and rank <= min(block_size, head_dim); got "
                                 f"block_size={block_size}, head_dim={self.head_dim}.", param="block_size")

    def bytes_per_block(self, block_size: int) -> int:
        extra = 2 * self.num_outliers(block_size) * 4 + (block_size + self.head_dim) * self.rank * 2
        return super().bytes_per_block(block_size) + 2 * self.num_kv_heads * extra

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> GearStorage:
        base = super().allocate(num_blocks, block_size, device)
        kvh, d, r, c = self.num_kv_heads, self.head_dim, self.rank, self.num_outliers(block_size)

        def half(*shape: int) -> torch.Tensor:
            return torch.zeros(2, num_blocks, kvh, *shape, dtype=torch.float16, device=device)

        index = torch.zeros(2, num_blocks, kvh, 2 * c, dtype=torch.int16, device=device)
        return GearStorage(**vars(base), outlier_values=half(2 * c), outlier_index=index,
                           factor_q=half(block_size, r), factor_p=half(d, r))

    def compress(self, k: torch.Tensor, v: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], ...]:
        """k, v [n, bs, kvh, d] -> (KIVI parts, outlier values, outlier indices, Q, P); the last four
        stack K and V: [2, n, kvh, ...]."""
        x = torch.stack([k, v]).float().permute(0, 1, 3, 2, 4)  # [2, n, kvh, bs, d]: one matrix per block-head
        c = self.num_outliers(k.shape[1])
        flat = x.flatten(-2)
        index = torch.cat([flat.topk(c, -1).indices, flat.topk(c, -1, largest=False).indices], -1)
        keep = torch.ones_like(flat, dtype=torch.bool).scatter_(-1, index, False).view(x.shape)
        keep_rows = keep.permute(0, 1, 3, 2, 4)  # [2, n, bs, kvh, d]
        kivi = self.quantize(k, v, keep_rows[0], keep_rows[1])
        dq = torch.stack(self.dequantize(*kivi)).permute(0, 1, 3, 2, 4)  # D, [2, n, kvh, bs, d]
        factor_q, factor_p = self.low_rank(torch.where(keep, x - dq, 0))
        return kivi, (flat.gather(-1, index).half(), index.to(torch.int16), factor_q.half(), factor_p.half())

    def low_rank(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """residual [..., bs, d] -> Q [..., bs, r], P [..., d, r] with Q P^T ~ residual."""
        p = self.p0.expand(*residual.shape[:-2], -1, -1)
        q = residual[..., : self.rank]  # rank 0: no residual term (GEAR without L)
        for i in range(self.loop if self.rank else 0):
            last = i == self.loop - 1
            p = torch.linalg.qr(p).Q if last else p
            q = residual @ p
            q = torch.linalg.qr(q).Q if last else q
            p = residual.transpose(-1, -2) @ q
        return q, p

    def decompress(self, kivi: tuple[torch.Tensor, ...],
                   extra: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse of `compress` (fp32): K, V [n, bs, kvh, d]."""
        values, index, factor_q, factor_p = extra
        x = torch.stack(self.dequantize(*kivi)).permute(0, 1, 3, 2, 4)  # [2, n, kvh, bs, d]
        x = x + factor_q.float() @ factor_p.float().transpose(-1, -2)
        x = x.flatten(-2).scatter(-1, index.long(), values.float()).view(x.shape).permute(0, 1, 3, 2, 4)
        return x[0], x[1]

    def reconstruct(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decompress(*self.compress(k, v))

    def encode(self, storage: KiviStorage, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        assert isinstance(storage, GearStorage)
        kivi, extra = self.compress(k, v)
        self.store(storage, block_ids, kivi)
        for dst, src in zip(self._extra(storage), extra, strict=True):
            dst.index_copy_(1, block_ids, src)

    def read_blocks(self, storage: KiviStorage, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(storage, GearStorage)
        kivi = (storage.codes[0].index_select(0, block_ids), storage.codes[1].index_select(0, block_ids),
                *(t.index_select(0, block_ids) for t in (storage.k_scales, storage.k_zeros,
                                                         storage.v_scales, storage.v_zeros)))
        k, v = self.decompress(kivi, tuple(t.index_select(1, block_ids) for t in self._extra(storage)))
        return k.flatten(0, 1).to(self.compute_dtype), v.flatten(0, 1).to(self.compute_dtype)

    @staticmethod
    def _extra(storage: GearStorage) -> tuple[torch.Tensor, ...]:
        return storage.outlier_values, storage.outlier_index, storage.factor_q, storage.factor_p

    def layout(self, storage: KiviStorage) -> KVLayout:
        assert isinstance(storage, GearStorage)
        layout = super().layout(storage)
        layout.kind = "gear"  # kernels/gear_attention.cpp reads it in place
        layout.aux = self._extra(storage)
        return layout
