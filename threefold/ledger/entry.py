"""One finished request's savings ledger: what it computed, what each technique saved (plain Python).

Method (the estimate, stated once; README "Savings ledger" repeats it):

- Time comes from the step-cost model `cost(n)`: measured seconds of one forward
  of n tokens on this machine (threefold.spec.adaptive.StepCostModel, profiled
  at server start, refined online when adaptive speculation runs). A request's
  compute is estimated *as if it ran alone*: one prefill forward of the prompt
  tokens it computed, plus one forward per target step of its decode. Batching
  shares steps between requests, so at high load this overstates a request's
  own share; the savings are in the same unit, so the ratios stay meaningful.
- Prefix cache (L1) and each KV tier: their hit tokens were not prefilled, so
  they saved `cost(computed + hits) - cost(computed)` (attributed in the order
  L1, then tiers, each on top of what was computed).
- Speculation: the request made `steps = output - accepted` target forwards
  instead of `output`. Each verify forward carried `k = drafts / steps` draft
  queries on average. Saved = `accepted * cost(1)` minus the verify overhead
  `steps * (cost(1 + k) - cost(1))` minus the draft cost `drafts * draft_s`
  (the proposer's measured seconds per draft; 0 when not measured). It can be
  negative: speculation that costs more than it saves shows as a loss.
- KV bytes: tokens whose KV the request stored (prompt + output) x bytes per
  token, under the served codec and under the model's dtype (codec "auto").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

TECHNIQUE_PREFIX = "prefix_cache"
TECHNIQUE_SPEC = "speculation"
TECHNIQUE_CODEC = "kv_codec"
TIER_PREFIX = "kv_tier:"
"""Tier techniques are named kv_tier:<tier> once the engine reports hits per tier."""


@dataclass(frozen=True)
class CostBasis:
    """What the ledger prices requests with: the served configuration and the cost model."""

    cost: Callable[[int], float]
    """Seconds of one forward of n tokens (StepCostModel)."""
    kv_bytes_per_token: float
    """Under the served codec, all layers."""
    dtype_bytes_per_token: float
    """At the model's dtype (codec "auto"), all layers."""
    kv_cache_dtype: str
    techniques: tuple[str, ...]
    """Techniques this server runs (prefix_cache, speculation, kv_codec); tiers join when they report."""
    draft_seconds_per_token: Callable[[], float] = lambda: 0.0


@dataclass
class LedgerEntry:
    """The ledger of one finished engine request. Token counts are exact; seconds are estimates."""

    prompt_tokens: int
    prompt_tokens_computed: int
    prompt_tokens_prefix_cache: int
    output_tokens: int
    output_tokens_from_drafts: int
    draft_tokens_rejected: int
    kv_bytes: float
    kv_bytes_at_dtype: float
    compute_s: float
    saved_s: dict[str, float]
    """Technique -> estimated seconds it saved (only techniques this server runs)."""
    prompt_tokens_by_tier: dict[str, int] | None = field(default=None)
    """Tier -> prompt tokens loaded from it; None until the engine reports tiers."""
    finished_time: float = 0.0

    def to_dict(self) -> dict:
        prompt: dict = {"total": self.prompt_tokens, "computed": self.prompt_tokens_computed,
                        "prefix_cache": self.prompt_tokens_prefix_cache}
        if self.prompt_tokens_by_tier is not None:
            prompt["tiers"] = dict(self.prompt_tokens_by_tier)
        return {"prompt_tokens": prompt,
                "output_tokens": {"total": self.output_tokens, "from_accepted_drafts": self.output_tokens_from_drafts,
                                  "drafts_rejected": self.draft_tokens_rejected},
                "kv": {"bytes": self.kv_bytes, "bytes_at_model_dtype": self.kv_bytes_at_dtype},
                "time": {"compute_s": self.compute_s, "saved_s": dict(self.saved_s)}}


def make_entry(basis: CostBasis, prompt_tokens: int, output_tokens: int, cached_tokens: int,
               draft_tokens: int, accepted_tokens: int, tier_tokens: Mapping[str, int] | None = None,
               finished_time: float = 0.0) -> LedgerEntry:
    """The entry of a request from its counts (RequestOutput's: cached, drafts, accepted; tiers if any)."""
    tiers = dict(tier_tokens) if tier_tokens is not None else None
    computed = prompt_tokens - cached_tokens - sum((tiers or {}).values())
    cost = basis.cost
    steps = max(output_tokens - accepted_tokens, 0)
    compute = (cost(computed) if computed > 0 else 0.0) + _decode_seconds(cost, steps, draft_tokens)
    compute += draft_tokens * basis.draft_seconds_per_token()
    saved: dict[str, float] = {}
    done = computed
    if TECHNIQUE_PREFIX in basis.techniques:
        saved[TECHNIQUE_PREFIX] = _prefill_saving(cost, done, cached_tokens)
    done += cached_tokens
    for tier, hits in (tiers or {}).items():
        saved[TIER_PREFIX + tier] = _prefill_saving(cost, done, hits)
        done += hits
    if TECHNIQUE_SPEC in basis.techniques:
        overhead = _decode_seconds(cost, steps, draft_tokens) - steps * cost(1)
        saved[TECHNIQUE_SPEC] = accepted_tokens * cost(1) - overhead - draft_tokens * basis.draft_seconds_per_token()
    kv_tokens = prompt_tokens + output_tokens
    return LedgerEntry(prompt_tokens, computed, cached_tokens, output_tokens, accepted_tokens,
                       draft_tokens - accepted_tokens, kv_tokens * basis.kv_bytes_per_token,
                       kv_tokens * basis.dtype_bytes_per_token, compute, saved, tiers, finished_time)


def _prefill_saving(cost: Callable[[int], float], done: int, hits: int) -> float:
    if hits <= 0:
        return 0.0
    return cost(done + hits) - (cost(done) if done > 0 else 0.0)


def _decode_seconds(cost: Callable[[int], float], steps: int, drafts: int) -> float:
    """`steps` target forwards carrying `drafts` draft queries between them, spread evenly."""
    if steps <= 0:
        return 0.0
    whole, frac = divmod(drafts, steps)  # k = drafts / steps per forward, interpolated between integers
    per_step = cost(1 + whole)
    if frac:
        per_step += (cost(2 + whole) - per_step) * frac / steps
    return steps * per_step
