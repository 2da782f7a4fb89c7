"""Verify drafted chains against the target's logits: exact greedy, exact sampling.

Request i with k_i drafts owns k_i + 1 consecutive logits rows (its last real
token, then each draft). Row j is processed exactly as the plain Sampler would
process it had drafts 0..j-1 already been emitted: penalties and min_tokens see
`output + drafts[:j]`. Then `rejection_sample` keeps what the target would have
produced (sample/rejection.py). So with speculation on, greedy output is
token-for-token the same and sampled output has the same distribution,
with top-k, top-p, min-p, temperature and penalties all applied.

    rows   [ r0 d0 d1 d2 | r1 d0 | ... ]    request 0: k=3, request 1: k=1
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from threefold.sample.metadata import SamplingMetadata, TokenCounts
from threefold.sample.ops import apply_min_p, apply_min_tokens, apply_penalties, apply_temperature, apply_top_k_top_p
from threefold.sample.params import SamplingParams
from threefold.sample.rejection import rejection_sample
from threefold.spec.proposer import Draft
from threefold.spec.tree import accept_greedy, accept_sampling


class VerifyResult(NamedTuple):
    token_ids: list[list[int]]
    """Per request: the accepted drafts, then the target's correction or bonus token."""
    num_accepted: list[int]


def raw_argmax_decides(params: list[SamplingParams], num_output_tokens: list[int]) -> bool:
    """Whether every row's token is the argmax of its raw logits: greedy requests with no penalty,
    past min_tokens (drafts only add output, so later rows are past it too). Then a verify needs
    no processed copy of its rows, only their argmax."""
    return all(p.greedy and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
               and n >= p.min_tokens for p, n in zip(params, num_output_tokens, strict=True))


def argmax_list(logits: Tensor, argmax: Callable[[Tensor], Tensor] | None = None) -> list[int]:
    """Each row's argmax (first index on ties, as torch.argmax), through `argmax` when given (the
    Sampler's native row argmax), in the logits' own dtype: no float32 copy."""
    return (logits.argmax(-1) if argmax is None else argmax(logits)).tolist()


