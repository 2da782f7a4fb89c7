"""The quality guard's startup calibration: `guard:BASE` + a KL budget -> a per-layer codec mix.

    reference   score the calibration text with the `auto` cache
    per layer   score it again with only layer l on rung r (every other layer auto): layer l's
                added KL on that rung (rung `auto` adds exactly 0: not run)
    choose      kv/guard.py choose_levels: fewest bytes whose summed KL fits the budget
    verify      score the chosen mix as a whole; if the sum under-predicted it, tighten and repeat

Scoring goes THROUGH the cache: prefill chunks of CHUNK tokens, so every chunk after the first
reads its context back from the compressed blocks (KIVI rows read what decoding would: quantized
below nq, the window exact), on real engines over the already-loaded weights. The budget is the
mean KL per calibration position (nats), as benchmarks/kv_codecs.py reports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from threefold.config import CacheConfig
from threefold.errors import ThreefoldError
from threefold.kv.guard import DEFAULT_RUNGS, GuardSpec, choose_levels, is_guard, parse_guard
from threefold.kv.mix import mix_text
from threefold.kv.registry import make_codec
from threefold.kv.spec import KVSpec, parse_kv_spec
from threefold.model.loader import LoadedModel

logger = logging.getLogger(__name__)

CALIBRATION_TOKENS = 1024
"""Tokens of calibration text (one context): long enough that most positions read KIVI's
quantized blocks (R + B = 160 tokens stay exact) and short enough to score ~40 times at startup."""
CHUNK = 64
"""Prefill chunk of a calibration run (the benchmark's protocol)."""
MIN_TOKENS = 16
VERIFY_ROUNDS = 3
"""Whole-mix measurements at most; each tightens the target when the per-layer sum under-predicted."""


@dataclass
class GuardResult:
    """What the calibration chose and measured (logged at startup, exported in /metrics)."""

    guard: str
    budget: float
    mix: str
    layer_specs: list[str]
    layer_kl: list[float]
    """Each layer's added KL on its chosen rung (alone; the rest auto)."""
    predicted_kl: float
    measured_kl: float
    """KL of the whole chosen mix against auto, measured."""
    num_tokens: int
    num_runs: int
    seconds: float


def resolve_guard(loaded: LoadedModel, cache: CacheConfig, max_model_len: int) -> tuple[CacheConfig, GuardResult | None]:
    """A guard: cache config calibrated into its mix (other configs pass through unchanged)."""
    if not is_guard(cache.kv_cache_dtype):
        return cache, None
    assert cache.kv_quality_budget is not None  # CacheConfig checks it
    limit = min(CALIBRATION_TOKENS, max_model_len - 1)
    tokens = calibration_tokens(loaded.tokenizer, cache.kv_guard_calibration, limit)
    result = calibrate(loaded, parse_guard(cache.kv_cache_dtype), cache.kv_quality_budget, tokens, cache.block_size)
    logger.info("KV guard %s, budget %.4g nats/token: chose %s (predicted KL %.4g, measured %.4g; "
                "%d calibration tokens, %d runs, %.1f s)", result.guard, result.budget, result.mix,
                result.predicted_kl, result.measured_kl, result.num_tokens, result.num_runs, result.seconds)
    resolved = dataclasses.replace(cache, kv_cache_dtype=result.mix, kv_quality_budget=None, kv_guard_calibration=None)
    return resolved, result


def calibration_tokens(tokenizer, path: str | None, limit: int) -> list[int]:
    """`limit` tokens of the user's file, or of ShareGPT train-split conversations (seed 0)."""
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise ThreefoldError(f"kv_guard_calibration: cannot read {path!r} ({exc.strerror}).",
                                 param="kv_guard_calibration") from None
        ids = tokenizer.encode(text)[:limit]
    else:
        from threefold.bench.sharegpt import dialogue, open_sharegpt
        ids = []
        for record in open_sharegpt().iter_records("train", seed=0):
            for user, assistant in dialogue(record):
                ids += tokenizer.encode(f"User: {user}\nAssistant: {assistant}\n")
            if len(ids) >= limit:
                break
        ids = ids[:limit]
    if len(ids) < MIN_TOKENS:
        raise ThreefoldError(f"kv_guard_calibration: {len(ids)} tokens of calibration text; give at least "
                             f"{MIN_TOKENS} (a few paragraphs; {CALIBRATION_TOKENS} are used).",
                             param="kv_guard_calibration")
    return ids


def ladder(guard: GuardSpec, config, block_size: int) -> tuple[list[KVSpec], list[int]]:
    """The rungs, lowest precision first, and their bytes per block (one layer). Default rungs
    are those of DEFAULT_RUNGS that hold more bytes than the base; given rungs must hold more
    bytes each than the one before (the KIVI window is per request, not per token: not counted)."""
    def block_bytes(spec: KVSpec) -> int:
        codec = make_codec(spec, config.num_kv_heads, config.head_dim, config.dtype)
        codec.check_block_size(block_size)
        return codec.bytes_per_block(block_size)

    base = block_bytes(guard.base)
    if guard.rungs is None:
        above = [(block_bytes(s), s) for s in map(parse_kv_spec, DEFAULT_RUNGS) if str(s) != str(guard.base)]
        chosen = sorted((b, str(s), s) for b, s in above if b > base)
        return [guard.base, *(s for _, _, s in chosen)], [base, *(b for b, _, _ in chosen)]
    specs, sizes = [guard.base, *guard.rungs], [base, *map(block_bytes, guard.rungs)]
    for lower, higher, a, b in zip(specs, specs[1:], sizes, sizes[1:], strict=False):
        if b <= a:
            raise ThreefoldError(f"kv_cache_dtype {guard}: rung {higher} holds {b} bytes per block, not more than "
                                 f"{lower} ({a}); order the ladder from fewest bytes to most.", param="kv_cache_dtype")
    return specs, sizes


class _Scorer:
    """Runs calibration engines over the loaded weights; KL against the `auto` reference."""

    def __init__(self, loaded: LoadedModel, tokens: list[int], block_size: int) -> None:
        self.loaded, self.tokens, self.block_size = loaded, tokens, block_size
        self.num_runs = 0
        self.reference = self.distributions("auto")

    def distributions(self, spec: str) -> torch.Tensor:
        from threefold.engine.llm import LLM
        from threefold.engine.llm_engine import EngineArgs, LLMEngine

        config = self.loaded.config
        element = torch.empty((), dtype=config.dtype).element_size()
        per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * element  # auto's
        # room for the context twice over in any codec, plus one full-precision window (< 2k tokens)
        memory = per_token * (2 * len(self.tokens) + 4 * self.block_size + 4096)
        args = EngineArgs(kv_cache_dtype=spec, block_size=self.block_size, max_num_batched_tokens=CHUNK,
                          enable_prefix_caching=False, kv_cache_memory=memory, max_num_seqs=1,
                          max_model_len=len(self.tokens) + self.block_size)
        with _quiet():
            llm = LLM.from_engine(LLMEngine(self.loaded, args))
            self.num_runs += 1
            return llm.score_distributions([self.tokens])[0]

    def kl(self, spec: str) -> float:
        """Mean KL(auto || spec) per position, nats."""
        p, q = self.reference, self.distributions(spec)
        return float((p.exp() * (p - q)).sum(-1).mean())


@contextlib.contextmanager
def _quiet():
    """Calibration engines would log their startup ~40 times: keep only warnings meanwhile."""
    root = logging.getLogger("threefold")
    level = root.level
    root.setLevel(logging.WARNING)
    try:
        yield
    finally:
        root.setLevel(level)


def calibrate(loaded: LoadedModel, guard: GuardSpec, budget: float, tokens: list[int],
              block_size: int) -> GuardResult:
    start = time.perf_counter()
    config = loaded.config
    rungs, rung_bytes = ladder(guard, config, block_size)
    scorer = _Scorer(loaded, tokens, block_size)
    layer_kl: dict[tuple[int, int], float] = {}

    def measure(layer: int, level: int) -> float:
        if (layer, level) not in layer_kl:
            specs = [parse_kv_spec("auto")] * config.num_layers
            specs[layer] = rungs[level]
            text = mix_text(specs)
            layer_kl[layer, level] = 0.0 if text == "auto" else scorer.kl(text)
        return layer_kl[layer, level]

    levels, target, predicted, measured = None, budget, 0.0, 0.0
    for _ in range(VERIFY_ROUNDS):
        levels, predicted = choose_levels(config.num_layers, rung_bytes, measure, target, levels)
        mix = mix_text([rungs[level] for level in levels])
        measured = 0.0 if mix == "auto" else scorer.kl(mix)
        if measured <= budget:
            break
        target = predicted * budget / measured  # the sum under-predicted: ask it for proportionally less
    else:
        logger.warning("KV guard: the chosen mix measures %.4g nats/token, over the budget %.4g after %d rounds",
                       measured, budget, VERIFY_ROUNDS)
    assert levels is not None
    specs = [rungs[level] for level in levels]
    return GuardResult(str(guard), budget, mix_text(specs), [str(s) for s in specs],
                       [measure(layer, level) for layer, level in enumerate(levels)], predicted, measured,
                       len(tokens), scorer.num_runs, time.perf_counter() - start)
