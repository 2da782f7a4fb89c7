"""KV codecs: how one layer's K/V live inside paged blocks.

Paged layout of one layer (every codec keeps this block geometry):

    K codes   [num_blocks, block_size, num_kv_heads, code_width]    (dense: the K rows themselves)
    K scales  [num_blocks, block_size, num_kv_heads, num_groups]    (fp32; quantized codecs only)
    K zeros   [num_blocks, block_size, num_kv_heads, num_groups]    (fp32; asymmetric codecs only)
    ... and the same for V
    slot = block_id * block_size + offset    (a token's index in the cache)

A codec writes a step's K/V at their slots, describes its storage to the native
attention kernel as a `KVLayout` (codes, scales, zeros: the kernel dequantizes
one row at a time in registers), and `read`s blocks back densely for the
plain-torch reference path. Adding a codec is one class in kv/codecs, one
schema line in kv/spec.py and one registry line in kv/registry.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from threefold.kv.spec import KVSpec

StorageT = TypeVar("StorageT")  # what `allocate` returns and the other methods take back


@dataclass
class KVLayout:
    """One layer's storage as the native kernel reads it (k/v: [num_blocks, block_size, kvh, width])."""

    kind: str
    """"dense" (k/v are rows in the compute dtype), "int8", "fp8", "int4", or a kind with its own kernel
    ("kivi", "tiered", "gear", "turboquant")."""
    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None = None
    v_scales: torch.Tensor | None = None
    k_zeros: torch.Tensor | None = None
    v_zeros: torch.Tensor | None = None
    lut: torch.Tensor | None = None
    """fp8: the 256 fp32 values of the code bytes (the kernel decodes by table lookup)."""
    read: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    """The codec's reference `read` of a block table, where kv/native.py's decode_attention attends in
    plain torch (a codec without a native kernel; turboquant keeps it for the reference path)."""
    aux: tuple[torch.Tensor, ...] = ()
    """The rest of the storage a kind's kernel reads ("gear": outlier values, outlier indices and the
    low-rank factors Q, P, see kv/codecs/gear.py's GearStorage; "turboquant": k_signs, norms, rotation
    signs, QJL projection, key and value codebooks, see kernels/tq_attention.cpp)."""


class KVCodec(ABC, Generic[StorageT]):
    """Stores and restores one layer's K/V. Rules: `write` is called before
    `read` within a step (so a step sees its own tokens); `read` returns the
    compute dtype; the null block (id 0) may be read and must not crash;
    `bytes_per_block` counts everything a block stores (codes, scales, zeros)."""

    def __init__(self, spec: KVSpec, num_kv_heads: int, head_dim: int, compute_dtype: torch.dtype) -> None:
        self.spec = spec
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.compute_dtype = compute_dtype

    @property
    def name(self) -> str:
        return self.spec.name

    @abstractmethod
    def bytes_per_block(self, block_size: int) -> int:
        """Bytes one block of one layer takes (K and V together)."""

    @abstractmethod
    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> StorageT:
        """Storage for one layer."""

    @abstractmethod
    def write(self, storage: StorageT, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, num_kv_heads, head_dim] at slots [T]."""

    @abstractmethod
    def read(self, storage: StorageT, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the blocks [B, nb] -> each [B, num_kv_heads, nb * block_size, head_dim]."""

    @abstractmethod
    def layout(self, storage: StorageT) -> KVLayout:
        """The storage as the native attention kernel reads it."""

    def check_block_size(self, block_size: int) -> None:
        """Raise a ThreefoldError if blocks of `block_size` tokens cannot hold this codec."""

    def window_tokens(self, block_size: int) -> int:
        """Full-precision tokens per layer each running request keeps beside its blocks (KIVI's window)."""
        return 0

    def band_tokens(self, block_size: int) -> int:
        """Low bit planes each running request keeps per layer beside its window (`tiered`'s middle band)."""
        return 0

    def sink_tokens(self) -> int:
        """First tokens each running request keeps exact beside its window (`tiered`'s attention sinks)."""
        return 0

    def round_trip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [T, kvh, d] as `read` would return them once written (lossless codecs: unchanged)."""
        return k, v


class DenseCodec(KVCodec[torch.Tensor]):
    """Uncompressed K/V in the model's dtype (bf16 or fp32)."""

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
        num_seqs = block_table.shape[0]
        # index_select copies ~5x faster than advanced indexing on CPU (measured).
        kv = storage.index_select(1, block_table.flatten())  # [2, B * nb, block_size, kvh, d]
        kv = kv.view(2, num_seqs, -1, self.num_kv_heads, self.head_dim).transpose(2, 3)
        return kv[0], kv[1]  # strided views [B, kvh, L, d]

    def layout(self, storage: torch.Tensor) -> KVLayout:
        return KVLayout("dense", storage[0], storage[1])
