"""train-draft end to end on a few hundred ShareGPT-train tokens: the loss falls, and the
saved heads load back (and refuse a target they were not trained for)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from threefold.errors import ThreefoldError
from threefold.spec.heads import load_heads
from threefold.spec.train import sharegpt_token_sequences, train


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_train_draft_loss_falls_and_heads_round_trip(method, smollm2_fp32, tmp_path):
    sequences = sharegpt_token_sequences(smollm2_fp32.tokenizer, num_tokens=300, seq_len=100)
    assert sum(map(len, sequences)) == 300
    result = train(method, smollm2_fp32, tmp_path, steps=24, lr=3e-3, num_heads=2, token_sequences=sequences,
                   log_every=0)
    cycle = len(sequences)  # steps cycle over the sequences: compare the same sequences early and late
    first, last = sum(result.losses[:cycle]), sum(result.losses[-cycle:])
    assert last < 0.7 * first, result.losses
    assert result.config.recipe["tokens"] == 300 and result.config.recipe["steps"] == 24
    config, heads = load_heads(tmp_path, smollm2_fp32.config, "smollm2-135m", method)
    assert config.method == method
    for name, tensor in result.heads.state_dict().items():
        torch.testing.assert_close(heads.state_dict()[name], tensor)
    with pytest.raises(ThreefoldError, match="not 'qwen"):
        load_heads(tmp_path, smollm2_fp32.config, "qwen2.5-coder-1.5b")
    other = dataclasses.replace(smollm2_fp32.config, vocab_size=151936)
    with pytest.raises(ThreefoldError, match="vocabulary"):
        load_heads(tmp_path, other)
    with pytest.raises(ThreefoldError, match="holds no draft heads"):
        load_heads(tmp_path / "missing", smollm2_fp32.config)


def test_train_draft_refuses_bad_input(smollm2_fp32):
    with pytest.raises(ThreefoldError, match="not 'ngram'"):
        train("ngram", smollm2_fp32, None, token_sequences=[[1, 2, 3]])
