"""Candidate trees: construction (Medusa's static sparse tree, EAGLE-2's dynamic tree),
the tree attention mask, and exact acceptance along the tree.

A tree is a Draft with parent_ids: node i holds token_ids[i] and hangs off
parent_ids[i] (ROOT = the request's last real token). Verify scores the root
and every node in one forward; query row 0 is the root, row i + 1 is node i:

    root ─┬─ n0 ─── n2          rows     0  1  2  3  4
          └─ n1 ─┬─ n3          root     1  .  .  .  .      (1 = may attend;
                 └─ n4          n0       1  1  .  .  .       the context before
                                n1       1  .  1  .  .       the root is seen by all)
                                n2       1  1  .  1  .
                                n3       1  .  1  .  1 ...

A node sits at position root_position + depth and attends to its ancestors
only, so each row computes exactly what a causal pass over its path would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from threefold.spec.proposer import ROOT, Draft


def node_depths(parent_ids: Sequence[int]) -> list[int]:
    """Depth of each node (1 = a child of the root); parents must precede children."""
    depths: list[int] = []
    for parent in parent_ids:
        depths.append(1 if parent == ROOT else depths[parent] + 1)
    return depths


def children_of(parent_ids: Sequence[int]) -> dict[int, list[int]]:
    """node (ROOT for the root) -> its children in node order."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parent_ids):
        children.setdefault(parent, []).append(node)
    return children


def verify_mask(parent_ids: Sequence[int], device: torch.device | str = "cpu") -> Tensor:
    """[N+1, N+1] bool over the verify rows (row 0 = root): row r sees column c iff c is r
    or an ancestor of r. Built in depth passes of tensor ops, not per node pair."""
    num = len(parent_ids) + 1
    parent_row = torch.tensor([0] + [p + 1 for p in parent_ids], device=device)  # root is its own parent
    mask = torch.eye(num, dtype=torch.bool, device=device)
    rows = torch.arange(num, device=device)
    ancestor = parent_row.clone()
    for _ in range(max(node_depths(parent_ids), default=0)):
        mask[rows, ancestor] = True
        ancestor = parent_row[ancestor]
    return mask


def verify_positions(parent_ids: Sequence[int], root_position: int, device: torch.device | str = "cpu") -> Tensor:
    """[N+1] positions of the verify rows: the root's, then root_position + depth."""
    return torch.tensor([root_position] + [root_position + d for d in node_depths(parent_ids)], device=device)


def tree_attention(q: Tensor, k: Tensor, v: Tensor, past_k: Tensor, past_v: Tensor, mask: Tensor,
                   scale: float) -> Tensor:
    """Reference tree attention. q [R, Hq, D]; k, v [R, Hkv, D] for the verify rows;
    past_k, past_v [P, Hkv, D] the context before the root (seen by every row);
    mask [R, R] from verify_mask. Returns [R, Hq, D] in float32 maths, q's dtype."""
    visible = torch.cat([mask.new_ones(mask.shape[0], past_k.shape[0]), mask], dim=1)  # [R, P + R]
    return masked_attention(q, torch.cat([past_k, k]), torch.cat([past_v, v]), visible, scale)


def masked_attention(q: Tensor, keys: Tensor, values: Tensor, visible: Tensor, scale: float) -> Tensor:
    """q [R, Hq, D] over keys/values [S, Hkv, D] where visible [R, S] allows (GQA by repeat)."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)  # [S, Hq, D]
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("rhd,shd->hrs", q.float(), keys) * scale  # [Hq, R, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hrs,shd->rhd", scores.softmax(-1), values).to(q.dtype)


# ---- construction ------------------------------------------------------------
def medusa_tree(paths: Sequence[tuple[int, ...]], topk_ids: Tensor) -> Draft:
    """Medusa's static sparse tree: a path (r_1, .., r_d) is the node whose token is head
    d's r_d-th choice, under the node (r_1, .., r_{d-1}). topk_ids [num_heads, top_k]."""
    index = {path: i for i, path in enumerate(paths)}
    table = topk_ids.tolist()
    tokens = [table[len(p) - 1][p[-1]] for p in paths]
    parents = [index[p[:-1]] if len(p) > 1 else ROOT for p in paths]
    return Draft(tokens, parents)


