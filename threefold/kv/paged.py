"""PagedKVCache: every layer's block storage, written and read through one codec."""

from __future__ import annotations

import torch

from threefold.kv.codec import KVCodec, KVLayout


class PagedKVCache:
    def __init__(self, codec: KVCodec, num_layers: int, num_blocks: int, block_size: int,
                 device: torch.device) -> None:
        self.codec = codec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layers = [codec.allocate(num_blocks, block_size, device) for _ in range(num_layers)]
        self.layouts = [codec.layout(storage) for storage in self.layers]

    @staticmethod
    def bytes_per_block(codec: KVCodec, num_layers: int, block_size: int) -> int:
        return num_layers * codec.bytes_per_block(block_size)

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.codec.write(self.layers[layer_idx], slot_mapping, k, v)

    def read(self, layer_idx: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codec.read(self.layers[layer_idx], block_table)

    def layout(self, layer_idx: int) -> KVLayout:
        return self.layouts[layer_idx]
