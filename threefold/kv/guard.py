"""The quality guard: `guard:BASE[>RUNG>RUNG...]` with a KL budget picks a per-layer codec mix.

    guard:kivi2                 ladder kivi2 > (kivi4, int8, auto: those holding more bytes than kivi2)
    guard:kivi2>kivi4>int8      an explicit ladder: never above int8 (a budget may then be unmeetable)

Calibration (threefold/engine/kv_guard.py) measures, layer by layer, the KL divergence a rung adds
against the `auto` cache when only that layer is compressed, scored through the cache. Then
`choose_levels` spends the budget:

The budget is a TOTAL, mean added KL (nats per token) of the whole mix, not a per-layer share.
Small independent errors in different layers add to first order, so a mix's KL is predicted as
the sum of its layers' KLs, and picking each layer's rung is a multiple-choice knapsack: fewest
bytes such that the summed KL fits. The greedy starts every layer on the base rung and, while
the sum is over budget, moves up the layer whose next rung removes the most KL per byte added
(lazily: a layer's next rung is only measured once its KL-per-byte upper bound, current KL /
bytes added, is the best in the queue). Harmless layers thus stay compressed however many
others need help. The calibration then measures the chosen mix as a whole and tightens the
target if the sum under-predicted it.

Plain Python (config validates guard specs, and config must not import torch).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from threefold.errors import ThreefoldError
from threefold.kv.mix import UNMIXED, is_mix, parse_mix
from threefold.kv.spec import KVSpec, parse_kv_spec

PREFIX = "guard:"
DEFAULT_RUNGS = ("kivi4", "int8", "auto")
"""Candidates above the base when the ladder is not given: those that hold more bytes per block
than the base, in order of bytes (int8 is within 0.1% of auto's perplexity on SmolLM2, kivi4
within 0.7%: BENCHMARKS.md "KV-cache compression")."""


@dataclass(frozen=True)
class GuardSpec:
    base: KVSpec
    rungs: tuple[KVSpec, ...] | None
    """Explicit rungs above the base, lowest precision first; None: DEFAULT_RUNGS by bytes."""

    def __str__(self) -> str:
        return PREFIX + ">".join(str(s) for s in (self.base, *(self.rungs or ())))


def is_guard(text: str) -> bool:
    return isinstance(text, str) and text.strip().lower().startswith(PREFIX)


def parse_guard(text: str) -> GuardSpec:
    parts = text.strip()[len(PREFIX):].split(">")
    if any(not p.strip() or is_guard(p) or is_mix(p) for p in parts):
        raise ThreefoldError(f"kv_cache_dtype {text!r}: write guard:BASE or guard:BASE>RUNG>... with plain codec "
                             f"specs (e.g. guard:kivi2 or guard:kivi2>kivi4>int8).", param="kv_cache_dtype")
    specs = [parse_kv_spec(p) for p in parts]  # raises for unknown codecs, listing the choices
    if any(s.name in UNMIXED for s in specs):
        raise ThreefoldError(f"kv_cache_dtype {text!r}: the guard mixes codecs per layer, and "
                             f"{', '.join(UNMIXED)} cannot be mixed; use it alone.", param="kv_cache_dtype")
    if len({str(s) for s in specs}) < len(specs):
        raise ThreefoldError(f"kv_cache_dtype {text!r}: a codec appears twice in the ladder.", param="kv_cache_dtype")
    return GuardSpec(specs[0], tuple(specs[1:]) or None)


def validate_kv_cache_dtype(text: str, budget: float | None) -> None:
    """Check a plain spec, a mix or a guard spec with its budget; raise a ThreefoldError naming the fix."""
    if is_guard(text):
        parse_guard(text)
        if budget is None:
            raise ThreefoldError(f"kv_cache_dtype {text!r} needs kv_quality_budget (--kv-quality-budget), the "
                                 f"mean KL divergence (nats per token) the mix may add against auto, e.g. 0.01.",
                                 param="kv_quality_budget")
    elif budget is not None:
        raise ThreefoldError(f"kv_quality_budget applies to guard: specs only (e.g. guard:kivi2); "
                             f"kv_cache_dtype is {text!r}.", param="kv_quality_budget")
    elif is_mix(text):
        parse_mix(text)
    else:
        parse_kv_spec(text)
    if budget is not None and not budget > 0:
        raise ThreefoldError(f"kv_quality_budget must be a positive KL in nats per token (e.g. 0.01), got {budget}.",
                             param="kv_quality_budget")


def choose_levels(num_layers: int, rung_bytes: list[int], measure: Callable[[int, int], float],
                  target: float, start: list[int] | None = None) -> tuple[list[int], float]:
    """Each layer's rung index so that the summed KL is at most `target`, greedily by KL per byte
    (see the module docstring). `measure(layer, rung)` is called at most once per pair by the
    caller's cache. Returns the levels and the predicted (summed) KL; raises if even the top
    rung everywhere is over the target."""
    levels = list(start) if start is not None else [0] * num_layers
    top = len(rung_bytes) - 1
    total = sum(measure(layer, level) for layer, level in enumerate(levels))
    queue: list[tuple[float, int, bool]] = []  # (-KL removed per byte, layer, exact?)

    def push_bound(layer: int) -> None:
        level = levels[layer]
        if level < top:
            heapq.heappush(queue, (-measure(layer, level) / (rung_bytes[level + 1] - rung_bytes[level]), layer, False))

    for layer in range(num_layers):
        push_bound(layer)
    while total > target and queue:
        _, layer, exact = heapq.heappop(queue)
        level = levels[layer]
        gain = measure(layer, level) - measure(layer, level + 1)
        if not exact:  # now measured: back in the queue at its true KL per byte
            heapq.heappush(queue, (-gain / (rung_bytes[level + 1] - rung_bytes[level]), layer, True))
            continue
        levels[layer] += 1
        total -= gain
        push_bound(layer)
    if total > target:
        raise ThreefoldError(f"kv_quality_budget cannot be met: with every layer on the ladder's top rung the "
                             f"layers add {total:.4g} nats/token of KL (target {target:.4g}); raise the budget or "
                             f"add a higher-precision rung to the ladder (e.g. >auto).", param="kv_quality_budget")
    return levels, total
