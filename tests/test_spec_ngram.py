"""Prompt-lookup drafting against a brute-force reference, and the proposer's per-request state."""

from __future__ import annotations

import numpy as np
import pytest

from threefold.spec.config import SpeculativeConfig
from threefold.spec.ngram import NgramProposer, ngram_lookup
from threefold.spec.proposer import DraftRequest, make_proposer


def brute_force(context: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Longest suffix n-gram first; among equal n the most recent earlier occurrence."""
    for n in range(min(n_max, len(context) - 1), n_min - 1, -1):
        suffix = context[-n:]
        for end in range(len(context) - 2, n - 2, -1):  # end = index of the match's last token
            if context[end - n + 1 : end + 1] == suffix:
                return context[end + 1 : end + 1 + k]
    return []


def test_examples():
    ctx = np.array([1, 2, 3, 4, 9, 9, 1, 2, 3])
    assert ngram_lookup(ctx, 1, 4, 3).tolist() == [4, 9, 9]
    # nothing recurs: no drafts
    assert ngram_lookup(np.array([1, 2, 3, 4]), 1, 4, 3).tolist() == []
    # n_min 2: a single-token match is not enough
    assert ngram_lookup(np.array([5, 7, 1, 9, 5]), 2, 4, 3).tolist() == []
    assert ngram_lookup(np.array([5, 7, 1, 9, 5]), 1, 4, 3).tolist() == [7, 1, 9]
    # the longest match beats a more recent shorter one
    ctx = np.array([8, 1, 2, 3, 40, 2, 3, 50, 1, 2, 3])
    assert ngram_lookup(ctx, 1, 3, 2).tolist() == [40, 2]
    # overlapping self-repetition (a run) drafts the run
    assert ngram_lookup(np.array([7, 7, 7, 7]), 1, 2, 5).tolist() == [7]


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    length, vocab = int(rng.integers(1, 80)), int(rng.integers(2, 6))
    ctx = rng.integers(0, vocab, length)
    n_min = int(rng.integers(1, 4))
    n_max = int(rng.integers(n_min, 6))
    k = int(rng.integers(1, 7))
    assert ngram_lookup(ctx, n_min, n_max, k).tolist() == brute_force(ctx.tolist(), n_min, n_max, k)


def test_lookback_bounds_the_search():
    ctx = np.array([1, 2, 3] + [0] * 50 + [1, 2])
    assert ngram_lookup(ctx, 1, 2, 1).tolist() == [3]
    assert ngram_lookup(ctx, 2, 2, 1, lookback=20).tolist() == []


def test_proposer_keeps_context_incrementally_and_rebuilds():
    proposer = make_proposer(SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_max=2))
    assert isinstance(proposer, NgramProposer)
    tokens = [1, 2, 3, 4, 1, 2]
    first = proposer.propose([DraftRequest("a", tokens, 3), DraftRequest("b", [5, 6], 2)])
    assert [d.token_ids for d in first] == [[3, 4, 1], []]
    assert not first[0].is_tree
    tokens += [3, 4]  # the engine appended accepted tokens
    assert proposer.propose([DraftRequest("a", tokens, 2)])[0].token_ids == [1, 2]
    # a different history for the same id (preempted, then recomputed differently) is taken afresh
    assert proposer.propose([DraftRequest("a", [9, 8, 9], 2)])[0].token_ids == [8, 9]
    proposer.remove("a")
    assert "a" not in proposer.contexts