def processed_probs(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """[R, V] the distribution the Sampler draws each row from (greedy rows: its argmax is the
    argmax of what is returned). The caller's logits are not modified."""
    logits = logits.to(torch.float32, copy=True)
    logits = apply_min_tokens(logits, meta.min_tokens_mask)
    logits = apply_penalties(logits, meta)
    if meta.all_greedy:
        return logits
    logits = apply_temperature(logits, meta.temperature)
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    return apply_top_k_top_p(logits, meta.top_k, meta.max_top_k, meta.top_p).softmax(-1)


def row_metadata(drafts: list[list[int]], params: list[SamplingParams], num_output_tokens: list[int],
                 token_counts: list[TokenCounts | None], eos_token_ids: list[int], vocab_size: int,
                 device: torch.device | str) -> SamplingMetadata:
    """SamplingMetadata over every verify row: row j of a request has emitted drafts[:j] too
    (min_tokens counts them, penalties see them: a copy of the counts per row, penalty rows only)."""
    prefixes = [[draft[:j] for j in range(len(draft) + 1)] for draft in drafts]
    return prefix_metadata(prefixes, params, num_output_tokens, token_counts, eos_token_ids, vocab_size, device)


def prefix_metadata(prefixes: list[list[list[int]]], params: list[SamplingParams], num_output_tokens: list[int],
                    token_counts: list[TokenCounts | None], eos_token_ids: list[int], vocab_size: int,
                    device: torch.device | str) -> SamplingMetadata:
    """SamplingMetadata over every verify row, given per request the drafted tokens each of its
    rows follows (a chain's row j: drafts[:j]; a tree node's row: its path from the root)."""
    row_params, row_outputs, row_counts = [], [], []
    for rows, p, num_output, counts in zip(prefixes, params, num_output_tokens, token_counts, strict=False):
        for prefix in rows:
            row_params.append(p)
            row_outputs.append(num_output + len(prefix))
            row_counts.append(counts if counts is None or not prefix else _with_tokens(counts, prefix))
    return SamplingMetadata.build(row_params, row_outputs, row_counts, {}, eos_token_ids, vocab_size, device)


def _with_tokens(counts: TokenCounts, token_ids: list[int]) -> TokenCounts:
    """A copy of `counts` that has also seen token_ids (the request's own counts stay as they are)."""
    copy = TokenCounts.__new__(TokenCounts)
    copy.vocab_size, copy.prompt_mask, copy.output_counts = counts.vocab_size, counts.prompt_mask, \
        counts.output_counts.clone()
    for token_id in token_ids:
        copy.add(token_id)
    return copy


def verify_chains(logits: Tensor, drafts: list[list[int]], params: list[SamplingParams],
                  num_output_tokens: list[int], token_counts: list[TokenCounts | None],
                  generators: dict[int, torch.Generator], eos_token_ids: list[int],
                  argmax: Callable[[Tensor], Tensor] | None = None) -> VerifyResult:
    """logits [sum(k_i + 1), V]; token_counts: each request's penalty counts (None without a
    penalty); generators: request index -> its seeded generator; argmax: a row argmax for the
    greedy fast path (raw_argmax_decides), default torch's."""
    if raw_argmax_decides(params, num_output_tokens):
        return _accept_argmax(argmax_list(logits, argmax), drafts)
    meta = row_metadata(drafts, params, num_output_tokens, token_counts, eos_token_ids, logits.shape[-1],
                        logits.device)
    probs = processed_probs(logits, meta)  # [R, V]
    offsets = [0]
    for draft in drafts:
        offsets.append(offsets[-1] + len(draft) + 1)
    token_ids: list[list[int]] = [[] for _ in drafts]
    num_accepted = [0] * len(drafts)
    by_k: dict[int, list[int]] = {}
    for i, draft in enumerate(drafts):
        by_k.setdefault(len(draft), []).append(i)
    for k, members in by_k.items():  # one rejection_sample call per draft length
        rows = torch.tensor([offsets[i] + j for i in members for j in range(k + 1)], device=logits.device)
        target = probs.index_select(0, rows).view(len(members), k + 1, -1)
        draft_ids = torch.tensor([drafts[i] for i in members], dtype=torch.long,
                                 device=logits.device).view(len(members), k)
        greedy = [params[i].greedy for i in members]
        out = rejection_sample(draft_ids, None, target,
                               is_greedy=None if not any(greedy) else torch.tensor(greedy, device=logits.device),
                               generators={row: generators[i] for row, i in enumerate(members) if i in generators},
                               all_greedy=all(greedy))
        for row, (ids, accepted) in enumerate(zip(out.token_ids.tolist(), out.num_accepted.tolist(), strict=False)):
            token_ids[members[row]] = ids[: accepted + 1]
            num_accepted[members[row]] = accepted
    return VerifyResult(token_ids, num_accepted)


def _accept_argmax(best: list[int], drafts: list[list[int]]) -> VerifyResult:
    """Greedy acceptance from each row's argmax: drafts up to the first that is not its row's
    argmax, then that row's argmax (the correction, or the bonus after the last draft)."""
    result = VerifyResult([], [])
    offset = 0
    for draft in drafts:
        rows = best[offset : offset + len(draft) + 1]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == rows[accepted]:
            accepted += 1
        result.token_ids.append([*draft[:accepted], rows[accepted]])
        result.num_accepted.append(accepted)
        offset += len(draft) + 1
    return result


class TreeVerifyResult(NamedTuple):
    token_ids: list[list[int]]
    """Per request: the accepted path's tokens, then the target's correction or bonus token."""
    num_accepted: list[int]
    paths: list[list[int]]
    """Per request: the accepted node ids, root-down (their K/V move to the chain slots)."""


def tree_prefixes(draft: Draft) -> list[list[int]]:
    """The drafted tokens each verify row follows: none for the root, a node's path (itself included)."""
    prefixes: list[list[int]] = [[]]
    for token, parent in zip(draft.token_ids, draft.parent_ids or [], strict=True):
        prefixes.append([*prefixes[parent + 1], token])  # ROOT = -1 -> the root's row
    return prefixes


def verify_trees(logits: Tensor, drafts: list[Draft], params: list[SamplingParams], num_output_tokens: list[int],
                 token_counts: list[TokenCounts | None], generators: dict[int, torch.Generator],
                 eos_token_ids: list[int], argmax: Callable[[Tensor], Tensor] | None = None) -> TreeVerifyResult:
    """logits [sum(N_i + 1), V]: each request's root row, then one row per node in node order.
    Each row's distribution is processed as the Sampler would after its path (penalties, min_tokens);
    greedy rows follow the argmax down the tree, sampled rows the exact tree rule (spec/tree.py)."""
    raw_best = argmax_list(logits, argmax) if raw_argmax_decides(params, num_output_tokens) else None
    if raw_best is None:  # else the raw rows' argmax decides every row: no processed copy
        prefixes = [tree_prefixes(d) for d in drafts]
        meta = prefix_metadata(prefixes, params, num_output_tokens, token_counts, eos_token_ids, logits.shape[-1],
                               logits.device)
        probs = processed_probs(logits, meta)  # [R, V]
    result = TreeVerifyResult([], [], [])
    offset = 0
    for i, draft in enumerate(drafts):
        end = offset + len(draft.token_ids) + 1
        if raw_best is not None:
            path, token = accept_greedy(draft, raw_best[offset:end])
        elif params[i].greedy:
            path, token = accept_greedy(draft, probs[offset:end].argmax(-1).tolist())
        else:
            path, token = accept_sampling(draft, probs[offset:end], generators.get(i))
        offset = end
        result.token_ids.append([*(draft.token_ids[n] for n in path), token])
        result.num_accepted.append(len(path))
        result.paths.append(path)
    return result
