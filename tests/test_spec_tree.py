"""Candidate trees: the mask against a brute-force ancestor walk, tree attention and a real
model's tree forward against one causal pass per path, construction, and exact acceptance."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from threefold.spec.proposer import ROOT, Draft
from threefold.spec.tree import (
    accept_greedy,
    accept_sampling,
    eagle2_tree,
    medusa_tree,
    node_depths,
    tree_attention,
    verify_mask,
    verify_positions,
)

from model_fixtures import dense_causal_attention


def random_tree(rng: random.Random, num_nodes: int) -> list[int]:
    return [rng.choice([ROOT, *range(i)]) for i in range(num_nodes)]


def path_to(parent_ids, node) -> list[int]:
    """Brute force: the node ids from the root's child down to `node`."""
    path = []
    while node != ROOT:
        path.append(node)
        node = parent_ids[node]
    return path[::-1]


@pytest.mark.parametrize("seed", range(10))
def test_mask_matches_brute_force_ancestors(seed):
    parents = random_tree(random.Random(seed), 12)
    mask = verify_mask(parents)
    for node in range(len(parents)):
        seen = {0} | {n + 1 for n in path_to(parents, node)}
        assert {c for c in range(len(parents) + 1) if mask[node + 1, c]} == seen
    assert mask[0].tolist() == [True] + [False] * len(parents)
    assert verify_positions(parents, 7).tolist() == [7] + [7 + len(path_to(parents, n)) for n in range(12)]


