"""PagedKVCache: every layer's block storage, each layer written and read through its own codec
(one codec for all layers, or a per-layer mix: kv/mix.py). Blocks are shared across layers, so a
block's bytes are the sum over layers and capacity follows the mix."""

from __future__ import annotations

import torch

from threefold.kv.codec import KVCodec, KVLayout


class PagedKVCache:
    def __init__(self, codec: KVCodec | list[KVCodec], num_layers: int, num_blocks: int, block_size: int,
                 device: torch.device) -> None:
        self.codecs = codec if isinstance(codec, list) else [codec] * num_layers
        assert len(self.codecs) == num_layers, (len(self.codecs), num_layers)
        self.codec: KVCodec | None = self.codecs[0] if len({id(c) for c in self.codecs}) == 1 else None
        """The one codec of every layer, or None for a per-layer mix."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layers = [c.allocate(num_blocks, block_size, device) for c in self.codecs]
        self.layouts = [c.layout(storage) for c, storage in zip(self.codecs, self.layers, strict=True)]
        dense = all(layout.kind == "dense" and layout.read is None for layout in self.layouts)
        self.dense_kv = ([lay.k for lay in self.layouts], [lay.v for lay in self.layouts]) if dense else None
        """Every layer's K and V blocks [num_blocks, block_size, kvh, d] where no layer compresses
        (the native decode loop writes and reads them), else None."""

    @staticmethod
    def bytes_per_block(codec: KVCodec | list[KVCodec], num_layers: int, block_size: int) -> int:
        if isinstance(codec, list):
            return sum(c.bytes_per_block(block_size) for c in codec)
        return num_layers * codec.bytes_per_block(block_size)

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.codecs[layer_idx].write(self.layers[layer_idx], slot_mapping, k, v)

    def read(self, layer_idx: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codecs[layer_idx].read(self.layers[layer_idx], block_table)

    def layout(self, layer_idx: int) -> KVLayout:
        return self.layouts[layer_idx]
