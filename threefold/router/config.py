"""RouterConfig: every knob of the routing policies, with the defaults of the systems they copy."""

from __future__ import annotations

from dataclasses import dataclass

from threefold.errors import ThreefoldError


@dataclass(frozen=True, slots=True)
class RouterConfig:
    block_size: int = 16
    """Tokens per KV block; must match the engines' block size so keys align with their prefix cache."""
    key_tokens: int = 32
    """prefix_hash/DualMap key: the first this many tokens (block-aligned) of the prompt. Short, so a
    session keeps its key as its prompt grows (a prompt shorter than this is keyed by all its blocks)."""
    vnodes: int = 100
    """Virtual nodes per backend on each hash ring."""
    bounded_load_eps: float = 0.25
    """prefix_hash: a backend takes at most ceil((1+eps) * in-flight / n) requests (Mirrokni et al.)."""
    cache_capacity_blocks: int = 4096
    """Blocks the router assumes each backend's prefix cache holds (LRU beyond that)."""
    cache_threshold: float = 0.5
    """cache_aware: route to the best-matching backend when its match ratio exceeds this (SGLang default)."""
    balance_abs_threshold: int = 32
    """cache_aware: imbalanced when max - min in-flight > this ... (SGLang default)."""
    balance_rel_threshold: float = 1.0001
    """... and max > this * min (SGLang default)."""
    slo_s: float = 5.0
    """DualMap: the TTFT SLO in seconds (the paper's 5 s)."""
    tpct_s: float = 0.0005
    """DualMap: prefill seconds per uncached token (TTFT = tpct * miss tokens ahead and own). The
    starting value: `threefold bench calibrate` measures it (`threefold router --calibration FILE`)."""
    adapt_tpct: bool = True
    """DualMap: refit tpct to the TTFTs the router observes (least squares over the last
    ttft_window requests), so the SLO switch follows the machine's real speed and load."""
    hotspot_wait_s: float = 3.0
    """DualMap: an instance whose oldest queued request waited this long is a hotspot."""
    recent_prefill_s: float = 2.0
    """DualMap late binding: a busy instance still pulls if its last prefill ended within this."""
    ttft_window: int = 256
    """DualMap: observed TTFTs kept for the HIGH-priority p99 threshold."""
    seed: int = 0
    """Tie-breaking randomness (DualMap's random tie-break), for reproducible simulations."""

    def __post_init__(self) -> None:
        for name in ("block_size", "key_tokens", "vnodes", "cache_capacity_blocks", "ttft_window"):
            if getattr(self, name) < 1:
                raise ThreefoldError(f"router {name}={getattr(self, name)} must be >= 1", param=name)
        for name in ("bounded_load_eps", "slo_s", "tpct_s"):
            if getattr(self, name) <= 0:
                raise ThreefoldError(f"router {name}={getattr(self, name)} must be > 0", param=name)
        if not 0 <= self.cache_threshold <= 1:
            raise ThreefoldError(f"router cache_threshold={self.cache_threshold} must be in [0, 1]",
                                 param="cache_threshold")
