"""Attention over KIVI blocks plus each request's full-precision window (plain torch reference).

A request with n tokens reads positions < nq(n) from its quantized blocks and the rest from
its window, where (R = residual, B = block_size, a multiple of KIVI's group G)

    nq(n) = max(start, floor_B(n - R))      start: tokens it began with (a prefix hit)

so between R and R + B - 1 recent tokens stay exact, and a token's representation changes
exactly when its block leaves the window. Each query row p of a chunk sees the cache as it
stands after p + 1 tokens (nq(p + 1)), as if decoded one token at a time: chunking and
batching do not change what a row attends over.

In a per-layer codec mix (kv/mix.py) this object serves the windowed layers only: each layer
reads its own codec (and residual), and its window lives in ring row `rows[layer]`.

Per layer: first every request writes (encodes the blocks its new tokens complete, and puts
the tokens in its ring), then every request attends, so a block published for a prefix hit
in this very step is encoded before any request reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from threefold.kv.paged import PagedKVCache
from threefold.kv.window import Window, WindowArena, WindowedCodec

_ROWS = 256
"""Query rows per SDPA call: bounds the [H, rows, keys] scores of a long first chunk."""


@dataclass
class KiviRequest:
    query_start: int
    query_len: int
    context_len: int
    block_ids: torch.Tensor
    """[num_blocks] covering context + chunk."""
    window: Window


class KiviAttention:
    """The AttentionFn over a KIVI cache for one step."""

    def __init__(self, cache: PagedKVCache, arena: WindowArena, requests: list[KiviRequest], scale: float,
                 residual: int | None = None, rows: dict[int, int] | None = None) -> None:
        self.cache = cache
        self.arena = arena
        self.requests = requests
        self.scale = scale
        self.residual = residual
        """Overrides every layer's codec residual (None: each layer's own)."""
        self.rows = rows
        """Layer -> its ring row in the arena (None: row = layer, every layer windowed)."""
        self.block_size = cache.block_size

    def _codec(self, layer_idx: int) -> WindowedCodec:
        codec = self.cache.codecs[layer_idx]
        assert codec.window_tokens(self.block_size), f"layer {layer_idx} has no window ({codec.spec})"
        return codec  # type: ignore[return-value]  # a windowed codec (asserted)

    def quantized_len(self, window: Window, n: int, residual: int) -> int:
        """nq(n): tokens of n read from the blocks."""
        return max(window.start, (n - residual) // self.block_size * self.block_size)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        codec = self._codec(layer_idx)
        residual = codec.residual if self.residual is None else self.residual
        spans = [slice(r.query_start, r.query_start + r.query_len) for r in self.requests]
        dense = [self._write(layer_idx, codec, residual, r, k[span], v[span])
                 for r, span in zip(self.requests, spans, strict=True)]
        out = torch.empty_like(q)
        for r, span, (lo, dk, dv) in zip(self.requests, spans, dense, strict=True):
            out[span] = self._attend(layer_idx, codec, residual, r, q[span], lo, dk, dv)
        return out

    def _write(self, layer_idx: int, codec: WindowedCodec, residual: int, r: KiviRequest, k: torch.Tensor,
               v: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Encode completed blocks, update the ring; return the exact K/V of positions [lo, ctx + len)."""
        ctx, hi, bs, size = r.context_len, r.context_len + r.query_len, self.block_size, self.arena.size
        lo = min(ctx - ctx % bs, self.quantized_len(r.window, ctx + 1, residual))
        row = layer_idx if self.rows is None else self.rows[layer_idx]
        ring = self.arena.ring[row, :, r.window.slot]  # [2, size, kvh, d]
        before = ring.index_select(1, torch.arange(lo, ctx, device=k.device) % size)
        dk, dv = torch.cat([before[0], k]), torch.cat([before[1], v])
        first, last = ctx // bs, hi // bs  # blocks this chunk completes
        if last > first:
            rows = slice(first * bs - lo, last * bs - lo)
            blocks = (last - first, bs, *k.shape[1:])
            codec.encode(self.cache.layers[layer_idx], r.block_ids[first:last],
                              dk[rows].reshape(blocks), dv[rows].reshape(blocks))
        keep = max(lo, hi - size)
        slots = torch.arange(keep, hi, device=k.device) % size
        ring[0].index_copy_(0, slots, dk[keep - lo:])
        ring[1].index_copy_(0, slots, dv[keep - lo:])
        return lo, dk, dv

    def _attend(self, layer_idx: int, codec: WindowedCodec, residual: int, r: KiviRequest, q: torch.Tensor, lo: int,
                dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
        ctx, hi = r.context_len, r.context_len + r.query_len
        num_quantized = self.quantized_len(r.window, hi, residual)
        kq, vq = codec.read_blocks(self.cache.layers[layer_idx], r.block_ids[: num_quantized // self.block_size])
        keys = torch.cat([kq, dk]).transpose(0, 1).unsqueeze(0)  # [1, kvh, keys, d]
        values = torch.cat([vq, dv]).transpose(0, 1).unsqueeze(0)
        device = q.device
        key_pos = torch.cat([torch.arange(num_quantized, device=device), torch.arange(lo, hi, device=device)])
        is_quantized = torch.arange(len(key_pos), device=device) < num_quantized
        out = torch.empty_like(q)
        for start in range(0, r.query_len, _ROWS):
            rows = torch.arange(ctx + start, min(ctx + start + _ROWS, hi), device=device)  # positions
            nq = torch.tensor([self.quantized_len(r.window, p + 1, residual) for p in rows.tolist()], device=device)
            below = key_pos.unsqueeze(0) < nq.unsqueeze(1)
            mask = torch.where(is_quantized, below, ~below & (key_pos.unsqueeze(0) <= rows.unsqueeze(1)))
            attn = F.scaled_dot_product_attention(q[start : start + len(rows)].transpose(0, 1).unsqueeze(0), keys,
                                                  values, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[start : start + len(rows)] = attn[0].transpose(0, 1)
        return out


def build_kivi_attention(cache: PagedKVCache, arena: WindowArena, order, query_starts: list[int],
                         query_lens: list[int], block_ids, scale: float,
                         rows: dict[int, int] | None = None) -> KiviAttention:
    """One step's KiviAttention; `block_ids(state)` lists a request's blocks."""
    requests = []
    for state, start, n in zip(order, query_starts, query_lens, strict=True):
        ctx = state.num_computed_tokens
        num_blocks = -(-(ctx + n) // cache.block_size)
        ids = torch.tensor(block_ids(state)[:num_blocks], dtype=torch.long, device=arena.ring.device)
        requests.append(KiviRequest(start, n, ctx, ids, arena.acquire(state.request_id, ctx)))
    return KiviAttention(cache, arena, requests, scale, rows=rows)
