"""Attention over KIVI (kivi2/kivi4, tiered, GEAR, turboquant) blocks plus each request's full-precision window.

A request with n tokens reads positions < nq(n) from its quantized blocks and the rest from
its window, where (R = residual, B = block_size, a multiple of KIVI's group G)

    nq(n) = max(start, floor_B(n - L)),  L = max(0, R - B + 1)      start: tokens it began with (a prefix hit)

(kv/window.py: quantized_len), so between R - B + 1 and R recent tokens stay exact, and a
token's representation changes exactly when its block leaves the window. Each query row p of a
chunk sees the cache as it stands after p + 1 tokens (nq(p + 1)), as if decoded one token at a
time: chunking and batching do not change what a row attends over.

In a per-layer codec mix (kv/mix.py) this object serves the windowed layers only: each layer
reads its own codec (and residual), and its window lives in ring row `rows[layer]`.

Per layer: first every request writes (encodes the blocks its new tokens complete, and puts
the tokens in its ring), then every request attends, so a block published for a prefix hit
in this very step is encoded before any request reads it.

Two paths compute the same thing (chosen per step, logged once):

    native kernels  kernels/kivi_attention.cpp reads the packed blocks in place (kivi2/kivi4 and
                    tiered): all decode rows of a step in one call over the rings;
                    kernels/kivi_prefill.cpp takes each prefill chunk in one call over its
                    exact K/V, decoding each key tile once for a tile of rows, and encodes the
                    blocks a step completes (kivi_encode: the torch quantizer's codes, bit for bit).
                    GEAR: kernels/gear_attention.cpp, for the decode rows (one call over the rings)
                    and each prefill chunk (one call over its exact K/V) alike, decodes each block
                    tile (codes + Q P^T + outliers) to fp32 inside the kernel; its blocks are
                    encoded in torch (`GearCodec.encode`) as they leave the window.
                    turboquant: kernels/tq_attention.cpp's tq_window_attention, the decode rows in
                    one call over the rings and each chunk in one call over its exact K/V (its rows
                    share every key they decode, 16 rows at a time); blocks encoded in torch
    plain torch     blocks dequantized (`read_blocks`) and one masked SDPA per request: the
                    reference, for tests and machines without a compiler

A decode-only step over kivi2 / kivi4 in every layer also carries `decode_step` (model.llama's
KiviDecodeStep): the model then runs every layer in one native call (kernels/decode_layers.cpp's
decode_layers_kivi), which makes the native path's writes, encodes and kernel calls in the same order.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from threefold.kv.codecs.tiered import FINE_BITS, TieredCodec
from threefold.kv.paged import PagedKVCache
from threefold.kv.window import Window, WindowArena, WindowedCodec, quantized_len
from threefold.model.llama import KiviDecodeStep

logger = logging.getLogger(__name__)

_ROWS = 256
_NONE = torch.empty(0, dtype=torch.uint8)
"""kivi_prefill_attention's band and sinks where a codec has none (KIVI)."""
"""Query rows per SDPA call: bounds the [H, rows, keys] scores of a long first chunk."""
NATIVE_KINDS = ("kivi", "tiered", "gear", "turboquant")
"""The layouts the native kernels read in place."""
KINDS = ("quantized", "middle", "sink", "exact")
"""Where a key of the reference path comes from: its block (2 bits for `tiered`: far), `tiered`'s 4-bit
band, its sinks, or the window (exact)."""


@dataclass
class KiviRequest:
    query_start: int
    query_len: int
    context_len: int
    block_ids: torch.Tensor
    """[num_blocks] covering context + chunk."""
    window: Window


@dataclass
class Written:
    """What `_write` leaves a request's attention: the exact K/V of positions [lo, ctx + len) and
    (`tiered`) the low bit planes of positions [band_lo, band_lo + len(k_low))."""

    lo: int
    k: torch.Tensor
    v: torch.Tensor
    band_lo: int = 0
    k_low: torch.Tensor | None = None
    v_low: torch.Tensor | None = None


