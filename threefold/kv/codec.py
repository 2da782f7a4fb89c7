"""KV codecs: how one layer's K/V live inside paged blocks.

Paged layout of one layer (dense codec):

    storage[0] = K   [num_blocks, block_size, num_kv_heads, head_dim]
    storage[1] = V   [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset    (a token's index in the cache)

A quantized codec keeps codes plus scales in the same block geometry and
decodes on `read`; the attention backend only ever sees `write` and `read`,
so adding a codec is one new file and one registry line.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from threefold.errors import ThreefoldError


class KVCodec(ABC):
    """Stores and restores one layer's K/V. Rules: `write` is called before
    `read` within a step (so a step sees its own tokens); `read` returns the
    compute dtype; the null block (id 0) may be read and must not crash."""

    name: str = ""

    def __init__(self, num_kv_heads: int, head_dim: int, compute_dtype: torch.dtype) -> None:
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.compute_dtype = compute_dtype

    @abstractmethod
    def bytes_per_block(self, block_size: int) -> int:
        """Bytes one block of one layer takes (K and V together)."""

    @abstractmethod
    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> object:
        """Storage for one layer."""

    @abstractmethod
    def write(self, storage: object, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, num_kv_heads, head_dim] at slots [T]."""

    @abstractmethod
    def read(self, storage: object, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the blocks [B, nb] -> each [B, num_kv_heads, nb * block_size, head_dim]."""

    def dense_views(self, storage: object) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K, V as [num_blocks, block_size, num_kv_heads, head_dim] in the compute dtype, for
        kernels that attend over blocks in place; None when the codec stores anything else."""
        return None


class DenseCodec(KVCodec):
    """Uncompressed K/V in the model's dtype (bf16 or fp32)."""

    name = "auto"

    def bytes_per_block(self, block_size: int) -> int:
        element = torch.empty((), dtype=self.compute_dtype).element_size()
        return 2 * block_size * self.num_kv_heads * self.head_dim * element

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> torch.Tensor:
        shape = (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.compute_dtype, device=device)

    def write(self, storage: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        flat = storage.view(2, -1, self.num_kv_heads, self.head_dim)
        flat[0].index_copy_(0, slot_mapping, k.to(self.compute_dtype))
        flat[1].index_copy_(0, slot_mapping, v.to(self.compute_dtype))

    def read(self, storage: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_seqs, num_blocks = block_table.shape
        # index_select copies ~5x faster than advanced indexing on CPU (measured).
        kv = storage.index_select(1, block_table.flatten())  # [2, B * nb, block_size, kvh, d]
        kv = kv.view(2, num_seqs, -1, self.num_kv_heads, self.head_dim).transpose(2, 3)
        return kv[0], kv[1]  # strided views [B, kvh, L, d]

    def dense_views(self, storage: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return storage[0], storage[1]


CODECS: dict[str, type[KVCodec]] = {"auto": DenseCodec}


def make_codec(name: str, num_kv_heads: int, head_dim: int, compute_dtype: torch.dtype) -> KVCodec:
    codec = CODECS.get(name)
    if codec is None:
        raise ThreefoldError(f"unknown kv_cache_dtype {name!r}; supported: {sorted(CODECS)}", param="kv_cache_dtype")
    return codec(num_kv_heads, head_dim, compute_dtype)
