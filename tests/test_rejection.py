"""Speculative acceptance: exact for greedy, distribution-preserving for random rows."""

from __future__ import annotations

import numpy as np
import torch

from threefold.sample.rejection import PLACEHOLDER_TOKEN_ID, rejection_sample

P = PLACEHOLDER_TOKEN_ID


def one_hot_probs(argmaxes, vocab=6):
    """[len, vocab] probabilities whose argmax is each given id."""
    probs = torch.full((len(argmaxes), vocab), 0.1)
    probs[range(len(argmaxes)), argmaxes] = 0.5
    return probs / probs.sum(-1, keepdim=True)


def tv(tokens, probs):
    empirical = np.bincount(tokens.numpy(), minlength=len(probs)) / len(tokens)
    return 0.5 * np.abs(empirical - probs.numpy()).sum()


def test_greedy_accepts_iff_argmax():
    target = torch.stack([
        one_hot_probs([1, 2, 3, 4]),  # drafts [1, 2, 0]: two accepted, then the target's 3
        one_hot_probs([1, 2, 3, 4]),  # all accepted: bonus 4 appended
        one_hot_probs([5, 2, 3, 4]),  # first rejected
    ])
    drafts = torch.tensor([[1, 2, 0], [1, 2, 3], [1, 2, 3]])
    out = rejection_sample(drafts, None, target, all_greedy=True)
    assert out.token_ids.tolist() == [[1, 2, 3, P], [1, 2, 3, 4], [5, P, P, P]]
    assert out.num_accepted.tolist() == [2, 3, 0]
    mixed = rejection_sample(drafts, None, target, is_greedy=torch.tensor([True, True, True]))
    assert torch.equal(mixed.token_ids, out.token_ids)


def test_random_rows_preserve_target_distribution_with_draft_probs():
    n, k, vocab = 200_000, 2, 5
    gen = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, -1)
    draft = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, -1)
    draft_ids = torch.multinomial(draft, n, replacement=True, generator=gen).T  # [n, k], x_i ~ q_i
    torch.manual_seed(1)
    out = rejection_sample(draft_ids, draft.expand(n, k, vocab), target.expand(n, k + 1, vocab))
    # Position 0 always holds a token, and it must be distributed as p_1.
    assert tv(out.token_ids[:, 0], target[0]) < 0.01
    # Given x_1 was accepted, position 1 must be distributed as p_2; likewise the bonus as p_3.
    assert tv(out.token_ids[out.num_accepted >= 1, 1], target[1]) < 0.01
    assert tv(out.token_ids[out.num_accepted == 2, 2], target[2]) < 0.02
    # Acceptance rate of the first draft is sum_x min(p, q) (Leviathan, Definition 3.1).
    expect_rate = torch.minimum(target[0], draft[0]).sum().item()
    assert abs((out.num_accepted >= 1).float().mean().item() - expect_rate) < 0.01
    # Layout: exactly num_accepted + 1 real tokens, then padding.
    valid = (out.token_ids != P).sum(-1)
    assert torch.equal(valid, out.num_accepted + 1)


def test_one_hot_drafts_preserve_target_distribution():
    n, k, vocab = 100_000, 1, 4
    target = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    draft_ids = torch.full((n, k), 2)  # an n-gram guess: q is one-hot on token 2
    torch.manual_seed(2)
    out = rejection_sample(draft_ids, None, target.expand(n, k + 1, vocab))
    assert tv(out.token_ids[:, 0], target[0]) < 0.01
    assert abs(out.num_accepted.float().mean().item() - 0.2) < 0.01  # accepted with prob p(x)
    assert tv(out.token_ids[out.num_accepted == 1, 1], target[1]) < 0.02


def test_identical_draft_and_target_accepts_everything():
    target = torch.softmax(torch.randn(3, 7, generator=torch.Generator().manual_seed(4)), -1)
    draft_ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    out = rejection_sample(draft_ids, target[None, :2].expand(3, 2, 7), target[None].expand(3, 3, 7))
    assert out.num_accepted.tolist() == [2, 2, 2]
    assert torch.equal(out.token_ids[:, :2], draft_ids)


def test_seeded_rows_reproducible_and_mixed_greedy():
    vocab, k = 8, 3
    target = torch.softmax(torch.randn(4, k + 1, vocab, generator=torch.Generator().manual_seed(5)), -1)
    draft_ids = torch.randint(0, vocab, (4, k), generator=torch.Generator().manual_seed(6))
    is_greedy = torch.tensor([False, True, False, False])
    results = []
    for _ in range(2):
        gens = {0: torch.Generator().manual_seed(42), 3: torch.Generator().manual_seed(43)}
        torch.manual_seed(len(results))  # unseeded row 2 may differ; seeded rows must not
        results.append(rejection_sample(draft_ids, None, target, is_greedy=is_greedy, generators=gens))
    assert torch.equal(results[0].token_ids[[0, 3]], results[1].token_ids[[0, 3]])
    greedy = rejection_sample(draft_ids[1:2], None, target[1:2], all_greedy=True)
    assert torch.equal(results[0].token_ids[1], greedy.token_ids[0])
