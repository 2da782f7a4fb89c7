"""The engine's side of the KV offload tiers: blocks <-> bytes, write-through, load-or-recompute.

    schedule:  Scheduler ──fetch(hashes)──► KVOffload: store.lookup, cost model, store.get → staged bytes
    execute:   runner ──load(blocks_to_load)──► staged bytes → pool blocks   (before the forward)
               runner ──store(blocks_to_store)──► pool blocks → bytes → store.put   (after the forward)

When blocks are stored: write-through, as each full block is published (after the forward that wrote
it), not on eviction. Persistence across restarts (L3) and sharing across instances (L4) need the data
below L1 while its owner is still alive; a demote-on-evict store would lose every block of a crashed
or restarted engine, and another instance could not see a prefix until the first evicted it. The
cost is one device-to-host copy per new block (one batched gather per step) and an async write;
the store dedupes blocks it already holds. A preempted request's full blocks are therefore already
in the store when it resumes, and the same cost model chooses loading them (swap) or recomputing.

Load or recompute, per request: loading block i costs its bytes over its tier's measured bandwidth;
recomputing the prefix costs the step-cost model's time for those tokens on top of the tokens
computed anyway. The prefix is cut before the first block whose tier makes loading slower.
"""

from __future__ import annotations

import torch

from threefold.kv.codec import KVCodec
from threefold.kv.codecs.scaled import ScaledStorage
from threefold.kv.paged import PagedKVCache
from threefold.kvstore import TieredKVStore
from threefold.spec.adaptive import StepCostModel


def _parts(storage: torch.Tensor | ScaledStorage) -> list[torch.Tensor]:
    """One layer's storage tensors, each [2, num_blocks, ...] (K and V first, blocks second)."""
    if isinstance(storage, torch.Tensor):
        return [storage]
    return [t for t in (storage.codes, storage.scales, storage.zeros) if t is not None]


class BlockCodec:
    """One block of every layer <-> bytes, in the offload codec. The same codec as the pool copies its
    raw storage (bit-exact); another codec (e.g. int8 below a bf16 pool) re-encodes through a staging
    cache of that codec: encode on store, decode into the pool's codec on load."""

    def __init__(self, cache: PagedKVCache, offload_codec: KVCodec) -> None:
        self.cache = cache
        self.pool_codec, self.codec = cache.codec, offload_codec
        self.transcode = str(offload_codec.spec) != str(cache.codec.spec)
        self.block_size = cache.block_size
        sample = offload_codec.allocate(1, self.block_size, torch.device("cpu"))
        self.part_shapes = [(p.dtype, p.shape[2:]) for p in _parts(sample)]
        self.num_layers = len(cache.layers)
        self.payload_bytes = self.num_layers * sum(
            2 * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            for dtype, shape in self.part_shapes)

    def encode(self, block_ids: list[int]) -> list[bytes]:
        """Payloads of the blocks, one gather per layer and part (the step's whole batch at once)."""
        ids = torch.tensor(block_ids, dtype=torch.long)
        layers = self._transcoded(ids) if self.transcode else self.cache.layers
        rows = ids if not self.transcode else torch.arange(len(block_ids))
        columns = []
        for part in range(len(self.part_shapes)):
            gathered = torch.stack([_parts(layer)[part].index_select(1, rows) for layer in layers])
            # [L, 2, n, ...] -> [n, L * 2 * ...] bytes
            columns.append(gathered.movedim(2, 0).contiguous().view(torch.uint8).reshape(len(block_ids), -1))
        table = torch.cat(columns, dim=1).numpy()
        return [table[i].tobytes() for i in range(len(block_ids))]

    def _transcoded(self, ids: torch.Tensor) -> list:
        table = ids.view(-1, 1)
        slots = torch.arange(len(ids) * self.block_size)
        staged = []
        for storage in self.cache.layers:
            k, v = self.pool_codec.read(storage, table)  # [n, kvh, bs, d]
            target = self.codec.allocate(len(ids), self.block_size, torch.device("cpu"))
            self.codec.write(target, slots, k.transpose(1, 2).flatten(0, 1), v.transpose(1, 2).flatten(0, 1))
            staged.append(target)
        return staged

    def decode_into(self, block_id: int, payload: bytes) -> None:
        """Write one payload into pool block `block_id` (validated by length by the caller)."""
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        pieces, offset = [], 0
        for dtype, shape in self.part_shapes:
            size = self.num_layers * 2 * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            pieces.append(flat[offset: offset + size].view(dtype).view(self.num_layers, 2, *shape))
            offset += size
        if not self.transcode:
            for layer, storage in enumerate(self.cache.layers):
                for part, piece in zip(_parts(storage), pieces, strict=True):
                    part[:, block_id].copy_(piece[layer])
            return
        slots = torch.arange(self.block_size) + block_id * self.block_size
        zero = torch.zeros(1, 1, dtype=torch.long)
        for layer, storage in enumerate(self.cache.layers):
            staged = self.codec.allocate(1, self.block_size, torch.device("cpu"))
            for part, piece in zip(_parts(staged), pieces, strict=True):
                part[:, 0].copy_(piece[layer])
            k, v = self.codec.read(staged, zero)  # [1, kvh, bs, d]
            self.pool_codec.write(storage, slots, k[0].transpose(0, 1), v[0].transpose(0, 1))


