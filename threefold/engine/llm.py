"""LLM: the offline Python API, shaped like vLLM's so users can switch."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import cast

import torch
from tqdm import tqdm

from threefold.engine.llm_engine import EngineArgs, LLMEngine
from threefold.engine.outputs import RequestOutput, RequestOutputKind
from threefold.kvstore import OffloadConfig
from threefold.sample.params import SamplingParams

PromptType = str | dict
_DEFAULTS = EngineArgs()  # LLM()'s defaults are the engine's: threefold/config.py is their one source


class LLM:
    """Generate for many prompts at once with continuous batching.

    >>> llm = LLM("smollm2-135m")
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: str = _DEFAULTS.model, dtype: str = _DEFAULTS.dtype,
                 max_model_len: int | None = _DEFAULTS.max_model_len,
                 kv_cache_memory: int | None = _DEFAULTS.kv_cache_memory, max_num_seqs: int = _DEFAULTS.max_num_seqs,
                 max_num_batched_tokens: int = _DEFAULTS.max_num_batched_tokens,
                 max_prefill_tokens: int | None = _DEFAULTS.max_prefill_tokens,
                 enable_prefix_caching: bool = _DEFAULTS.enable_prefix_caching, seed: int = _DEFAULTS.seed,
                 block_size: int = _DEFAULTS.block_size, device: str = _DEFAULTS.device,
                 kv_cache_dtype: str = _DEFAULTS.kv_cache_dtype,
                 kv_quality_budget: float | None = _DEFAULTS.kv_quality_budget,
                 kv_guard_calibration: str | None = _DEFAULTS.kv_guard_calibration,
                 speculative_config: dict | str | None = None,
                 scheduling_policy: str = _DEFAULTS.scheduling_policy,
                 online_ttft_slo: float | str = _DEFAULTS.online_ttft_slo,
                 online_itl_slo: float | str = _DEFAULTS.online_itl_slo,
                 offline_min_share: float = _DEFAULTS.offline_min_share,
                 max_offline_queued_tokens: int = _DEFAULTS.max_offline_queued_tokens,
                 online_slowdown: float = _DEFAULTS.online_slowdown,
                 kv_offload_cpu_bytes: int | str | None = None, kv_offload_disk: str | None = None,
                 kv_offload_disk_bytes: int | str | None = None, kv_offload_redis: str | None = None,
                 kv_offload_codec: str | None = None, kv_offload_config: str | None = None,
                 step_log: str | None = None) -> None:
        offload = OffloadConfig.from_options(
            kv_offload_config=kv_offload_config, kv_offload_cpu_bytes=kv_offload_cpu_bytes,
            kv_offload_disk=kv_offload_disk, kv_offload_disk_bytes=kv_offload_disk_bytes,
            kv_offload_redis=kv_offload_redis, kv_offload_codec=kv_offload_codec)
        args = EngineArgs(model=model, dtype=dtype, max_model_len=max_model_len, kv_cache_memory=kv_cache_memory,
                          block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, max_prefill_tokens=max_prefill_tokens,
                          enable_prefix_caching=enable_prefix_caching, seed=seed, device=device,
                          kv_cache_dtype=kv_cache_dtype, kv_quality_budget=kv_quality_budget,
                          kv_guard_calibration=kv_guard_calibration, speculative_config=speculative_config,
                          scheduling_policy=scheduling_policy, online_ttft_slo=online_ttft_slo,
                          online_itl_slo=online_itl_slo, offline_min_share=offline_min_share,
                          max_offline_queued_tokens=max_offline_queued_tokens, online_slowdown=online_slowdown,
                          kv_offload=offload if offload.enabled else None, step_log=step_log)
        self.engine = LLMEngine.from_args(args)
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        return cls.from_engine(LLMEngine.from_args(args))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (e.g. several configurations over one loaded model)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._ids = itertools.count()
        return llm

    def close(self) -> None:
        """Finish the KV offload tiers' pending writes and release them (a no-op without tiers)."""
        self.engine.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults applied."""
        known = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}
        return SamplingParams(**{k: v for k, v in self.engine.generation_defaults.items() if k in known})

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None,
                 request_class: str = "online") -> list[RequestOutput]:
        """Outputs in the order of `prompts`; strings or {"prompt_token_ids": [...]}.
        request_class="offline" schedules them as batch work (see SchedulerConfig)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or self.get_default_sampling_params()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        request_ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
                request_id = str(next(self._ids))
                # Only the finished outputs are read: no per-step copies of growing completions.
                self.engine.add_request(request_id, _prompt_input(prompt), p, priority[i] if priority else 0,
                                        output_kind=RequestOutputKind.FINAL_ONLY, request_class=request_class)
                request_ids.append(request_id)
        except Exception:
            self.engine.abort_request(request_ids)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False, **template_kwargs) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        # One conversation is a list of dicts: its first item tells which form this is.
        conversations = [messages] if messages and isinstance(messages[0], dict) else cast("list[list[dict]]", messages)
        tokenizer = self.engine.tokenizer
        prompts = [{"prompt_token_ids": tokenizer.encode(
            tokenizer.apply_chat_template(conv, add_generation_prompt=True, **template_kwargs),
            add_special_tokens=False)} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def score_distributions(self, token_id_lists: list[list[int]]) -> list[torch.Tensor]:
        """Next-token log-distributions [len - 1, vocab] (float32) at every position of each
        sequence, computed through the engine's own paged-KV path (for quality measurements)."""
        runner = self.engine.core.runner
        chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}
        runner.prompt_logprobs_observer = lambda rid, start, rows: chunks.setdefault(rid, []).append(
            (start, rows.float().cpu()))
        try:
            outputs = self.generate([{"prompt_token_ids": ids} for ids in token_id_lists],
                                    SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))
        finally:
            runner.prompt_logprobs_observer = None
        return [torch.cat([rows for _, rows in sorted(chunks[o.request_id], key=lambda c: c[0])])
                for o in outputs]

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm)
        while pending:
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"engine lost requests {sorted(pending)}")
            for output in self.engine.step():
                if output.finished and output.request_id in pending:
                    finished[output.request_id] = output
                    pending.discard(output.request_id)
                    bar.update(1)
        bar.close()
        return [finished[rid] for rid in request_ids]


def _prompt_input(prompt: PromptType) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
    return prompt
