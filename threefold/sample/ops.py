"""Batched logit transforms and the exponential-race draw used by the Sampler.

Every function works on all rows at once with tensor ops; the only Python
loops are over rows that carry their own state (seeded generators,
min_tokens masks). Functions named `apply_*` may edit
`logits` in place and return the result.
"""

from __future__ import annotations

import torch
from torch import Tensor

from threefold.sample.metadata import SamplingMetadata

_NEG_INF = float("-inf")


def apply_min_tokens(logits: Tensor, mask: dict[int, list[int]]) -> Tensor:
    """Forbid stop/EOS tokens on rows that have not reached min_tokens."""
    if mask:
        rows = [row for row, ids in mask.items() for _ in ids]
        cols = [t for ids in mask.values() for t in ids]
        logits[rows, cols] = _NEG_INF
    return logits


def apply_penalties(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """Repetition (prompt + output, HF/CTRL rule), then frequency and presence (output only, OpenAI rule)."""
    if not meta.has_penalties:
        return logits
    counts = meta.output_token_counts  # [N, V] int32, kept up to date by each request
    in_output = counts > 0
    if meta.repetition_penalty is not None:
        seen = in_output | meta.prompt_token_mask
        penalty = meta.repetition_penalty[:, None]
        # Dividing a positive logit and multiplying a negative one both make the token less likely.
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if meta.frequency_penalty is not None:
        logits -= meta.frequency_penalty[:, None] * counts
    if meta.presence_penalty is not None:
        logits -= meta.presence_penalty[:, None] * in_output
    return logits


def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """Divide by temperature; greedy rows (0.0) are divided by 1 since their argmax is taken elsewhere."""
    return logits.div_(temperature.masked_fill(temperature == 0.0, 1.0)[:, None])


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below min_p times the row's most likely token's."""
    probs = logits.softmax(-1)  # [N, V]
    threshold = min_p[:, None] * probs.amax(-1, keepdim=True)
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k_top_p(
    logits: Tensor, top_k: Tensor | None, max_top_k: int, top_p: Tensor | None, num_candidates: int = 1024
) -> Tensor:
    """Top-k, then top-p over what remains; ties with the cut-off value are kept.

    A full sort of [256, 152k] takes seconds on CPU, so top-p first looks only at
    the `num_candidates` (or max_top_k, if larger) most likely tokens, which
    settles every row whose kept set fits inside them; only otherwise does it sort.
    """
    if top_p is None:
        return logits if top_k is None else _apply_top_k(logits, top_k, max_top_k)
    top_k = top_k if top_k is not None else torch.zeros_like(top_p, dtype=torch.long)
    width = min(logits.shape[-1], max(num_candidates, max_top_k))
    cutoff, settled = _top_k_top_p_cutoff(logits, top_k, top_p, width)
    if not bool(settled.all()):  # host sync; rare: a flat distribution with top_p near 1
        return _apply_top_k_top_p_sorted(logits, top_k, top_p)
    return logits.masked_fill_(logits < cutoff, _NEG_INF)


def _top_k_top_p_cutoff(logits: Tensor, top_k: Tensor, top_p: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """Per-row smallest kept logit [N, 1], and [N] whether the top `width` tokens decided it."""
    values = logits.topk(width, -1).values  # [N, width], descending
    position = torch.arange(width, device=logits.device)
    in_top_k = (top_k == 0)[:, None] | (position < top_k[:, None])  # [N, width]
    values = values.masked_fill(~in_top_k, _NEG_INF)
    # Normalise over the row's whole support: the candidates alone when top-k bounds it.
    log_z = torch.where(top_k > 0, values.logsumexp(-1), logits.logsumexp(-1))[:, None]
    probs = (values - log_z).exp()
    mass_before = probs.cumsum(-1) - probs  # probability of strictly more likely tokens
    p = top_p[:, None]
    # p = 1 keeps all of top-k; float32 mass_before could otherwise round up to 1.
    keep = in_top_k & ((mass_before < p) | (p >= 1.0))
    num_keep = keep.sum(-1, keepdim=True)  # >= 1: the first candidate has mass_before 0 < p
    cutoff = values.gather(-1, num_keep - 1)
    unfiltered = (top_k == 0) & (top_p >= 1.0)
    cutoff.masked_fill_(unfiltered[:, None], _NEG_INF)
    # Decided when top-k bounds the support or the last candidate is already dropped
    # (every token outside the candidates has even more mass before it).
    settled = (top_k > 0) | unfiltered | ~keep[:, -1] | (width == logits.shape[-1])
    return cutoff, settled


def _apply_top_k_top_p_sorted(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """The general path: one full ascending sort (vLLM's formulation)."""
    # Ascending, so the cumulative sum starts at the tiny tail and p = 1.0 keeps every token.
    sorted_logits, order = logits.sort(-1)  # [N, V] each
    vocab_size = logits.shape[-1]
    k = top_k.masked_fill(top_k == 0, vocab_size)
    kth = sorted_logits.gather(-1, (vocab_size - k)[:, None])  # k-th largest value
    sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    # mass_at_or_below[i] = 1 - (mass of strictly more likely tokens). Dropping tokens where
    # it is <= 1 - p keeps the smallest most-likely set whose mass reaches p; the most
    # likely token (last column) always stays.
    mass_at_or_below = sorted_logits.softmax(-1).cumsum(-1)
    drop = mass_at_or_below <= 1.0 - top_p[:, None]
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return logits.scatter_(-1, order, sorted_logits)


def _apply_top_k(logits: Tensor, top_k: Tensor, max_top_k: int) -> Tensor:
    """Top-k alone: a partial topk of the largest k is far cheaper than a full sort."""
    top_values = logits.topk(max_top_k, -1).values  # [N, max_top_k], descending
    off = top_k == 0
    kth = top_values.gather(-1, (top_k.masked_fill(off, 1) - 1)[:, None])
    kth.masked_fill_(off[:, None], _NEG_INF)
    return logits.masked_fill_(logits < kth, _NEG_INF)


def exponential_race(probs: Tensor, generators: dict[int, torch.Generator]) -> Tensor:
    """[N] long: one draw per row from `probs` [N, V] (need not be normalised).

    argmax(p_i / q_i) with q_i ~ Exp(1) is distributed as p (the Gumbel-max trick
    in another form) and needs no cumsum or host sync. A seeded row draws its
    own noise from its generator, so its token depends only on that generator
    and its own probabilities, never on the rest of the batch.
    """
    return probs.div_(exponential_noise(probs, generators)).argmax(-1)


def exponential_noise(like: Tensor, generators: dict[int, torch.Generator]) -> Tensor:
    """Exp(1) noise shaped like `like`; row i comes from generators[i] where present.

    Built as -log(U): on CPU uniform_ plus one batched log is ~4x faster than
    exponential_, and a seeded row consumes exactly numel(row) uniforms either way.
    """
    noise = torch.empty_like(like)
    if len(generators) < like.shape[0]:
        noise.uniform_()
    for row, generator in generators.items():
        noise[row].uniform_(generator=generator)
    return noise.log_().neg_()
