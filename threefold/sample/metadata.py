"""SamplingMetadata: one engine step's sampling controls as batched tensors.

Built once per step by the model runner from the rows (requests) that need a
token. Every optional feature is `None` when no row uses it, so the sampler
skips its cost entirely in the common case. Nothing here reads a request's
token lists: penalties use `TokenCounts` that their requests keep up to date
token by token, so building the metadata costs the same at any context length.
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
    output_token_counts: Tensor | None
    """[N, V] int32: how often each token occurs in the row's output; None without penalties."""
    prompt_token_mask: Tensor | None
    """[N, V] bool: the token occurs in the row's prompt; only built when repetition_penalty is set."""
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
        num_output_tokens: list[int],
        token_counts: list[TokenCounts | None],
        generators: dict[int, torch.Generator],
        eos_token_ids: list[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        """token_counts: per row, its TokenCounts; required on rows that have a penalty."""
        greedy = [p.greedy for p in params]
        # Filters only matter on random rows; neutral values on greedy rows let
        # an all-greedy batch with top_k set skip the filter altogether.
        top_k = [0 if g or not 0 < p.top_k < vocab_size else p.top_k for p, g in zip(params, greedy)]
        repetition = _optional([p.repetition_penalty for p in params], 1.0, torch.float32, device)
        presence = _optional([p.presence_penalty for p in params], 0.0, torch.float32, device)
        frequency = _optional([p.frequency_penalty for p in params], 0.0, torch.float32, device)
        any_penalty = any(t is not None for t in (repetition, presence, frequency))
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
            presence_penalty=presence,
            frequency_penalty=frequency,
            output_token_counts=_stack_counts(token_counts, vocab_size, device) if any_penalty else None,
            prompt_token_mask=None if repetition is None else _stack_prompt_masks(token_counts, vocab_size, device),
            min_tokens_mask=_min_tokens_mask(params, num_output_tokens, eos_token_ids, vocab_size),
            generators={row: g for row, g in generators.items() if not greedy[row]},
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
            vocab_size=vocab_size,
        )


class TokenCounts:
    """One request's token statistics for penalties, kept across steps.

    Built once from the request's tokens (O(context), once per request), then
    `add` costs O(new tokens): no step ever recounts a sequence.
    """

    def __init__(self, prompt_token_ids: list[int], output_token_ids: list[int], vocab_size: int,
                 device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.output_counts = _count(output_token_ids, vocab_size, device)  # [V] int32
        self.prompt_mask = _count(prompt_token_ids, vocab_size, device) > 0  # [V] bool

    @classmethod
    def for_params(cls, params: SamplingParams, prompt_token_ids: list[int], output_token_ids: list[int],
                   vocab_size: int, device: torch.device | str) -> TokenCounts | None:
        """Counts for a request whose params have a penalty; None (nothing kept) otherwise."""
        if params.repetition_penalty == 1.0 and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0:
            return None
        return cls(prompt_token_ids, output_token_ids, vocab_size, device)

    def add(self, token_id: int) -> None:
        if 0 <= token_id < self.vocab_size:
            self.output_counts[token_id] += 1


def _count(token_ids: list[int], vocab_size: int, device: torch.device | str) -> Tensor:
    """[V] int32 occurrences of each id; ids outside the vocabulary are dropped."""
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    ids = ids[(ids >= 0) & (ids < vocab_size)]
    return torch.bincount(ids, minlength=vocab_size).to(torch.int32)


def _stack_counts(token_counts: list[TokenCounts | None], vocab_size: int, device: torch.device | str) -> Tensor:
    """[N, V] int32; rows without counts (no penalty) are zero, which leaves their logits alone."""
    zeros = torch.zeros(vocab_size, dtype=torch.int32, device=device)
    return torch.stack([zeros if c is None else c.output_counts for c in token_counts])


def _stack_prompt_masks(token_counts: list[TokenCounts | None], vocab_size: int,
                        device: torch.device | str) -> Tensor:
    """[N, V] bool; rows without a repetition penalty see an empty prompt."""
    empty = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    return torch.stack([empty if c is None else c.prompt_mask for c in token_counts])


def _optional(values: list, neutral: float, dtype: torch.dtype, device: torch.device | str) -> Tensor | None:
    """[N] tensor of `values`, or None when every value is the neutral one."""
    if all(v == neutral for v in values):
        return None
    return torch.tensor(values, dtype=dtype, device=device)


def _min_tokens_mask(
    params: list[SamplingParams], num_output_tokens: list[int], eos_token_ids: list[int], vocab_size: int
) -> dict[int, list[int]]:
    """Rows still short of min_tokens may not emit a token that would stop them (as in vLLM)."""
    mask: dict[int, list[int]] = {}
    for row, (p, num_output) in enumerate(zip(params, num_output_tokens)):
        if num_output >= p.min_tokens:
            continue
        stop_ids = set(p.stop_token_ids or []) | (set() if p.ignore_eos else set(eos_token_ids))
        stop_ids = sorted(t for t in stop_ids if t < vocab_size)
        if stop_ids:
            mask[row] = stop_ids
    return mask
