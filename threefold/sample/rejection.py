"""Speculative decoding's acceptance rule (Leviathan et al. 2023, Algorithm 1).

A draft proposes k tokens x_1..x_k from q; the target scores all k+1 positions
in one pass, giving p_1..p_{k+1}. Draft token x_i is accepted with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection a replacement is drawn from
norm(max(0, p_i - q_i)) and the rest is discarded; if all k survive, a bonus
token is drawn from p_{k+1}. Every emitted token is then distributed exactly as
the target alone would have sampled it (Theorem 1 of the paper).

Output layout for k = 3, two drafts accepted (R = replacement, _ = padding):

    token_ids  [x1  x2  R  _]     num_accepted = 2   (num_accepted + 1 valid tokens)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from threefold.sample.ops import exponential_noise

PLACEHOLDER_TOKEN_ID = -1
"""Fills the slots after the first rejection; never a vocabulary id."""


class RejectionOutput(NamedTuple):
    token_ids: Tensor
    """[N, k+1] long: accepted drafts, then one replacement/bonus token, then PLACEHOLDER_TOKEN_ID."""
    num_accepted: Tensor
    """[N] long in [0, k]: leading drafts accepted; the row emits num_accepted + 1 tokens."""


def rejection_sample(
    draft_token_ids: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    is_greedy: Tensor | None = None,
    generators: dict[int, torch.Generator] | None = None,
    all_greedy: bool = False,
) -> RejectionOutput:
    """draft_token_ids [N, k]; draft_probs [N, k, V] or None for one-hot drafts (n-gram,
    greedy draft model); target_probs [N, k+1, V] (already temperature/top-k/p processed);
    is_greedy [N] bool (None = no greedy row); generators: seeded rows draw only from theirs;
    all_greedy skips the random path (a host-side flag, so no device sync is needed)."""
    n, k = draft_token_ids.shape
    # Greedy rows: accept a draft iff it is the target's argmax; emit the argmax where it stops.
    target_argmax = target_probs.argmax(-1)  # [N, k+1]
    greedy = _assemble(draft_token_ids, draft_token_ids == target_argmax[:, :k], target_argmax)
    if all_greedy:
        return greedy
    uniform, exponential = _draw_noise(n, k, target_probs.shape[-1], target_probs.device, generators or {})
    p = target_probs[:, :k]  # [N, k, V]
    p_draft = p.gather(-1, draft_token_ids[..., None]).squeeze(-1)  # p_i(x_i), [N, k]
    if draft_probs is None:  # one-hot q: q_i(x_i) = 1, and max(0, p - q) is p with x_i zeroed
        q_draft = torch.ones_like(p_draft)
        residual = p.scatter(-1, draft_token_ids[..., None], 0.0)
    else:
        q_draft = draft_probs.gather(-1, draft_token_ids[..., None]).squeeze(-1)
        residual = (p - draft_probs).clamp_(min=0.0)
    # u < p/q written as u*q < p: no division by a zero draft probability.
    accepted = uniform * q_draft < p_draft  # [N, k]
    # If p == q the residual is all zero but a rejection then has probability 0; fall back to p.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    # Exponential race (argmax of w / Exp(1)) samples from unnormalised weights w.
    fallback = torch.cat([residual, target_probs[:, k:]], 1).div_(exponential).argmax(-1)  # [N, k+1]
    sampled = _assemble(draft_token_ids, accepted, fallback)
    if is_greedy is None:
        return sampled
    return RejectionOutput(
        torch.where(is_greedy[:, None], greedy.token_ids, sampled.token_ids),
        torch.where(is_greedy, greedy.num_accepted, sampled.num_accepted),
    )


def _assemble(draft_token_ids: Tensor, accepted: Tensor, fallback: Tensor) -> RejectionOutput:
    """Keep drafts up to the first rejection, put fallback[j] at that slot j, pad the rest."""
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # length of the leading run of acceptances
    slot = torch.arange(fallback.shape[1], device=fallback.device)[None, :]  # [1, k+1]
    run = num_accepted[:, None]
    drafts = torch.nn.functional.pad(draft_token_ids, (0, 1), value=PLACEHOLDER_TOKEN_ID)
    token_ids = torch.where(slot < run, drafts, fallback)
    return RejectionOutput(token_ids.masked_fill_(slot > run, PLACEHOLDER_TOKEN_ID), num_accepted)


def _draw_noise(
    n: int, k: int, vocab_size: int, device: torch.device, generators: dict[int, torch.Generator]
) -> tuple[Tensor, Tensor]:
    """uniform [N, k] for the accept test and Exp(1) [N, k+1, V] for the replacement draws."""
    uniform = torch.empty(n, k, device=device)
    if len(generators) < n:
        uniform.uniform_()
    for row, generator in generators.items():
        uniform[row].uniform_(generator=generator)
    return uniform, exponential_noise(torch.empty(n, k + 1, vocab_size, device=device), generators)
