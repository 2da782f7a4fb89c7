"""KVCacheManager: which blocks each request holds, prefix-cache lookups, slot allocation."""

from __future__ import annotations

from dataclasses import dataclass

from threefold.core.block_pool import BlockPool, KVCacheBlock
from threefold.core.hashing import extend_block_hashes, seed_hash
from threefold.core.request import Request


@dataclass
class PrefixCacheStats:
    """Cumulative token counts: how many prompt tokens were looked up, how many hit."""

    queries: int = 0
    hits: int = 0


class KVCacheManager:
    """Hands blocks to requests. Rules:

    - `allocate_slots` either reserves everything asked or returns None and
      changes nothing (the scheduler then preempts);
    - a block is published to the prefix cache when the tokens that fill it
      are scheduled: another request may hit it in the same step, which is
      safe because every layer writes the step's K/V before it attends;
    - `free` releases blocks tail first, so a prefix outlives its suffixes.
    """

    def __init__(self, num_blocks: int, block_size: int, model_fingerprint: str,
                 enable_caching: bool = True, kv_cache_spec: str = "auto", record_events: bool = False) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, record_events)
        self.seed = seed_hash(model_fingerprint, kv_cache_spec)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def capacity_tokens(self) -> int:
        return (self.pool.num_blocks - 1) * self.block_size

    def usage(self) -> float:
        return self.pool.usage()

    def update_hashes(self, request: Request) -> None:
        if self.enable_caching:
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, self.seed)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request: (blocks, number of tokens).

        At least the last token is always left to compute, since its logits
        are needed. Requests asking for prompt logprobs skip the cache.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self.update_hashes(request)
        tokens = request.all_token_ids
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            start = i * self.block_size
            block = self.pool.get_cached_block(block_hash, tuple(tokens[start : start + self.block_size]))
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup once its request is actually scheduled."""
        self.stats.queries += num_query_tokens
        self.stats.hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Reserve slots for `num_new_tokens` (+ lookahead for speculative drafts).

        `num_external_computed_tokens` (whole blocks, after the local hit) are
        loaded from the KV offload store instead of computed: they get the
        first of the new blocks, and are published like computed ones.
        Returns the newly allocated blocks, or None (nothing changed) when the
        pool cannot hold them.
        """
        computed = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = (request.num_computed_tokens + len(computed) * self.block_size
                        + num_external_computed_tokens)
        num_required = -(-(num_computed + num_new_tokens + num_lookahead_tokens) // self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(computed))
        num_revived = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_revived:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(computed)
        blocks.extend(computed)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        if self.enable_caching:
            # Drafts are unverified: only tokens known to be in the sequence are published.
            self._cache_full_blocks(request, blocks, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def allocate_for_load(self, request: Request, computed_blocks: list[KVCacheBlock],
                          num_external_blocks: int) -> list[KVCacheBlock] | None:
        """Hold the local hit and `num_external_blocks` new blocks for a prefix read from a KV offload tier
        in the background; the new ones (returned) are published only by `publish` once they are loaded.
        None (nothing changed) when the pool cannot hold them."""
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_external_blocks > self.pool.num_free_blocks - num_revived:
            return None
        self.pool.touch(computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_external_blocks)
        self.req_to_blocks[request.request_id] = [*computed_blocks, *new_blocks]
        return new_blocks

    def publish(self, request: Request, num_tokens: int) -> None:
        """Publish the request's full blocks up to `num_tokens` (loaded ones: their KV is in this step)."""
        if self.enable_caching:
            self._cache_full_blocks(request, self.req_to_blocks[request.request_id], num_tokens)

    def full_blocks(self, request: Request) -> list[tuple[int, bytes]]:
        """(block_id, hash) of the request's blocks whose every token is computed (what a swap keeps)."""
        num_full = request.num_computed_tokens // self.block_size
        blocks = self.req_to_blocks.get(request.request_id, [])[:num_full]
        return [(b.block_id, h) for b, h in zip(blocks, request.block_hashes[:num_full], strict=False)]

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return
        self.update_hashes(request)
        tokens = request.all_token_ids
        for i in range(num_cached, num_full):
            start = i * self.block_size
            self.pool.cache_block(blocks[i], request.block_hashes[i], tuple(tokens[start : start + self.block_size]))
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def trim(self, request: Request) -> int | None:
        """Free the request's blocks past its computed tokens (the slots of rejected drafts and the
        unused lookahead); returns how many blocks it keeps, or None when it held no more. Published
        blocks are never trimmed: only tokens known to be in the sequence are published, all computed."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = -(-request.num_computed_tokens // self.block_size)
        if blocks is None or len(blocks) <= keep:
            return None
        extra = blocks[keep:]
        assert all(b.block_hash is None for b in extra), "a published block past the computed tokens"
        del blocks[keep:]
        self.pool.free_blocks(reversed(extra))
        return keep

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
