"""LLMEngine: text in, RequestOutputs out; the object the server and LLM drive.

Not thread-safe: one thread calls add_request / step / abort_request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from threefold.config import CacheConfig, ModelConfig, SchedulerConfig
from threefold.core.outputs import EngineCoreOutput
from threefold.core.request import Request, check_request_class
from threefold.core.scheduler import SchedulerStats
from threefold.engine.engine_core import EngineCore
from threefold.engine.kv_guard import resolve_guard
from threefold.engine.output_processor import OutputProcessor, RequestState
from threefold.engine.outputs import RequestOutput, RequestOutputKind
from threefold.errors import ContextLengthError, ThreefoldError
from threefold.kvstore import OffloadConfig
from threefold.model.loader import LoadedModel, load_model
from threefold.sample.params import SamplingParams
from threefold.spec.config import SpeculativeConfig

logger = logging.getLogger(__name__)

EngineStats = SchedulerStats
_MODEL, _CACHE, _SCHED = ModelConfig(), CacheConfig(), SchedulerConfig()  # the defaults' one source


@dataclass(frozen=True)
class EngineArgs:
    """Everything needed to build an engine; each field is documented, and defaulted, on its config."""

    model: str = _MODEL.model
    dtype: str = _MODEL.dtype
    max_model_len: int | None = _MODEL.max_model_len
    kv_cache_memory: int | None = _CACHE.kv_cache_memory
    block_size: int = _CACHE.block_size
    max_num_seqs: int = _SCHED.max_num_seqs
    max_num_batched_tokens: int = _SCHED.max_num_batched_tokens
    max_prefill_tokens: int | None = _SCHED.max_prefill_tokens
    scheduling_policy: str = _SCHED.scheduling_policy
    online_ttft_slo: float | str = _SCHED.online_ttft_slo
    online_itl_slo: float | str = _SCHED.online_itl_slo
    offline_min_share: float = _SCHED.offline_min_share
    max_offline_queued_tokens: int = _SCHED.max_offline_queued_tokens
    online_slowdown: float = _SCHED.online_slowdown
    enable_prefix_caching: bool = _CACHE.enable_prefix_caching
    kv_cache_dtype: str = _CACHE.kv_cache_dtype
    kv_quality_budget: float | None = _CACHE.kv_quality_budget
    kv_guard_calibration: str | None = _CACHE.kv_guard_calibration
    seed: int = _MODEL.seed
    device: str = "cpu"
    speculative_config: SpeculativeConfig | dict | str | None = None
    """vLLM's shape, e.g. {"method": "ngram", "num_speculative_tokens": 5}; JSON text or a dict."""
    kv_offload: OffloadConfig | None = None
    """KV tiers below the pool (host memory, disk, Redis); None = off."""
    step_log: str | None = None
    """Append each model step's time and shape to this file (threefold/engine/step_log.py); None = off."""

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    def configs(self) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
        return (ModelConfig(self.model, self.dtype, self.max_model_len, self.seed),
                CacheConfig(self.block_size, self.kv_cache_memory, self.enable_prefix_caching, self.kv_cache_dtype,
                            self.kv_quality_budget, self.kv_guard_calibration),
                SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_prefill_tokens,
                                self.scheduling_policy,
                                self.online_ttft_slo, self.online_itl_slo,  # type: ignore[arg-type]  # parsed there
                                self.offline_min_share, self.max_offline_queued_tokens, self.online_slowdown))