@dataclass
class _StepPlan:
    plain: list[int]
    """Requests written through `_write` (chunks, and decodes that complete a block)."""
    ring_writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    """The other decodes' query rows, ring slots and ring rows."""
    decodes: list[int]
    decode_args: dict[int, tuple[torch.Tensor, ...]]
    prefill_meta: dict[tuple[int, int], torch.Tensor] = dataclasses.field(default_factory=dict)
    """(request, residual) -> a chunk's row meta for kivi_prefill_attention."""


class KiviAttention:
    """The AttentionFn over a KIVI cache for one step."""

    tiled_prefill = True
    """Native path: blocks encoded by kivi_encode and chunks attended by kivi_prefill_attention. False: the
    previous path, blocks encoded in torch and chunks through the decode kernel row by row (kept for
    benchmarks/kv_codecs.py --prefill, which times both)."""

    def __init__(self, cache: PagedKVCache, arena: WindowArena, requests: list[KiviRequest], scale: float,
                 residual: int | None = None, rows: dict[int, int] | None = None,
                 kernels: ModuleType | None = None) -> None:
        self.cache = cache
        self.arena = arena
        self.requests = requests
        self.scale = scale
        self.residual = residual
        """Overrides every layer's codec residual (None: each layer's own)."""
        self.rows = rows
        """Layer -> its ring row in the arena (None: row = layer, every layer windowed)."""
        self.kernels = kernels
        """The native build (kivi_attention), or None: the plain-torch path."""
        self._plan: _StepPlan | None = None
        self.block_size = cache.block_size
        self.decode_step = self._decode_step()
        """Where every row decodes over kivi2 / kivi4 layers of one residual: the model runs its layers
        in one native call (model.llama.KiviDecodeStep), which computes exactly what this object does."""

    def _decode_step(self) -> KiviDecodeStep | None:
        requests, cache = self.requests, self.cache
        if (self.kernels is None or not hasattr(self.kernels, "decode_layers_kivi") or self.rows is not None
                or self.residual is not None or not requests
                or any(r.query_len != 1 or r.query_start != i for i, r in enumerate(requests))):
            return None
        layouts = [cache.layout(layer) for layer in range(len(cache.codecs))]
        residuals = {self._codec(layer).residual for layer in range(len(layouts))}
        if any(layout.kind != "kivi" for layout in layouts) or len(residuals) != 1:
            return None
        _, tables, meta = self._decode_args(residuals.pop(), None)
        done = self._step_plan().plain  # in a decode-only step: the rows whose token completes a block
        device = self.arena.ring.device
        return KiviDecodeStep(
            [t for layout in layouts for t in _block_tensors(layout)],
            [self._ring(layer) for layer in range(len(layouts))], tables, meta,
            torch.tensor(done, dtype=torch.long, device=device),
            torch.tensor([int(requests[i].block_ids[requests[i].context_len // self.block_size]) for i in done],
                         dtype=torch.long, device=device), self.scale)

    def _codec(self, layer_idx: int) -> WindowedCodec:
        codec = self.cache.codecs[layer_idx]
        assert codec.window_tokens(self.block_size), f"layer {layer_idx} has no window ({codec.spec})"
        return codec  # type: ignore[return-value]  # a windowed codec (asserted)

    def quantized_len(self, window: Window, n: int, residual: int) -> int:
        """nq(n): tokens of n read from the blocks."""
        return quantized_len(n, residual, self.block_size, window.start)

    def middle_len(self, window: Window, n: int, residual: int, middle: int) -> int:
        """nm(n) (`tiered`): tokens of n read at 2 bits; [nm, nq) are the 4-bit middle band."""
        return max(window.start, self.quantized_len(window, n, residual) - middle)

    def sink_len(self, codec: TieredCodec, window: Window) -> int:
        """`tiered`'s exact sinks for a request: `codec.sink`, none after a prefix hit (whose shared tokens,
        sinks included, read at 2 bits)."""
        return codec.sink if window.start == 0 else 0

    def _row(self, layer_idx: int) -> int:
        return layer_idx if self.rows is None else self.rows[layer_idx]

    def _ring(self, layer_idx: int) -> torch.Tensor:
        return self.arena.ring[self._row(layer_idx)]  # [2, slots, size, kvh, d]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        codec = self._codec(layer_idx)
        residual = codec.residual if self.residual is None else self.residual
        layout = self.cache.layout(layer_idx) if self.kernels is not None else None
        native = layout is not None and layout.kind in NATIVE_KINDS
        _log_path(native)
        spans = [slice(r.query_start, r.query_start + r.query_len) for r in self.requests]
        out = torch.empty_like(q)
        if native:
            exact = self._write_native(layer_idx, codec, residual, k, v, spans)
            self._attend_native(layer_idx, codec, layout, residual, q, exact, out)
            return out
        dense = [self._write(layer_idx, codec, residual, r, k[span], v[span])
                 for r, span in zip(self.requests, spans, strict=True)]
        for r, span, written in zip(self.requests, spans, dense, strict=True):
            out[span] = self._attend(layer_idx, codec, residual, r, q[span], written)
        return out

    def _write_native(self, layer_idx: int, codec: WindowedCodec, residual: int, k: torch.Tensor, v: torch.Tensor,
                      spans: list[slice]) -> dict[int, Written]:
        """The native path's writes: decodes that complete no block only put their token in the ring
        (one indexed copy for all of them: the kernel reads the rings); every other request goes
        through `_write`, whose exact K/V (by request index) a prefill chunk's kernel call reads."""
        plain = self._step_plan().plain
        dense = {i: self._write(layer_idx, codec, residual, self.requests[i], k[spans[i]], v[spans[i]])
                 for i in plain}
        rows, slots, positions = self._step_plan().ring_writes
        if len(rows):
            ring = self._ring(layer_idx)
            ring[:, slots, positions] = torch.stack([k.index_select(0, rows), v.index_select(0, rows)]).to(ring.dtype)
        return dense

    def _write(self, layer_idx: int, codec: WindowedCodec, residual: int, r: KiviRequest, k: torch.Tensor,
               v: torch.Tensor) -> Written:
        """Encode completed blocks, update the ring (and a tiered codec's band and sinks); return the
        exact K/V of positions [lo, ctx + len) and the low planes the chunk's rows read."""
        ctx, hi, bs, size = r.context_len, r.context_len + r.query_len, self.block_size, self.arena.size
        ring = self._ring(layer_idx)[:, r.window.slot]  # [2, size, kvh, d]
        k, v = k.to(ring.dtype), v.to(ring.dtype)  # the window's precision (kv/window.py: window_dtype)
        lo = min(ctx - ctx % bs, self.quantized_len(r.window, ctx + 1, residual))
        before = ring.index_select(1, torch.arange(lo, ctx, device=k.device) % size)
        dk, dv = torch.cat([before[0], k]), torch.cat([before[1], v])
        first, last = ctx // bs, hi // bs  # blocks this chunk completes
        tiered = codec if isinstance(codec, TieredCodec) else None
        if tiered:  # the band's planes still needed, read before this chunk's blocks overwrite any
            band = self.arena.band[self._row(layer_idx), :, r.window.slot]  # [2, band, kvh, d / 4]
            band_lo = min(self.middle_len(r.window, ctx + 1, residual, tiered.middle), first * bs)
            lows = [band.index_select(1, torch.arange(band_lo, first * bs, device=k.device) % self.arena.band_size)]
        if last > first:
            rows = slice(first * bs - lo, last * bs - lo)
            blocks = (last - first, bs, *k.shape[1:])
            low = self._encode(layer_idx, codec, r.block_ids[first:last], dk[rows].reshape(blocks),
                               dv[rows].reshape(blocks))
            if tiered:
                assert low is not None
                new = torch.stack([t.flatten(0, 1) for t in low])
                band.index_copy_(1, torch.arange(first * bs, last * bs, device=k.device) % self.arena.band_size, new)
                lows.append(new)
                if first == 0 and r.window.start == 0 and tiered.sink:  # block 0 leaves the ring's care: sinks
                    sinks = self.arena.sinks[self._row(layer_idx), :, r.window.slot]
                    sinks.copy_(torch.stack([dk[:tiered.sink], dv[:tiered.sink]]))
        keep = max(lo, hi - size)
        slots = torch.arange(keep, hi, device=k.device) % size
        ring[0].index_copy_(0, slots, dk[keep - lo:])
        ring[1].index_copy_(0, slots, dv[keep - lo:])
        if not tiered:
            return Written(lo, dk, dv)
        planes = torch.cat(lows, dim=1)
        return Written(lo, dk, dv, band_lo, planes[0], planes[1])

    def _encode(self, layer_idx: int, codec: WindowedCodec, block_ids: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """codec.encode (whole blocks k, v [n, bs, kvh, d]); natively (kivi_encode, the same codes, scales
        and zeros) for the layouts the kernels read. Returns tiered's low planes."""
        layout = self.cache.layout(layer_idx) if self.kernels is not None else None
        if layout is None or layout.kind not in ("kivi", "tiered") or not self.tiled_prefill:
            return codec.encode(self.cache.layers[layer_idx], block_ids, k, v)
        assert self.kernels is not None
        tiered = layout.kind == "tiered"
        low = torch.empty(2, *k.shape[:3], k.shape[3] // 4, dtype=torch.uint8, device=k.device) if tiered else _NONE
        self.kernels.kivi_encode(layout.k, layout.v, layout.k_scales, layout.k_zeros, layout.v_scales, layout.v_zeros,
                                 block_ids, k.contiguous(), v.contiguous(),
                                 FINE_BITS if tiered else layout.k.shape[-1] * 8 // k.shape[-1], low)
        return (low[0], low[1]) if tiered else None

    def _step_plan(self) -> _StepPlan:
        """What the native path needs of the step, the same in every layer: built at the first."""
        if self._plan is None:
            bs, size, device = self.block_size, self.arena.size, self.arena.ring.device
            lazy = [i for i, r in enumerate(self.requests) if r.query_len == 1 and (r.context_len + 1) % bs]
            reqs = [self.requests[i] for i in lazy]
            self._plan = _StepPlan(
                [i for i in range(len(self.requests)) if i not in set(lazy)],
                (torch.tensor([r.query_start for r in reqs], dtype=torch.long, device=device),
                 torch.tensor([r.window.slot for r in reqs], dtype=torch.long, device=device),
                 torch.tensor([r.context_len % size for r in reqs], dtype=torch.long, device=device)),
                [i for i, r in enumerate(self.requests) if r.query_len == 1], {})
        return self._plan

    def _decode_args(self, residual: int, tiered: TieredCodec | None) -> tuple[torch.Tensor, ...]:
        """The decode rows' query rows, block tables [rows, width], meta [4, rows] and (tiered) tier
        meta [5, rows] (per residual)."""
        plan = self._step_plan()
        if residual not in plan.decode_args:
            reqs, device = [self.requests[i] for i in plan.decodes], self.arena.ring.device
            width = max(len(r.block_ids) for r in reqs)
            tables = torch.zeros(len(reqs), width, dtype=torch.long, device=device)
            for row, r in enumerate(reqs):
                tables[row, : len(r.block_ids)] = r.block_ids
            lens = [r.context_len + 1 for r in reqs]
            rows = torch.tensor([r.query_start for r in reqs], device=device)
            meta = torch.tensor([[self.quantized_len(r.window, n, residual) for r, n in zip(reqs, lens, strict=True)],
                                 lens, [r.window.slot for r in reqs], [0] * len(reqs)], device=device)
            tier = [] if tiered is None else [self._tier_meta(tiered, residual, r, [n], r.window.slot, 0)
                                               for r, n in zip(reqs, lens, strict=True)]
            plan.decode_args[residual] = (rows, tables, meta, *([torch.cat(tier, 1)] if tier else []))
        return plan.decode_args[residual]

    def _tier_meta(self, codec: TieredCodec, residual: int, r: KiviRequest, lens: list[int] | range, band_row: int,
                   band_base: int) -> torch.Tensor:
        """tiered_attention's rows for request r at lengths `lens`: nm, band slot, band base, sinks, sinks slot."""
        nq = [self.quantized_len(r.window, n, residual) for n in lens]
        sinks = self.sink_len(codec, r.window)
        return torch.tensor([[self.middle_len(r.window, n, residual, codec.middle) for n in lens], [band_row] * len(nq),
                             [band_base] * len(nq), [min(sinks, x) for x in nq], [r.window.slot] * len(nq)],
                            device=self.arena.ring.device)

    def _attend_native(self, layer_idx: int, codec: WindowedCodec, layout, residual: int, q: torch.Tensor,
                       dense: dict[int, Written], out: torch.Tensor) -> None:
        """Every decode row in one kernel call over the rings; each prefill chunk in one call over
        its exact K/V [lo, hi) (a chunk longer than the ring has overwritten rows it still needs) and,
        tiered, the low planes `_write` gathered (the band ring may have lost some the same way)."""
        device = q.device
        tiered = codec if isinstance(codec, TieredCodec) else None
        row = self._row(layer_idx)
        sinks = self.arena.sinks[row]
        if self._step_plan().decodes:
            rows, tables, meta, *tier = self._decode_args(residual, tiered)
            extra = (self.arena.band[row], sinks, *tier) if tier else ()
            first, n = int(rows[0]), len(rows)
            if int(rows[-1]) - first == n - 1:  # the runner puts decodes first, in order: views
                self._kernel(layout, out[first:first + n], q[first:first + n], self._ring(layer_idx), tables, meta,
                             *extra)
            else:
                result = torch.empty(n, *q.shape[1:], dtype=q.dtype, device=device)
                self._kernel(layout, result, q.index_select(0, rows), self._ring(layer_idx), tables, meta, *extra)
                out.index_copy_(0, rows, result)
        for i, r in enumerate(self.requests):
            if r.query_len == 1:
                continue
            span = slice(r.query_start, r.query_start + r.query_len)
            chunk = (self._chunk_gear if layout.kind == "gear" else
                     self._chunk_tiled if self.tiled_prefill and layout.kind != "turboquant" else self._chunk_rowwise)
            chunk(i, layout, residual, tiered, sinks, q[span], dense[i], out[span])

    def _chunk_tiled(self, i: int, layout, residual: int, tiered: TieredCodec | None, sinks: torch.Tensor,
                     q: torch.Tensor, written: Written, out: torch.Tensor) -> None:
        """Request i's prefill chunk through kivi_prefill_attention: key tiles decoded once for tiles of rows."""
        assert self.kernels is not None
        r, band, sink_rows = self.requests[i], _NONE, _NONE
        if tiered is not None:
            assert written.k_low is not None and written.v_low is not None
            band = torch.stack([written.k_low, written.v_low])  # [2, planes, kvh, d / 4]
            sink_rows = sinks[:, r.window.slot].contiguous()
        self.kernels.kivi_prefill_attention(
            out, q, layout.k, layout.v, layout.k_scales, layout.k_zeros, layout.v_scales, layout.v_zeros, written.k,
            written.v, written.lo, r.block_ids, self._prefill_meta(i, residual, tiered), r.context_len, band,
            written.band_lo, sink_rows, tiered is not None, self.scale)

    def _chunk_gear(self, i: int, layout, residual: int, tiered: TieredCodec | None, sinks: torch.Tensor,
                    q: torch.Tensor, written: Written, out: torch.Tensor) -> None:
        """Request i's prefill chunk through gear_attention: one table for every row, its exact K/V [lo, hi)
        read in place (one slot, base lo), key tiles decoded once for tiles of rows."""
        r = self.requests[i]
        nq = self._prefill_meta(i, residual, None)[0]
        ns = torch.arange(r.context_len + 1, r.context_len + r.query_len + 1, device=q.device)
        meta = torch.stack([nq, ns, torch.zeros_like(ns), torch.full_like(ns, written.lo)])
        self._gear(layout, out, q, written.k.unsqueeze(0), written.v.unsqueeze(0), r.block_ids.unsqueeze(0), meta)

    def _gear(self, layout, out: torch.Tensor, q: torch.Tensor, exact_k: torch.Tensor, exact_v: torch.Tensor,
              tables: torch.Tensor, meta: torch.Tensor) -> None:
        """gear_attention (kernels/gear_attention.cpp): exact_k, exact_v [slots, size, kvh, d]; tables [rows or 1,
        width]; meta [4, rows]: quantized lengths, seq lengths, exact slots, exact bases."""
        assert self.kernels is not None
        self.kernels.gear_attention(out, q, layout.k, layout.v, layout.k_scales, layout.k_zeros, layout.v_scales,
                                    layout.v_zeros, *layout.aux, exact_k, exact_v, tables, meta, self.scale)

    def _chunk_rowwise(self, i: int, layout, residual: int, tiered: TieredCodec | None, sinks: torch.Tensor,
                       q: torch.Tensor, written: Written, out: torch.Tensor) -> None:
        """Request i's prefill chunk through the decode kernel, its rows sharing one block table (KIVI's kernel:
        every row decodes its whole context; turboquant's: rows decode each key once, 16 rows at a time)."""
        r, device = self.requests[i], q.device
        ns = range(r.context_len + 1, r.context_len + r.query_len + 1)
        meta = torch.tensor([[self.quantized_len(r.window, n, residual) for n in ns], list(ns),
                             [0] * len(ns), [written.lo] * len(ns)], device=device)
        tables = r.block_ids.unsqueeze(0).expand(len(ns), -1).contiguous()
        extra: tuple[torch.Tensor, ...] = ()
        if tiered is not None:
            assert written.k_low is not None and written.v_low is not None
            band = torch.stack([written.k_low, written.v_low]).unsqueeze(1)  # [2, 1, planes, kvh, d / 4]
            if not band.shape[2]:  # no middle band yet: the kernel reads none of it
                band = torch.zeros(2, 1, 1, *band.shape[3:], dtype=band.dtype, device=device)
            extra = (band, sinks, self._tier_meta(tiered, residual, r, ns, 0, written.band_lo))
        self._kernel(layout, out, q, torch.stack([written.k, written.v]).unsqueeze(1), tables, meta, *extra)

    def _prefill_meta(self, i: int, residual: int, tiered: TieredCodec | None) -> torch.Tensor:
        """kivi_prefill_attention's row meta [3, rows] for request i's chunk: nq, nm, ns per row (the same
        in every layer of a residual: built once)."""
        plan = self._step_plan()
        if (i, residual) not in plan.prefill_meta:
            r = self.requests[i]
            ns = range(r.context_len + 1, r.context_len + r.query_len + 1)
            nq = torch.tensor([self.quantized_len(r.window, n, residual) for n in ns], device=self.arena.ring.device)
            if tiered is None:
                meta = torch.stack([nq, nq, torch.zeros_like(nq)])
            else:
                tier = self._tier_meta(tiered, residual, r, ns, 0, 0)  # its rows nm and ns
                meta = torch.stack([nq, tier[0], tier[3]])
            plan.prefill_meta[i, residual] = meta
        return plan.prefill_meta[i, residual]

    def _kernel(self, layout, out: torch.Tensor, q: torch.Tensor, ring: torch.Tensor, tables: torch.Tensor,
                meta: torch.Tensor, *tier: torch.Tensor) -> None:
        """meta [4, rows]: quantized lengths, seq lengths, ring slots, ring bases; tier (tiered): band,
        sinks and tier meta [5, rows] (see kernels/kivi_attention.cpp). GEAR: gear_attention over the rings;
        turboquant: kernels/tq_attention.cpp."""
        assert self.kernels is not None
        if layout.kind == "gear":
            self._gear(layout, out, q, ring[0], ring[1], tables, meta)
            return
        if layout.kind == "turboquant":
            self.kernels.tq_window_attention(out, q, layout.k, layout.v, *layout.aux, ring, tables, *meta, self.scale)
            return
        args = (out, q, layout.k, layout.v, layout.k_scales, layout.k_zeros, layout.v_scales, layout.v_zeros, ring,
                tables, *meta)
        if tier:
            self.kernels.tiered_attention(*args, *tier, self.scale)
        else:
            self.kernels.kivi_attention(*args, self.scale)

    def _attend(self, layer_idx: int, codec: WindowedCodec, residual: int, r: KiviRequest, q: torch.Tensor,
                written: Written) -> torch.Tensor:
        ctx, hi, bs, device = r.context_len, r.context_len + r.query_len, self.block_size, q.device
        num_quantized = self.quantized_len(r.window, hi, residual)
        storage = self.cache.layers[layer_idx]
        kq, vq = codec.read_blocks(storage, r.block_ids[: num_quantized // bs])
        parts = [(kq, vq, torch.arange(num_quantized, device=device), "quantized")]
        middle, sinks = 0, 0
        if isinstance(codec, TieredCodec):  # the 4-bit band and the sinks
            assert written.k_low is not None and written.v_low is not None
            middle, band_lo = codec.middle, written.band_lo
            if num_quantized > band_lo:
                n = num_quantized - band_lo
                km, vm = codec.refine(kq[band_lo:], vq[band_lo:], storage,
                                      r.block_ids[band_lo // bs: num_quantized // bs], written.k_low[:n],
                                      written.v_low[:n])
                parts.append((km, vm, torch.arange(band_lo, num_quantized, device=device), "middle"))
            sinks = min(self.sink_len(codec, r.window), num_quantized)
            if sinks:
                exact = self.arena.sinks[self._row(layer_idx), :, r.window.slot, :sinks].to(kq.dtype)
                parts.append((exact[0], exact[1], torch.arange(sinks, device=device), "sink"))
        parts.append((written.k.to(kq.dtype), written.v.to(kq.dtype), torch.arange(written.lo, hi, device=device),
                      "exact"))
        keys = torch.cat([p[0] for p in parts]).transpose(0, 1).unsqueeze(0)  # [1, kvh, keys, d]
        values = torch.cat([p[1] for p in parts]).transpose(0, 1).unsqueeze(0)
        key_pos = torch.cat([p[2] for p in parts])
        kind = torch.cat([torch.full((len(p[2]),), KINDS.index(p[3]), device=device) for p in parts])
        out = torch.empty_like(q)
        for start in range(0, r.query_len, _ROWS):
            rows = torch.arange(ctx + start, min(ctx + start + _ROWS, hi), device=device)  # positions
            ns = [p + 1 for p in rows.tolist()]
            nq = torch.tensor([self.quantized_len(r.window, n, residual) for n in ns], device=device)[:, None]
            nm = torch.tensor([self.middle_len(r.window, n, residual, middle) for n in ns],
                              device=device)[:, None] if middle else nq
            ns_row = nq.clamp(max=sinks)  # exact sinks below min(S, nq)
            t = key_pos.unsqueeze(0)
            below, sink = t < nq, t < ns_row
            mask = torch.where(kind == KINDS.index("quantized"), (t < nm) & ~sink,
                   torch.where(kind == KINDS.index("middle"), (t >= nm) & below & ~sink,
                   torch.where(kind == KINDS.index("sink"), sink, ~below & (t <= rows.unsqueeze(1)))))
            attn = F.scaled_dot_product_attention(q[start : start + len(rows)].transpose(0, 1).unsqueeze(0), keys,
                                                  values, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[start : start + len(rows)] = attn[0].transpose(0, 1)
        return out


def _block_tensors(layout) -> tuple[torch.Tensor, ...]:
    """A "kivi" layout's packed blocks in kivi_attention's order: codes K, V, then K scales, zeros, V scales, zeros."""
    parts = (layout.k, layout.v, layout.k_scales, layout.k_zeros, layout.v_scales, layout.v_zeros)
    assert all(t is not None for t in parts), "a kivi layout has scales and zeros"
    return parts


@functools.cache
def _log_path(native: bool) -> None:
    logger.info("KIVI attention: %s", "native kernels (blocks read in place)" if native else
                "plain-torch reference path (blocks dequantized per step)")


def build_kivi_attention(cache: PagedKVCache, arena: WindowArena, order, query_starts: list[int],
                         query_lens: list[int], block_ids, scale: float, rows: dict[int, int] | None = None,
                         kernels: ModuleType | None = None) -> KiviAttention:
    """One step's KiviAttention; `block_ids(state)` lists a request's blocks."""
    requests = []
    for state, start, n in zip(order, query_starts, query_lens, strict=True):
        ctx = state.num_computed_tokens
        num_blocks = -(-(ctx + n) // cache.block_size)
        ids = torch.tensor(block_ids(state)[:num_blocks], dtype=torch.long, device=arena.ring.device)
        requests.append(KiviRequest(start, n, ctx, ids, arena.acquire(state.request_id, ctx)))
    return KiviAttention(cache, arena, requests, scale, rows=rows, kernels=kernels)
