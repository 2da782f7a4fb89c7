"""SamplingMetadata: one engine step's sampling controls as batched tensors.

Built once per step by the model runner from the rows (requests) that need a
token. Every optional feature is `None` when no row uses it, so the sampler
skips its cost entirely in the common case.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from threefold.sample.params import SamplingParams


@dataclass
class SamplingMetadata:
    """Row i of every tensor belongs to the i-th request sampled this step."""

    temperature: Tensor
    """[N] float32; exactly 0.0 on greedy rows."""
    all_greedy: bool
    """Every row is greedy: the sampler only takes an argmax."""
    all_random: bool
    """No row is greedy: the sampler skips the argmax merge."""
    top_k: Tensor | None
    """[N] long, 0 = off; None when no random row uses it (k >= vocab counts as off)."""
    max_top_k: int
    """Largest top_k of any row (0 when top_k is None); sizes the topk call without a host sync."""
    top_p: Tensor | None
    """[N] float32; None when every random row has 1.0."""
    min_p: Tensor | None
    """[N] float32; None when every random row has 0.0."""
    repetition_penalty: Tensor | None
    """[N] float32; None when every row has 1.0."""
    presence_penalty: Tensor | None
    """[N] float32; None when every row has 0.0."""
    frequency_penalty: Tensor | None
    """[N] float32; None when every row has 0.0."""
    prompt_token_ids: Tensor | None
    """[N, P] long padded with vocab_size; only built when repetition_penalty is set."""
    output_token_ids: list[list[int]]
    """Tokens generated so far per row (penalties count these)."""
    min_tokens_mask: dict[int, list[int]]
    """row -> token ids forced to -inf because the row has not reached min_tokens."""
    generators: dict[int, torch.Generator]
    """Seeded random rows only; greedy rows never advance their generator."""
    max_num_logprobs: int | None
    """Largest `logprobs` any row asked for; None = no row wants logprobs."""
    vocab_size: int

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def has_penalties(self) -> bool:
        return any(
            t is not None for t in (self.repetition_penalty, self.presence_penalty, self.frequency_penalty)
        )

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: dict[int, torch.Generator],
        eos_token_ids: list[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        greedy = [p.greedy for p in params]
        # Filters only matter on random rows; neutral values on greedy rows let
        # an all-greedy batch with top_k set skip the filter altogether.
        top_k = [0 if g or not 0 < p.top_k < vocab_size else p.top_k for p, g in zip(params, greedy)]
        repetition = _optional([p.repetition_penalty for p in params], 1.0, torch.float32, device)
        return cls(
            temperature=torch.tensor(
                [0.0 if g else p.temperature for p, g in zip(params, greedy)], dtype=torch.float32, device=device
            ),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=_optional(top_k, 0, torch.long, device),
            max_top_k=max(top_k, default=0),
            top_p=_optional([1.0 if g else p.top_p for p, g in zip(params, greedy)], 1.0, torch.float32, device),
            min_p=_optional([0.0 if g else p.min_p for p, g in zip(params, greedy)], 0.0, torch.float32, device),
            repetition_penalty=repetition,
            presence_penalty=_optional([p.presence_penalty for p in params], 0.0, torch.float32, device),
            frequency_penalty=_optional([p.frequency_penalty for p in params], 0.0, torch.float32, device),
            prompt_token_ids=None if repetition is None else pad_token_ids(prompt_token_ids, vocab_size, device),
            output_token_ids=output_token_ids,
            min_tokens_mask=_min_tokens_mask(params, output_token_ids, eos_token_ids, vocab_size),
            generators={row: g for row, g in generators.items() if not greedy[row]},
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
            vocab_size=vocab_size,
        )


def _optional(values: list, neutral: float, dtype: torch.dtype, device: torch.device | str) -> Tensor | None:
    """[N] tensor of `values`, or None when every value is the neutral one."""
    if all(v == neutral for v in values):
        return None
    return torch.tensor(values, dtype=dtype, device=device)


def pad_token_ids(token_ids: list[list[int]], pad_id: int, device: torch.device | str) -> Tensor:
    """[N, longest] long, right-padded with `pad_id` (vocab_size: one past the last real id)."""
    longest = max(map(len, token_ids), default=0)
    padded = [ids + [pad_id] * (longest - len(ids)) for ids in token_ids]
    return torch.tensor(padded, dtype=torch.long, device=device).view(len(token_ids), longest)


def _min_tokens_mask(
    params: list[SamplingParams], output_token_ids: list[list[int]], eos_token_ids: list[int], vocab_size: int
) -> dict[int, list[int]]:
    """Rows still short of min_tokens may not emit a token that would stop them (as in vLLM)."""
    mask: dict[int, list[int]] = {}
    for row, (p, output) in enumerate(zip(params, output_token_ids)):
        if len(output) >= p.min_tokens:
            continue
        stop_ids = set(p.stop_token_ids or []) | (set() if p.ignore_eos else set(eos_token_ids))
        stop_ids = sorted(t for t in stop_ids if t < vocab_size)
        if stop_ids:
            mask[row] = stop_ids
    return mask
