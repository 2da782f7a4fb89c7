"""Full-precision windows: the recent tokens of each running request that a windowed codec
(KIVI) keeps in the model's dtype beside its quantized blocks.

    ring   [num_layers, 2, num_slots, size, kvh, d]   position p of a request lives at p % size

One slot per running request, taken when it is first scheduled and given back when it
finishes or is preempted. The arena is carved from the same kv_cache_memory as the blocks,
so its slot count bounds how many requests run at once (`window_slots`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from threefold.errors import ThreefoldError

ARENA_FRACTION = 0.5
"""The arena takes at most this share of the budget: the rest holds the blocks. (A window of
R + B tokens in bf16 weighs as much as ~5 R kivi2 tokens: a larger share buys concurrency with
context, a smaller one context with concurrency; half keeps both within 2x of their best.)"""


def window_slots(budget: int, bytes_per_slot: int, max_num_seqs: int) -> int:
    """How many windows the budget gives (never more than max_num_seqs); raises when not one fits."""
    slots = min(max_num_seqs, int(budget * ARENA_FRACTION) // bytes_per_slot)
    if slots < 1:
        raise ThreefoldError(f"kv_cache_memory={budget} bytes cannot hold one request's full-precision window "
                             f"({bytes_per_slot} bytes, at most {ARENA_FRACTION:.0%} of the budget); raise "
                             f"kv_cache_memory or lower the codec's residual.", param="kv_cache_memory")
    return slots


class WindowedCodec(Protocol):
    """A codec read through a window (KIVI, GEAR, turboquant with residual > 0): whole blocks are
    encoded once all their tokens are known, and read back densely (worker/kivi_attention.py)."""

    residual: int

    def encode(self, storage: Any, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def read_blocks(self, storage: Any, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class Window:
    slot: int
    start: int
    """Tokens the request had when it got the slot (a prefix hit): those are read quantized."""
    filled: int
    """Tokens written so far (the request's context)."""


class WindowArena:
    def __init__(self, num_layers: int, num_slots: int, size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.size = size
        self.ring = torch.zeros(num_layers, 2, num_slots, size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.free = list(range(num_slots - 1, -1, -1))
        self.windows: dict[str, Window] = {}

    @staticmethod
    def bytes_per_slot(num_layers: int, size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

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