@pytest.mark.parametrize("seed", range(5))
def test_tree_attention_equals_causal_attention_per_path(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    parents = random_tree(rng, 9)
    rows, past, heads, kv_heads, dim = len(parents) + 1, 5, 4, 2, 8
    q = torch.randn(rows, heads, dim, generator=gen)
    k, v = torch.randn(2, rows, kv_heads, dim, generator=gen)
    past_k, past_v = torch.randn(2, past, kv_heads, dim, generator=gen)
    out = tree_attention(q, k, v, past_k, past_v, verify_mask(parents), dim ** -0.5)
    for node in range(len(parents)):
        path_rows = [0] + [n + 1 for n in path_to(parents, node)]
        seq_q = torch.cat([torch.zeros(past, heads, dim), q[path_rows]])
        ref = dense_causal_attention(0, seq_q, torch.cat([past_k, k[path_rows]]), torch.cat([past_v, v[path_rows]]))
        torch.testing.assert_close(out[node + 1], ref[-1], rtol=1e-5, atol=1e-5)


class TreeForward:
    """An AttentionFn over a dense context cache plus the verify rows under a tree mask."""

    def __init__(self, past: dict[int, tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor, scale: float):
        self.past, self.mask, self.scale = past, mask, scale

    def __call__(self, layer_idx, q, k, v):
        past_k, past_v = self.past[layer_idx]
        return tree_attention(q, k, v, past_k, past_v, self.mask, self.scale)


class RecordingCausal:
    """Causal attention over one sequence that keeps each layer's K/V (the context cache)."""

    def __init__(self):
        self.kv = {}

    def __call__(self, layer_idx, q, k, v):
        self.kv[layer_idx] = (k.clone(), v.clone())
        return dense_causal_attention(layer_idx, q, k, v)


@torch.inference_mode()
def test_real_model_tree_forward_equals_one_forward_per_path(smollm2_fp32):
    model = smollm2_fp32.model
    context = smollm2_fp32.tokenizer.encode("The capital of France is Paris. The capital of")
    rng = random.Random(0)
    parents = random_tree(rng, 10)
    tokens = [rng.randrange(1000, 20000) for _ in parents]
    recorder = RecordingCausal()
    model(torch.tensor(context[:-1]), torch.arange(len(context) - 1), recorder)
    root = len(context) - 1
    rows = torch.tensor([context[-1], *tokens])
    attention = TreeForward(recorder.kv, verify_mask(parents), model.config.head_dim ** -0.5)
    tree_logits = model.compute_logits(model(rows, verify_positions(parents, root), attention))
    for node in range(len(parents)):
        sequence = context + [tokens[n] for n in path_to(parents, node)]
        hidden = model(torch.tensor(sequence), torch.arange(len(sequence)), dense_causal_attention)
        torch.testing.assert_close(tree_logits[node + 1], model.compute_logits(hidden[-1:])[0], rtol=1e-4, atol=1e-4)
    causal = model(torch.tensor(context), torch.arange(len(context)), dense_causal_attention)
    torch.testing.assert_close(tree_logits[0], model.compute_logits(causal[-1:])[0], rtol=1e-4, atol=1e-4)


def test_medusa_tree_from_paths():
    topk = torch.tensor([[10, 11, 12], [20, 21, 22]])  # head 0 (next+1), head 1 (next+2)
    draft = medusa_tree([(0,), (1,), (0, 0), (0, 2), (1, 1)], topk)
    assert draft == Draft([10, 11, 20, 22, 21], [ROOT, ROOT, 0, 0, 1])


def table_expand(table):
    """A synthetic draft model: the next-token log-probs depend only on the node's token."""
    def expand(frontier, tokens, parents):
        return torch.stack([table[tokens[f]] for f in frontier])
    return expand


def test_eagle2_tree_keeps_the_best_connected_nodes():
    vocab = 6
    gen = torch.Generator().manual_seed(0)
    table = torch.log_softmax(torch.randn(vocab, vocab, generator=gen) * 2, -1)
    root = torch.log_softmax(torch.randn(vocab, generator=gen) * 2, -1)
    draft = eagle2_tree(root, table_expand(table), depth=3, top_k=2, total_tokens=5)
    assert len(draft.token_ids) == 5
    assert all(p == ROOT or p < i for i, p in enumerate(draft.parent_ids))
    # Brute force: every tree node's cumulative score beats every dropped candidate whose parent
    # was kept (that candidate could have been taken instead).
    def score(node):
        path = path_to(draft.parent_ids, node)
        total, prev = 0.0, None
        for n in path:
            total += float((root if prev is None else table[prev])[draft.token_ids[n]])
            prev = draft.token_ids[n]
        return total
    worst_kept = min(score(n) for n in range(5))
    kept_paths = {tuple(draft.token_ids[n] for n in path_to(draft.parent_ids, n)) for n in range(5)}
    # Depths 1 and 2 are enumerated in full here (the frontier is every root child): any such
    # candidate that scores above the worst kept node must be in the tree.
    for first in root.topk(2).indices.tolist():
        assert float(root[first]) < worst_kept or (first,) in kept_paths
        for second in table[first].topk(2).indices.tolist():
            value = float(root[first] + table[first][second])
            assert value < worst_kept or (first, second) in kept_paths
    chain = eagle2_tree(root, table_expand(table), depth=4, top_k=1, total_tokens=4)
    assert chain.parent_ids == [ROOT, 0, 1, 2]
    expected, prev = [], int(root.argmax())
    for _ in range(4):
        expected.append(prev)
        prev = int(table[prev].argmax())
    assert chain.token_ids == expected


def test_accept_greedy_follows_argmax():
    draft = Draft([5, 6, 7, 8], [ROOT, ROOT, 1, 1])  # root -> 5 | 6 -> {7, 8}
    # rows: root, n0, n1, n2, n3
    assert accept_greedy(draft, [6, 0, 8, 0, 3]) == ([1, 3], 3)
    assert accept_greedy(draft, [9, 0, 0, 0, 0]) == ([], 9)
    assert accept_greedy(Draft([], []), [4]) == ([], 4)


CHI2_CRITICAL_DF4 = 18.47
"""The chi-square statistic with 4 degrees of freedom exceeds this with probability 0.001."""


def chi_square(samples, probs):
    observed = np.bincount(samples, minlength=len(probs))
    expected = probs.double().numpy() * len(samples)
    return float(((observed - expected) ** 2 / expected).sum())


def test_accept_sampling_preserves_the_target_distribution():
    vocab, trials = 5, 20000
    gen = torch.Generator().manual_seed(0)
    draft = Draft([0, 1, 2, 3], [ROOT, ROOT, 0, 0])  # root -> {0 -> {2, 3}, 1}
    target = torch.softmax(torch.randn(5, vocab, generator=gen), -1)
    first, second = [], []
    for _ in range(trials):
        path, bonus = accept_sampling(draft, target, gen)
        emitted = [draft.token_ids[n] for n in path] + [bonus]
        first.append(emitted[0])
        if path and path[0] == 0:
            second.append(emitted[1])
    assert chi_square(np.array(first), target[0]) < CHI2_CRITICAL_DF4
    assert chi_square(np.array(second), target[1]) < CHI2_CRITICAL_DF4  # given the first token was node 0's
    # A tempting wrong rule (take the argmax child if drafted, else sample p without the drafted
    # children) fails the same check.
    wrong = []
    for _ in range(trials):
        best, residual = int(target[0].argmax()), target[0].clone()
        residual[[0, 1]] = 0.0
        wrong.append(best if best in (0, 1) else int(torch.multinomial(residual, 1, generator=gen)))
    assert chi_square(np.array(wrong), target[0]) > 100 * CHI2_CRITICAL_DF4
    assert node_depths(draft.parent_ids) == [1, 1, 2, 2]