class LLMEngine:
    def __init__(self, loaded: LoadedModel, args: EngineArgs) -> None:
        model_config, cache_config, sched_config = args.configs()
        self.args = args
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.max_model_len = min(loaded.max_model_len, args.max_model_len or loaded.max_model_len)
        self.generation_defaults = dict(loaded.generation_defaults)
        self.eos_token_ids = list(loaded.eos_token_ids)
        self.vocab_size = loaded.config.vocab_size
        torch.manual_seed(model_config.seed)
        loaded.precision.log(logger)  # which dtype, on which CPU, and why
        cache_config, self.guard = resolve_guard(loaded, cache_config, self.max_model_len)
        """guard: specs: what the startup calibration chose and measured (None otherwise)."""
        self.core = EngineCore(loaded, cache_config, sched_config, self.max_model_len, args.device,
                               args.speculative, args.kv_offload, args.step_log)
        if self.guard is not None:
            g = self.guard
            self.core.cache_info["kv_guard"] = {"guard": g.guard, "budget": g.budget, "predicted_kl": g.predicted_kl,
                                                "measured_kl": g.measured_kl}
        self.processor = OutputProcessor(self.tokenizer)
        self.requests: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, tuple[RequestState, int]] = {}

    @classmethod
    def from_args(cls, args: EngineArgs) -> LLMEngine:
        args.configs()  # validate before the (slow) model load
        args.speculative  # noqa: B018 - same for the speculative config
        loaded = load_model(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len)
        return cls(loaded, args)

    # ---- input -------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ThreefoldError("The prompt is empty; give at least one token.", param="prompt")
            return prompt, self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        if not token_ids:
            raise ThreefoldError("The prompt is empty; give at least one token.", param="prompt")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ThreefoldError(f"Token id {bad[0]} is out of vocabulary (size {self.vocab_size}).",
                                 param="prompt")
        return None, token_ids

    def resolve_max_tokens(self, num_prompt: int, params: SamplingParams) -> int:
        limit = self.max_model_len
        if params.max_tokens is None:
            if num_prompt >= limit:
                raise ContextLengthError(
                    f"This model's maximum context length is {limit} tokens. However, your request has "
                    f"{num_prompt} input tokens. Please reduce the length of the input messages.",
                    param="messages")
            return limit - num_prompt
        if num_prompt + params.max_tokens > limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + params.max_tokens} tokens ({num_prompt} in the messages, {params.max_tokens} "
                f"in the completion). Please reduce the length of the messages or completion.",
                param="max_tokens")
        return params.max_tokens

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                    request_class: str = "online") -> None:
        """request_class: "online" (interactive) or "offline" (batch work, scheduled into the room
        online work leaves; refused with a 429 ThreefoldError past max_offline_queued_tokens)."""
        check_request_class(request_class)
        if request_id in self.requests:
            raise ThreefoldError(f"request id {request_id!r} is already in use", param="request_id")
        text, token_ids = self.tokenize_prompt(prompt)
        max_tokens = self.resolve_max_tokens(len(token_ids), params)
        if request_class == "offline":
            self.core.scheduler.check_offline_room(params.n * (len(token_ids) + max_tokens))
        arrival = arrival_time if arrival_time is not None else time.time()
        child_ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        state = self.processor.new_state(request_id, text, token_ids, params, child_ids, arrival, output_kind)
        eos = frozenset(self.eos_token_ids)
        for index, child_id in enumerate(child_ids):
            child_params = params if params.n == 1 else params.clone(
                n=1, seed=None if params.seed is None else params.seed + index)
            self.core.add_request(Request(child_id, token_ids, child_params, eos, max_tokens, priority, arrival,
                                          request_class))
            self.child_to_parent[child_id] = (state, index)
        self.requests[request_id] = state

    # ---- stepping ----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        changed: dict[str, RequestState] = {}
        stopped: list[str] = []
        for out in self.core.step():
            state = self._apply(out, stopped)
            if state is not None:
                changed[state.request_id] = state
        if stopped:
            self.core.finish_stopped(stopped)
        results = []
        for state in changed.values():
            output = state.to_output()
            if output is not None:
                results.append(output)
            if state.finished:
                self._forget(state)
        return results

    def _apply(self, out: EngineCoreOutput, stopped: list[str]) -> RequestState | None:
        entry = self.child_to_parent.get(out.request_id)
        if entry is None:
            return None
        state, index = entry
        completion = state.completions[index]
        if state.metrics.first_scheduled_time is None:
            state.metrics.first_scheduled_time = out.first_scheduled_time
        try:
            if self.processor.apply(state, completion, out):
                stopped.append(completion.child_id)
        except Exception as exc:  # one request's failure must not take the others down
            logger.exception("processing request %s failed", state.request_id)
            state.error = f"{type(exc).__name__}: {exc}"
            self._fail(state)
        return state

    def _fail(self, state: RequestState) -> None:
        running = [c.child_id for c in state.completions if c.finish_reason is None]
        self.core.abort_requests(running)
        for completion in state.completions:
            completion.finish_reason = completion.finish_reason or "error"

    def _forget(self, state: RequestState) -> None:
        self.requests.pop(state.request_id, None)
        for completion in state.completions:
            self.child_to_parent.pop(completion.child_id, None)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        for request_id in list(request_ids):
            state = self.requests.get(request_id)
            if state is None:
                continue
            self.core.abort_requests([c.child_id for c in state.completions])
            self._forget(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def close(self) -> None:
        """Release what outlives a step: the KV offload tiers (pending writes are finished)."""
        self.core.close()

    def get_stats(self) -> EngineStats:
        return self.core.stats()
