"""Blocks of the paged KV pool <-> the bytes the offload tiers store (the worker's side of issue 12).

A payload is one block of every layer, in the offload codec: for each storage part of the codec (dense:
one tensor; scaled codecs: codes, scales, zeros), layer by layer, K then V, the block's raw bytes. The
same codec as the pool copies its raw storage (bit-exact); another codec (e.g. int8 below a bf16 pool)
re-encodes through a staging cache of that codec: encode on store, decode into the pool's codec on load.

Copies run on numpy views of the pool's memory, on the calling thread: torch would split a memory-bound
copy over both intra-op threads and, on a busy 2-core machine, wait for the slower one; and the old
stack/re-lay/concatenate path made four fresh step-sized tensors, whose page faults cost more than the
copies (2-14 ms a 720 KiB block, measured, against well under 1 ms now). Encode gathers a step's blocks
per layer and part into one reused table, then copies each block into its bytes; decode copies each
payload straight into its pool block. A pool on an accelerator would need a device-to-host copy first
(not built: CPU-first).
"""

from __future__ import annotations

import numpy as np
import torch

from threefold.errors import ThreefoldError
from threefold.kv.codec import KVCodec
from threefold.kv.codecs.scaled import ScaledStorage
from threefold.kv.paged import PagedKVCache

ENCODE_CHUNK = 32
"""Blocks gathered at once (the reused table: 23 MiB of SmolLM2's fp32 blocks)."""


def _parts(storage: torch.Tensor | ScaledStorage) -> list[torch.Tensor]:
    """One layer's storage tensors, each [2, num_blocks, ...] (K and V first, blocks second)."""
    if isinstance(storage, torch.Tensor):
        return [storage]
    return [t for t in (storage.codes, storage.scales, storage.zeros) if t is not None]


def _byte_views(storage: torch.Tensor | ScaledStorage) -> list[np.ndarray]:
    """One layer's storage parts as uint8 arrays [2, num_blocks, ..., bytes], sharing their memory (any
    dtype, bf16 included: numpy has none, bytes it has)."""
    return [part.view(torch.uint8).numpy() for part in _parts(storage)]


class BlockCodec:
    """One block of every layer <-> its payload bytes, in the offload codec."""

    def __init__(self, cache: PagedKVCache, offload_codec: KVCodec) -> None:
        self.cache = cache
        assert cache.codec is not None, "a per-layer codec mix has no offload (the engine refuses it)"
        self.pool_codec: KVCodec = cache.codec
        self.codec = offload_codec
        offload_storage = offload_codec.allocate(1, cache.block_size, torch.device("cpu"))
        for storage, codec, which in ((cache.layers[0], cache.codec, "kv_cache_dtype"),
                                      (offload_storage, offload_codec, "kv_offload codec")):
            if not isinstance(storage, torch.Tensor | ScaledStorage):  # windowed/rotated codecs keep more state
                raise ThreefoldError(f"kv_offload does not support {which} {codec.name!r} yet: the tiers move "
                                     f"dense or scaled blocks (auto, int8, fp8, fp8_e5m2, int4).", param="kv_offload")
        self.transcode = str(offload_codec.spec) != str(self.pool_codec.spec)
        self.block_size = cache.block_size
        self.num_layers = len(cache.layers)
        sample = _byte_views(offload_storage)
        self._block_shapes = [view.shape[2:] for view in sample]
        """Each part's block, in bytes: [block_size, heads, bytes of a row] or the codec's own layout."""
        self._part_bytes = [self.num_layers * 2 * view[0, 0].nbytes for view in sample]
        self.payload_bytes = sum(self._part_bytes)
        self._pool = [] if self.transcode else [_byte_views(layer) for layer in cache.layers]
        self._scratch = np.empty((ENCODE_CHUNK, self.payload_bytes), np.uint8)
        """The gather's table, reused: a fresh one per step costs more in page faults than the copy."""

    def encode(self, block_ids: list[int]) -> list[bytes]:
        """Payloads of the blocks: per chunk of ENCODE_CHUNK, one gather per layer and part into a reused
        table, then one copy per block into its bytes."""
        payloads = []
        for start in range(0, len(block_ids), ENCODE_CHUNK):
            payloads += self._encode_chunk(block_ids[start: start + ENCODE_CHUNK])
        return payloads

    def _encode_chunk(self, block_ids: list[int]) -> list[bytes]:
        if self.transcode:
            sources = [_byte_views(s) for s in self._transcoded(torch.tensor(block_ids, dtype=torch.long))]
            rows = np.arange(len(block_ids))
        else:
            sources, rows = self._pool, np.asarray(block_ids)
        table = self._scratch[: len(block_ids)]
        for part, column in enumerate(self._columns(table)):
            for layer, views in enumerate(sources):
                np.take(views[part], rows, axis=1, out=column[:, layer].swapaxes(0, 1), mode="clip")
        return [row.tobytes() for row in table]

    def decode(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """Write payloads into pool blocks (each of payload_bytes: the caller checked)."""
        if not block_ids:
            return
        if not self.transcode:  # straight from each payload into its block: one copy
            for block_id, payload in zip(block_ids, payloads, strict=True):
                row = np.frombuffer(payload, np.uint8)
                for part, column in enumerate(self._columns(row.reshape(1, -1))):
                    for layer, views in enumerate(self._pool):
                        views[part][:, block_id] = column[0, layer]
            return
        table = np.empty((len(block_ids), self.payload_bytes), np.uint8)
        for row, payload in zip(table, payloads, strict=True):
            row[:] = np.frombuffer(payload, np.uint8)
        columns = self._columns(table)
        num = len(block_ids)
        table_ids = torch.arange(num).view(-1, 1)
        slots = (torch.tensor(block_ids).view(-1, 1) * self.block_size + torch.arange(self.block_size)).flatten()
        for layer, storage in enumerate(self.cache.layers):
            staged = self.codec.allocate(num, self.block_size, torch.device("cpu"))
            for view, column in zip(_byte_views(staged), columns, strict=True):
                view[:] = column[:, layer].swapaxes(0, 1)
            k, v = self.codec.read(staged, table_ids)  # [n, kvh, bs, d]
            self.pool_codec.write(storage, slots, k.transpose(1, 2).flatten(0, 1), v.transpose(1, 2).flatten(0, 1))

    def _columns(self, table: np.ndarray) -> list[np.ndarray]:
        """The payload table [n, payload_bytes] as one view [n, layers, 2, ...] per part (no copy)."""
        columns, offset = [], 0
        for shape, size in zip(self._block_shapes, self._part_bytes, strict=True):
            column = table[:, offset: offset + size].reshape(len(table), self.num_layers, 2, *shape)
            assert np.shares_memory(column, table)  # a view: writes through it fill the table
            columns.append(column)
            offset += size
        return columns

    def _transcoded(self, ids: torch.Tensor) -> list:
        """The blocks re-encoded in the offload codec: one staging cache of len(ids) blocks per layer."""
        table = ids.view(-1, 1)
        slots = torch.arange(len(ids) * self.block_size)
        staged = []
        for storage in self.cache.layers:
            k, v = self.pool_codec.read(storage, table)  # [n, kvh, bs, d]
            target = self.codec.allocate(len(ids), self.block_size, torch.device("cpu"))
            self.codec.write(target, slots, k.transpose(1, 2).flatten(0, 1), v.transpose(1, 2).flatten(0, 1))
            staged.append(target)
        return staged
