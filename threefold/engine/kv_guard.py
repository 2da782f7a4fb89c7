"""The quality guard's startup calibration: `guard:BASE` + a KL budget -> a per-layer codec mix.

    probe       each layer alone on rung r, every other layer exact (worker/layer_probe.py: the
                layers before it computed once, the whole text at once, each row reading K/V as
                the cache returns them): layer l's added KL on rung r (rung `auto`: exactly 0)
    choose      kv/guard.py choose_levels: fewest bytes whose summed KL fits the budget
    verify      score the chosen mix as a whole on real engines, THROUGH the cache (prefill
                chunks of CHUNK tokens: later chunks read the earlier ones back from the
                compressed blocks), against the `auto` engine; if the sum under-predicted it,
                tighten the target and choose again

The budget is the mean KL per calibration position (nats), as benchmarks/kv_codecs.py reports it;
the measured (verified) value is what is logged and exported. A result is kept under
$THREEFOLD_HOME/kv_guard, so a restart with the same weights, spec, budget and text reuses it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from threefold.config import CacheConfig
from threefold.env import Env
from threefold.errors import ThreefoldError
from threefold.kv.guard import DEFAULT_RUNGS, GuardSpec, choose_levels, is_guard, parse_guard
from threefold.kv.mix import mix_text
from threefold.kv.registry import make_codec
from threefold.kv.spec import KVSpec, parse_kv_spec
from threefold.model.loader import LoadedModel
from threefold.worker.layer_probe import LayerProbe

logger = logging.getLogger(__name__)

CALIBRATION_TOKENS = 512
"""Tokens of calibration text (one context): long enough that most positions read KIVI's
quantized blocks (at most R = 128 tokens stay exact) and short enough to score ~40 times at startup."""
CHUNK = 128
"""Prefill chunk of a calibration run: later chunks read the earlier ones back from the cache.
(Every codec here attends over what its cache returns even within a chunk, the round trip
or KIVI's per-row window, so the chunk size trades only speed; checked in tests/test_kv_guard.py.)"""
MIN_TOKENS = 16
FORMAT = 2
"""Version of the calibration protocol in the result cache's key (bump when measuring changes)."""
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
    num_probes: int
    """Per-layer measurements (a forward from that layer on, over the whole text)."""
    num_engine_runs: int
    """Runs of real engines through the cache: the auto reference and each whole-mix check."""
    seconds: float


def resolve_guard(loaded: LoadedModel, cache: CacheConfig, max_model_len: int,
                  num_tokens: int = CALIBRATION_TOKENS) -> tuple[CacheConfig, GuardResult | None]:
    """A guard: cache config calibrated into its mix (other configs pass through unchanged)."""
    if not is_guard(cache.kv_cache_dtype):
        return cache, None
    assert cache.kv_quality_budget is not None  # CacheConfig checks it
    limit = min(num_tokens, max_model_len - 1)
    tokens = calibration_tokens(loaded.tokenizer, cache.kv_guard_calibration, limit)
    guard = parse_guard(cache.kv_cache_dtype)
    path = _result_path(loaded, guard, cache.kv_quality_budget, tokens, cache.block_size)
    result = _load(path)
    if result is None:
        result = calibrate(loaded, guard, cache.kv_quality_budget, tokens, cache.block_size)
        _save(path, result)
    else:
        logger.info("KV guard: calibration read from %s", path)
    logger.info("KV guard %s, budget %.4g nats/token: chose %s (predicted KL %.4g, measured %.4g; "
                "%d calibration tokens, %d layer probes, %d engine runs, %.1f s)", result.guard, result.budget,
                result.mix, result.predicted_kl, result.measured_kl, result.num_tokens, result.num_probes,
                result.num_engine_runs, result.seconds)
    resolved = dataclasses.replace(cache, kv_cache_dtype=result.mix, kv_quality_budget=None, kv_guard_calibration=None)
    return resolved, result


def _result_path(loaded: LoadedModel, guard: GuardSpec, budget: float, tokens: list[int], block_size: int) -> Path:
    """Where a calibration's result is kept: the same weights, ladder, budget, text and block size
    choose the same mix, so a restart reads it instead of scoring ~40 times again."""
    key = json.dumps([FORMAT, loaded.fingerprint, str(loaded.config.dtype), str(guard), budget, block_size,
                      CHUNK, tokens])
    return Env.read().home / "kv_guard" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _load(path: Path) -> GuardResult | None:
    try:
        return GuardResult(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None  # absent or unreadable: calibrate


def _save(path: Path, result: GuardResult) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(result)))
        tmp.replace(path)
    except OSError as exc:  # a read-only home only costs the next start a calibration
        logger.warning("KV guard: could not keep the calibration in %s (%s)", path, exc)


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
        above = []
        for spec in map(parse_kv_spec, DEFAULT_RUNGS):
            try:
                above.append((block_bytes(spec), spec))
            except ThreefoldError:  # a default rung this model or block size cannot hold: not a candidate
                continue
        chosen = sorted((b, str(s), s) for b, s in above if b > base and str(s) != str(guard.base))
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
        start = time.perf_counter()
        with _quiet():
            llm = LLM.from_engine(LLMEngine(self.loaded, args))
            self.num_runs += 1
            scored = llm.score_distributions([self.tokens])[0]
        logger.debug("KV guard: scored %s in %.1f s", spec, time.perf_counter() - start)
        return scored

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
    codecs = [make_codec(spec, config.num_kv_heads, config.head_dim, config.dtype) for spec in rungs]
    probe = LayerProbe(loaded.model, tokens, block_size)
    layer_kl: dict[tuple[int, int], float] = {}

    def measure(layer: int, level: int) -> float:
        if (layer, level) not in layer_kl:  # auto reads exactly what the reference read: 0, not probed
            layer_kl[layer, level] = 0.0 if str(rungs[level]) == "auto" else probe.kl(layer, codecs[level])
        return layer_kl[layer, level]

    scorer: _Scorer | None = None  # the real engines, for the whole mix: only when it is not all auto
    levels, target, predicted, measured = None, budget, 0.0, 0.0
    for _ in range(VERIFY_ROUNDS):
        levels, predicted = choose_levels(config.num_layers, rung_bytes, measure, target, levels)
        mix = mix_text([rungs[level] for level in levels])
        if mix != "auto":
            scorer = scorer or _Scorer(loaded, tokens, block_size)
            measured = scorer.kl(mix)
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
                       len(tokens), len(layer_kl), 0 if scorer is None else scorer.num_runs,
                       time.perf_counter() - start)
