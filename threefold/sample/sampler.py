"""The batched Sampler: raw logits [N, V] -> one token per row (+ logprobs).

Order of processing, as in vLLM v1:

    raw logits --log_softmax--> returned logprobs (the model's own distribution)
        |
    min_tokens mask -> penalties --+--> greedy rows: argmax
                                   +--> random rows: / temperature -> min_p -> top_k -> top_p
                                                     -> softmax -> exponential race
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor

from threefold.sample.logprobs import LogprobsTensors, compute_logprobs_tensors
from threefold.sample.metadata import SamplingMetadata
from threefold.sample.ops import (
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
    exponential_race,
)

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "SamplingMetadata", "compute_logprobs_tensors"]


class SamplerOutput(NamedTuple):
    sampled_token_ids: Tensor
    """[N] long."""
    logprobs: LogprobsTensors | None
    """None when meta.max_num_logprobs is None; else K = meta.max_num_logprobs columns after the sampled one."""


class Sampler:
    """Stateless; the caller owns all per-request state (generators, outputs) via SamplingMetadata.

    `kernels` (threefold.kernels on CPU) takes the greedy rows' argmax: ~5x torch's max
    over [200, 49152] bf16 logits (measured), the same indices."""

    def __init__(self, kernels: ModuleType | None = None) -> None:
        self.kernels = kernels

    def __call__(self, logits: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # Raw logprobs come from the untouched distribution (vLLM v1 "raw_logprobs").
        raw_logprobs = None if meta.max_num_logprobs is None else logits.float().log_softmax(-1)
        if meta.all_greedy and not meta.min_tokens_mask and not meta.has_penalties:
            sampled = self.argmax(logits)  # nothing edits the logits: no copy
        else:
            # Work on a float32 copy: the transforms below edit in place, the caller's logits stay intact.
            logits = logits.to(torch.float32, copy=True)  # [N, V]
            logits = apply_min_tokens(logits, meta.min_tokens_mask)
            logits = apply_penalties(logits, meta)
            sampled = self._sample(logits, meta)
        if raw_logprobs is None:
            return SamplerOutput(sampled, None)
        assert meta.max_num_logprobs is not None  # raw_logprobs exist only then
        return SamplerOutput(sampled, compute_logprobs_tensors(raw_logprobs, meta.max_num_logprobs, sampled))

    def _sample(self, logits: Tensor, meta: SamplingMetadata) -> Tensor:
        if meta.all_greedy:  # a batch is never empty here, so all_greedy excludes all_random
            return self.argmax(logits)
        greedy = None if meta.all_random else self.argmax(logits)
        sampled = self._sample_random(logits, meta)
        return sampled if greedy is None else torch.where(meta.temperature == 0.0, greedy, sampled)

    def argmax(self, logits: Tensor) -> Tensor:
        """Row argmax, the first index on ties like torch.argmax."""
        if self.kernels is not None and logits.device.type == "cpu" and logits.stride(-1) == 1:
            return self.kernels.argmax_rows(logits)
        return logits.max(dim=-1).indices  # ~2.5x faster than argmax on CPU (measured)

    @staticmethod
    def _sample_random(logits: Tensor, meta: SamplingMetadata) -> Tensor:
        logits = apply_temperature(logits, meta.temperature)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.max_top_k, meta.top_p)
        return exponential_race(logits.softmax(-1), meta.generators)
