"""One frozen config per concern (plain Python: core/ imports this, and never torch)."""

from __future__ import annotations

from dataclasses import dataclass

from threefold.errors import ThreefoldError
from threefold.kv.guard import validate_kv_cache_dtype

DTYPES = ("auto", "float32", "bfloat16", "bf16-weights")
"""ModelConfig.dtype's values (threefold.model.precision explains each)."""

DEFAULT_MODEL = "smollm2-135m"
"""The registry name loaded when none is given (CLI, server, LLM(), benchmarks); the registry re-exports it."""


def _require(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise ThreefoldError(message, param=param)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str = DEFAULT_MODEL
    """Registry name, GGUF file path or Hugging Face checkpoint directory."""
    dtype: str = "auto"
    """auto (per CPU: bf16 where it has a native bf16 dot product, else fp32 compute), float32,
    bfloat16, or bf16-weights (bf16 weight storage, fp32 compute)."""
    max_model_len: int | None = None
    """Cap on prompt + output tokens; None = the model's own context length."""
    seed: int = 0
    """Seed of the default generator (requests without their own seed)."""

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}.", "dtype")
        _require(self.max_model_len is None or self.max_model_len >= 2,
                 f"max_model_len must be at least 2, got {self.max_model_len}.", "max_model_len")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory: int | None = None
    """Bytes for the KV pool; None = a safe fraction of available RAM (capped)."""
    enable_prefix_caching: bool = True
    """Reuse KV of identical prompt prefixes across requests."""
    kv_cache_dtype: str = "auto"
    """KV codec spec (vLLM's name): auto, int8, fp8, fp8_e5m2, int4[:group=32], kivi2, ... (kv/spec.py);
    a per-layer mix, mix:SPEC@LAYERS;... (kv/mix.py); or guard:BASE[>RUNG...] (kv/guard.py), which
    calibrates a mix at startup within kv_quality_budget."""
    kv_quality_budget: float | None = None
    """guard: specs only: the mean KL divergence (nats per token) the chosen mix may add against auto."""
    kv_guard_calibration: str | None = None
    """guard: specs only: a text file to calibrate on; None = ShareGPT's train split."""

    def __post_init__(self) -> None:
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
                 f"block_size must be a power of two up to 128, got {self.block_size}.", "block_size")
        _require(self.kv_cache_memory is None or self.kv_cache_memory > 0,
                 f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}.", "kv_cache_memory")
        # raises, listing the codecs and their parameters (and, for guard:, the budget it needs)
        validate_kv_cache_dtype(self.kv_cache_dtype, self.kv_quality_budget)
        _require(self.kv_guard_calibration is None or self.kv_quality_budget is not None,
                 "kv_guard_calibration applies to guard: specs only (with kv_quality_budget).", "kv_guard_calibration")


SCHEDULING_POLICIES = ("hybrid", "fcfs")
"""SchedulerConfig.scheduling_policy's values: hybrid runs online work first and fits offline
work into the latency budget left; fcfs treats offline requests like online ones (the naive mix)."""

SERVING_PREFILL_TOKENS = 512
"""SchedulerConfig.max_prefill_tokens when `threefold serve` is given none. Where the prompts of a burst
reach their first token matters there; LLM() and generate run whole batches, where only the total time
counts, and keep the largest steps (vLLM's CPU defaults likewise size its LLM class's steps above its API
server's)."""

MAX_ONLINE_SLOWDOWN = 10.0
"""online_slowdown's ceiling: offline may make a step at most 11x as long as online alone (past that the
ITL SLO cap binds anyway)."""

_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "": 1.0}


def parse_duration(value: str | float | int, param: str = "duration") -> float:
    """Seconds from 100ms, 1s, 1.5, 2m or a number (seconds); ThreefoldError otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = str(value).strip().lower()
        number = text.rstrip("ms")
        unit = text[len(number):]
        try:
            seconds = float(number) * _DURATION_UNITS[unit]
        except (KeyError, ValueError):
            raise ThreefoldError(f"cannot read {value!r} as a duration; write e.g. 100ms, 1s or 0.5",
                                 param=param) from None
    _require(seconds > 0, f"{param} must be a positive duration, got {value!r}.", param)
    return seconds


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: prefill chunks and decodes share it."""
    max_prefill_tokens: int | None = None
    """Most prompt tokens one step computes for online requests while another request waits or runs (None:
    the front door's default: SERVING_PREFILL_TOKENS for `threefold serve`, no cap for LLM() and generate).
    Prefill is compute-bound from a few dozen rows up on a CPU, so a 2048-token step of 20 short prompts
    costs 4x a 512-token one and hands every one of them its first token only at its end: capped, the
    first prompts of a burst finish a step or three sooner and decodes wait less, for the same work."""
    scheduling_policy: str = "hybrid"
    """hybrid: online first, offline fills the latency budget left; fcfs: offline mixes in like online."""
    online_ttft_slo: float = 1.0
    """Seconds: the time to first token that offline work must not push online requests past."""
    online_itl_slo: float = 0.1
    """Seconds: the inter-token latency (one step) that offline work must not push online decodes past."""
    offline_min_share: float = 0.05
    """Offline's floor whatever the online load: this share of the tokens online computes, owed from step
    to step and paid in steps of online decodes (core/hybrid.py), so batch work never starves."""
    max_offline_queued_tokens: int = 4_000_000
    """Most prompt + max_tokens of unfinished offline requests; adding more is refused (429)."""
    online_slowdown: float = 0.2
    """Most offline work may lengthen a step of online decodes, as a share of its predicted time without it
    (0.2: 20%), once the machine has been busy with online work for a while (core/hybrid.py); steps carrying
    an online prompt get only offline's floor. Higher trades online latency for offline throughput; 0
    leaves offline its floor and the idle gaps."""

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be at least 1, got {self.max_num_seqs}.",
                 "max_num_seqs")
        _require(self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.",
                 "max_num_batched_tokens")
        _require(self.max_prefill_tokens is None or self.max_prefill_tokens >= 1,
                 f"max_prefill_tokens must be at least 1, got {self.max_prefill_tokens}.", "max_prefill_tokens")
        _require(self.scheduling_policy in SCHEDULING_POLICIES,
                 f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}.",
                 "scheduling_policy")
        for name in ("online_ttft_slo", "online_itl_slo"):
            object.__setattr__(self, name, parse_duration(getattr(self, name), name))
        _require(0.0 <= self.offline_min_share <= 1.0,
                 f"offline_min_share must be within [0, 1], got {self.offline_min_share}.", "offline_min_share")
        _require(0.0 <= self.online_slowdown <= MAX_ONLINE_SLOWDOWN,
                 f"online_slowdown must be within [0, {MAX_ONLINE_SLOWDOWN:g}] (a share of a step's time), "
                 f"got {self.online_slowdown}.", "online_slowdown")
        _require(self.max_offline_queued_tokens >= 1,
                 f"max_offline_queued_tokens must be at least 1, got {self.max_offline_queued_tokens}.",
                 "max_offline_queued_tokens")