Expand = Callable[[list[int], list[int], list[int]], Tensor]
"""expand(frontier, token_ids, parent_ids) -> [len(frontier), V] draft log-probabilities of
the next token after each frontier node; token_ids/parent_ids describe every candidate so far."""


def eagle2_tree(root_logprobs: Tensor, expand: Expand, depth: int, top_k: int, total_tokens: int) -> Draft:
    """EAGLE-2's dynamic tree (cnets.topK_genrate): grow by cumulative draft log-probability,
    expanding the top_k frontier at each depth, then keep the best total_tokens nodes.

    root_logprobs [V]: the draft's next-token log-probabilities after the root.
    """
    scores, token_ids = root_logprobs.topk(top_k)
    cand_tokens, cand_parents, cand_scores = token_ids.tolist(), [ROOT] * top_k, scores.tolist()
    frontier = list(range(top_k))
    for _ in range(depth - 1):
        logprobs = expand(frontier, cand_tokens, cand_parents)  # [F, V]
        child_scores, child_ids = logprobs.topk(top_k, dim=-1)  # [F, top_k]
        cumulative = child_scores + torch.tensor([cand_scores[f] for f in frontier])[:, None]
        first = len(cand_tokens)
        cand_tokens += child_ids.flatten().tolist()
        cand_parents += [f for f in frontier for _ in range(top_k)]
        cand_scores += cumulative.flatten().tolist()
        best = cumulative.flatten().topk(min(top_k, cumulative.numel())).indices.tolist()
        frontier = [first + i for i in best]
    return _rerank(cand_tokens, cand_parents, cand_scores, total_tokens)


def _rerank(tokens: list[int], parents: list[int], scores: list[float], total: int) -> Draft:
    """Keep the `total` best candidates whose ancestors are all kept (scores fall along a
    path, so taking them best first, shallower first on ties, sees every parent before its
    children), then renumber in creation order so parents precede children."""
    depths = node_depths(parents)
    kept: set[int] = set()
    for node in sorted(range(len(tokens)), key=lambda n: (-scores[n], depths[n], n)):
        if len(kept) == total:
            break
        if parents[node] == ROOT or parents[node] in kept:
            kept.add(node)
    order = sorted(kept)
    renumber = {old: new for new, old in enumerate(order)}
    return Draft([tokens[n] for n in order], [renumber.get(parents[n], ROOT) for n in order])


# ---- acceptance --------------------------------------------------------------
def accept_greedy(draft: Draft, target_argmax: Sequence[int]) -> tuple[list[int], int]:
    """Greedy: follow the child whose token is the target's argmax at its parent's row.
    target_argmax [N+1] (row 0 = root). Returns (accepted node ids root-down, next token)."""
    children, row = children_of(draft.parent_ids or []), 0
    path: list[int] = []
    node = ROOT
    while True:
        want = target_argmax[row]
        match = next((c for c in children.get(node, ()) if draft.token_ids[c] == want), None)
        if match is None:
            return path, int(want)
        path.append(match)
        node, row = match, match + 1


def accept_sampling(draft: Draft, target_probs: Tensor, generator: torch.Generator | None = None
                    ) -> tuple[list[int], int]:
    """Exact tree acceptance for deterministic drafts (EAGLE's evaluate_posterior at T > 0,
    SpecInfer's multi-step rule with one-hot q): at each node try its children in order,
    accepting child x with probability p(x) under the current residual p; a rejected x gets
    p(x) = 0 and p is renormalised; if none is accepted the token is drawn from the residual.
    Each emitted token is therefore distributed as the target's p. target_probs [N+1, V]."""
    children, row = children_of(draft.parent_ids or []), 0
    path: list[int] = []
    node = ROOT
    while True:
        residual = target_probs[row].double().clone()
        accepted = None
        for child in children.get(node, ()):
            token = draft.token_ids[child]
            mass = float(residual[token] / residual.sum())
            if float(torch.rand((), generator=generator, dtype=torch.float64)) < mass:
                accepted = child
                break
            residual[token] = 0.0
        if accepted is None:
            return path, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
        path.append(accepted)
        node, row = accepted, accepted + 1
