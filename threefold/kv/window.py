"""Full-precision windows: the recent tokens of each running request that a windowed codec
(KIVI) keeps in full precision beside its quantized blocks: the model's dtype, fp16 for fp32
models (`window_dtype`).

A window of residual R over blocks of B tokens (a multiple of KIVI's group) holds at most
max(R, B) tokens: a complete block is read quantized once keeping it exact would leave more than R
exact tokens (`quantized_len`), so between R - B + 1 and R recent tokens stay exact (R >= B), as
KIVI's own residual never exceeds R (its keys keep 0..R-1, its values R).

    ring   [num_layers, 2, num_slots, size, kvh, d]        position p of a request lives at p % size
    band   [num_layers, 2, num_slots, band, kvh, d / 4]    `tiered`: low bit planes, at p % band
    sinks  [num_layers, 2, num_slots, sink, kvh, d]        `tiered`: the first tokens, exact

One slot per running request, taken when it is first scheduled and given back when it
finishes or is preempted. The arena is carved from the same kv_cache_memory as the blocks,
so its slot count bounds how many requests run at once (`window_slots`); its share of the budget
is planned for max_model_len requests (`arena_share`). The split is fixed at startup: windows
and blocks are separate tensors, so an idle window's bytes cannot hold blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from threefold.errors import ThreefoldError

ARENA_SHARE = (0.25, 0.5)
"""Bounds of the arena's share of the budget (the rest holds the blocks). Within them the share is
planned so that every window comes with the blocks of one max_model_len request: W / (W + blocks),
which gives the most concurrent requests at that length. The floor keeps long-context engines
at 3/4 of the budget in blocks (kivi2 then holds up to 0.75 x 5.3 = 4x bf16's sequences at long
contexts); the ceiling keeps short ones from starving the blocks (a window of R tokens in
the model's dtype weighs as much as ~5 R kivi2 tokens)."""


def window_lag(residual: int, block_size: int) -> int:
    """L such that a request of n tokens reads floor_B(n - L) of them from its blocks: R - B + 1
    (at most R exact), or 0 for R < B (every complete block is read quantized)."""
    return max(0, residual - block_size + 1)


def window_size(residual: int, block_size: int) -> int:
    """Ring tokens a request needs per windowed layer: the most its window holds exact."""
    return max(residual, block_size)


def quantized_len(n: int, residual: int, block_size: int, start: int = 0) -> int:
    """nq(n): tokens of a request of n read from its quantized blocks (start: the tokens it began
    with, a prefix hit, read quantized)."""
    return max(start, (n - window_lag(residual, block_size)) // block_size * block_size)


def arena_share(bytes_per_slot: int, plan_bytes: int) -> float:
    """The arena's share of the budget for windows of `bytes_per_slot` beside requests whose blocks
    take `plan_bytes` (one max_model_len request; 0: unknown, the ceiling)."""
    low, high = ARENA_SHARE
    return min(high, max(low, bytes_per_slot / (bytes_per_slot + plan_bytes)))


def window_dtype(compute: torch.dtype) -> torch.dtype:
    """The windows' dtype: the model's, but fp16 where it computes in fp32. KIVI's "full precision"
    is fp16 (its models run in fp16); fp32 windows would double the bytes that bound how many
    requests run at once, for a rounding (2^-11 relative) below what the 2/4-bit blocks add."""
    return torch.float16 if compute == torch.float32 else compute


def window_slots(budget: int, bytes_per_slot: int, max_num_seqs: int, plan_bytes: int = 0) -> int:
    """How many windows the budget gives (never more than max_num_seqs); raises when not one fits.
    plan_bytes: the blocks of one max_model_len request (`arena_share`)."""
    share = arena_share(bytes_per_slot, plan_bytes)
    slots = min(max_num_seqs, int(budget * share) // bytes_per_slot)
    if slots < 1:
        raise ThreefoldError(f"kv_cache_memory={budget} bytes cannot hold one request's full-precision window "
                             f"({bytes_per_slot} bytes, at most {share:.0%} of the budget); raise "
                             f"kv_cache_memory or lower the codec's residual.", param="kv_cache_memory")
    return slots


@dataclass(frozen=True)
class ArenaShape:
    """What one running request keeps beside its blocks, per windowed layer (tokens)."""

    layers: int
    size: int
    band: int = 0
    sink: int = 0

    @staticmethod
    def of(codecs: list, block_size: int) -> ArenaShape:
        """The arena of a cache whose layers have these codecs (KVCodec); layers 0: no windows."""
        windowed = [c for c in codecs if c.window_tokens(block_size)]
        if not windowed:
            return ArenaShape(0, 0)
        return ArenaShape(len(windowed), max(c.window_tokens(block_size) for c in windowed),
                          max(c.band_tokens(block_size) for c in windowed), max(c.sink_tokens() for c in windowed))

    def bytes_per_slot(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return self.layers * 2 * num_kv_heads * ((self.size + self.sink) * head_dim * element
                                                 + self.band * head_dim // 4)


class WindowedCodec(Protocol):
    """A codec read through a window (KIVI, GEAR, turboquant with residual > 0): whole blocks are
    encoded once all their tokens are known, and read back densely (worker/kivi_attention.py)."""

    residual: int

    def encode(self, storage: Any, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        """Write whole blocks; `tiered` returns their low bit planes (K, V), the others None."""

    def read_blocks(self, storage: Any, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class Window:
    slot: int
    start: int
    """Tokens the request had when it got the slot (a prefix hit): those are read quantized."""
    filled: int
    """Tokens written so far (the request's context)."""


class WindowArena:
    def __init__(self, shape: ArenaShape, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.size = shape.size
        self.band_size = shape.band
        self.ring = torch.zeros(shape.layers, 2, num_slots, shape.size, num_kv_heads, head_dim, dtype=dtype,
                                device=device)
        self.band = torch.zeros(shape.layers, 2, num_slots, shape.band, num_kv_heads, head_dim // 4,
                                dtype=torch.uint8, device=device)
        self.sinks = torch.zeros(shape.layers, 2, num_slots, shape.sink, num_kv_heads, head_dim, dtype=dtype,
                                 device=device)
        self.free = list(range(num_slots - 1, -1, -1))
        self.windows: dict[str, Window] = {}

    def acquire(self, request_id: str, start: int) -> Window:
        window = self.windows.get(request_id)
        if window is None:
            assert self.free, "more running requests than windows (max_num_seqs is bounded by the arena)"
            window = self.windows[request_id] = Window(self.free.pop(), start, start)
        assert window.filled == start, (request_id, window, start)  # the window holds every token so far
        return window

    def release(self, request_id: str) -> None:
        window = self.windows.pop(request_id, None)
        if window is not None:
            self.free.append(window.slot)