class KVOffload:
    """The scheduler's ExternalKV and the runner's load/store, over one TieredKVStore."""

    def __init__(self, store: TieredKVStore, codec: BlockCodec, block_size: int) -> None:
        self.store, self.codec, self.block_size = store, codec, block_size
        self.cost: StepCostModel | None = None
        """Measured forward time by tokens (None until the first step: loading is then assumed cheaper)."""
        self.staged: dict[str, list[tuple[bytes, str, bytes]]] = {}
        """request id -> (block hash, tier, payload) fetched for it, not yet loaded."""
        self.num_loaded = 0
        self.num_stored = 0
        self.num_load_rejected = 0
        """Blocks the cost model chose to recompute although a tier held them."""

    # ---- ExternalKV (the scheduler's calls) --------------------------------------
    def fetch(self, request_id: str, block_hashes: list[bytes], num_tokens_after: int) -> list[str]:
        staged = self.staged.get(request_id, [])
        if staged and [h for h, _, _ in staged] == block_hashes[: len(staged)]:
            return [tier for _, tier, _ in staged]  # a retry after no room: fetched already
        tiers = self._worth_loading(self.store.lookup(block_hashes), num_tokens_after)
        staged = []
        for block_hash in block_hashes[: len(tiers)]:
            got = self.store.get(block_hash)
            if got is None or len(got[1]) != self.codec.payload_bytes:
                break  # evicted or corrupt since the lookup: recompute from here
            staged.append((block_hash, got[0], got[1]))
        if staged:
            self.staged[request_id] = staged
        return [tier for _, tier, _ in staged]

    def release(self, request_id: str) -> None:
        self.staged.pop(request_id, None)

    def _worth_loading(self, tiers: list[str], num_tokens_after: int) -> list[str]:
        """The prefix of `tiers` whose loading saves the most time over recomputing it (none if none saves).
        The best prefix, not the first block where loading loses: the step-cost model is a running
        maximum of noisy samples, flat wherever one slow step sits, so the next 16 tokens can look free
        to recompute while the 2,000 after them cost seconds."""
        if self.cost is None or not tiers:
            return tiers
        base = self.cost(num_tokens_after)
        load_s, best, best_saving = 0.0, 0, 0.0
        for i, tier in enumerate(tiers):
            load_s += self.codec.payload_bytes / max(self.store.bandwidth(tier), 1.0)
            saving = self.cost(num_tokens_after + (i + 1) * self.block_size) - base - load_s
            if saving > best_saving:
                best, best_saving = i + 1, saving
        self.num_load_rejected += len(tiers) - best
        return tiers[:best]

    # ---- the runner's calls ------------------------------------------------------
    def load(self, blocks: list[tuple[int, bytes]], request_ids: list[str]) -> None:
        """Fill the scheduled loads' pool blocks from the staged payloads (before the forward)."""
        if not blocks:
            return
        payloads = {h: p for rid in request_ids for h, _, p in self.staged.pop(rid, [])}
        for block_id, block_hash in blocks:
            self.codec.decode_into(block_id, payloads[block_hash])
        self.num_loaded += len(blocks)

    def store_blocks(self, blocks: list[tuple[int, bytes]]) -> None:
        """Write-through of the blocks published this step (after the forward wrote them)."""
        if not blocks:
            return
        for (_, block_hash), payload in zip(blocks, self.codec.encode([b for b, _ in blocks]), strict=True):
            self.store.put(block_hash, payload)
        self.num_stored += len(blocks)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        if self.cost is None:
            self.cost = StepCostModel({num_tokens: seconds})
        else:
            self.cost.observe(num_tokens, seconds)

    def close(self) -> None:
        self.store.close()

