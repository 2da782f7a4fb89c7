"""train-draft end to end on a few hundred ShareGPT-train tokens, as written and self-generated
by the target: the loss falls, and the saved heads load back (and refuse a target they were
not trained for)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from threefold.errors import ThreefoldError
from threefold.spec.heads import EagleHead, HeadsConfig, draft_vocab_ids, load_heads
from threefold.spec.heads_proposer import EagleProposer
from threefold.spec.proposer import ROOT, DraftRequest
from threefold.spec.train import (
    Batch,
    Sequence,
    draft_vocab_coverage,
    eagle_passes,
    load_sequences,
    rank_draft_vocab,
    self_distillation_data,
    sharegpt_token_sequences,
    target_sequences,
    train,
)


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


def test_batched_target_features_equal_one_sequence_at_a_time(smollm2_fp32):
    sequences = sharegpt_token_sequences(smollm2_fp32.tokenizer, num_tokens=200, seq_len=70)
    lengths = list(map(len, sequences))
    assert len(set(lengths)) > 1  # right padding is exercised
    batched = target_sequences(smollm2_fp32.model, sequences, forward_tokens=10_000)
    alone = target_sequences(smollm2_fp32.model, sequences, forward_tokens=1)
    for a, b, ids in zip(batched, alone, sequences, strict=True):
        assert a.token_ids.tolist() == ids
        torch.testing.assert_close(a.features, b.features, atol=2e-4, rtol=1e-4)
        assert (a.labels == b.labels).float().mean() > 0.98


@pytest.fixture(scope="module")
def own_answers(smollm2_fp32, tmp_path_factory):
    """The target's greedy answers to 4 ShareGPT-train prompts (16 tokens each), through the cache."""
    cache = tmp_path_factory.mktemp("self") / "data.safetensors"
    data, info = self_distillation_data(smollm2_fp32, num_prompts=4, max_new_tokens=16, cache=cache)
    return data, info, cache


def test_self_distillation_data_is_the_targets_own_answers(own_answers):
    data, info, cache = own_answers
    assert info["prompts"] == 4 and all(0 < len(s.token_ids) - s.answer_start <= 16 for s in data)
    # The engine's greedy answer is the target's argmax at each answer position (its labels).
    agree = [float((s.labels[s.answer_start - 1 : -1] == s.token_ids[s.answer_start :]).float().mean()) for s in data]
    assert min(agree) > 0.9, agree
    again, again_info = load_sequences(cache)  # the cache round-trips
    assert again_info == info
    assert [(s.token_ids.tolist(), s.answer_start) for s in again] == [(s.token_ids.tolist(), s.answer_start)
                                                                       for s in data]
    torch.testing.assert_close(again[1].features, data[1].features)


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_train_draft_on_the_targets_own_answers(method, smollm2_fp32, own_answers, tmp_path):
    data, info, _ = own_answers
    result = train(method, smollm2_fp32, tmp_path, steps=10, lr=1e-3, num_heads=2, data=data, data_info=info,
                   batch_size=3, val_fraction=0.25, log_every=0)
    assert result.losses[-1] < 0.7 * result.losses[0], result.losses  # every step sees all 3 training sequences
    recipe = result.config.recipe
    assert recipe["sequences"] == 3 and recipe["held_out_sequences"] == 1 and recipe["data"] == "self"
    assert recipe["loss_rows"] == sum(len(s.token_ids) - s.answer_start for s in data[:3])  # the answers' rows only
    assert result.val_accuracy is not None and len(result.val_accuracy) == (2 if method == "medusa" else 1)
    config, _ = load_heads(tmp_path, smollm2_fp32.config, "smollm2-135m", method)
    assert config.recipe["val_top1"] == [round(a, 4) for a in result.val_accuracy]
    # The heads keep the tokens the target wrote on the training rows, most often first, as their
    # draft vocabulary (all of them here: fewer than the default size).
    ranked = rank_draft_vocab(data[:3], config.vocab_size)
    written = torch.cat([s.labels[s.first_row :] for s in data[:3]])
    assert config.draft_vocab_size == len(ranked) == len(set(written.tolist()))
    assert draft_vocab_ids(tmp_path, config, None).tolist() == ranked.tolist()
    assert draft_vocab_ids(tmp_path, config, 0) is None
    assert recipe["draft_vocab"]["coverage_train"][1024] == 1.0


def test_eagle_training_passes_are_the_chain_the_proposer_drafts(smollm2_fp32):
    """The training-time test's pass d at row t is the head's output on the d-th node of a chain drafted
    after position t + 1 (fed the true tokens), as EagleProposer absorbs the real pairs and expands the
    chain: training sees what drafting computes, in right-padded batches too."""
    torch.manual_seed(0)
    model = smollm2_fp32.model
    head = EagleHead(smollm2_fp32.config).eval()
    long, short = sharegpt_token_sequences(smollm2_fp32.tokenizer, num_tokens=70, seq_len=40)[:2]
    assert len(long) > len(short)
    data = target_sequences(model, [long, short])
    with torch.no_grad():
        passes = eagle_passes(head, model.embed_tokens.weight, Batch.of(data), depth=3)
    proposer = EagleProposer(head, model)
    for row, (ids, sequence) in enumerate(zip([long, short], data, strict=True)):
        for t in (0, 7, len(ids) - 4):
            request = DraftRequest(f"r{row}-{t}", ids[: t + 2], 3, sequence.features[: t + 1], 0)
            with torch.no_grad():
                state = proposer._absorb(request)
                features: dict = {}
                slots: dict = {}
                proposer._expand(state, t + 1, [0], [ids[t + 2]], [ROOT], features, slots)
                proposer._expand(state, t + 1, [1], [ids[t + 2], ids[t + 3]], [ROOT, 0], features, slots)
            for depth, feature in enumerate([state.root_feature, features[0], features[1]]):
                torch.testing.assert_close(feature, passes[depth][row, t], atol=1e-4, rtol=1e-4)


def test_train_draft_eagle_deeper_than_one_draft(smollm2_fp32, own_answers, tmp_path):
    data, info, _ = own_answers
    result = train("eagle", smollm2_fp32, tmp_path, steps=10, lr=1e-3, data=data, data_info=info, batch_size=3,
                   val_fraction=0.25, log_every=0, depth=2, val_every=5)
    assert result.losses[-1] < 0.7 * result.losses[0], result.losses
    assert len(result.accuracy) == 2 and result.val_accuracy is not None and len(result.val_accuracy) == 2
    config, _ = load_heads(tmp_path, smollm2_fp32.config, "smollm2-135m", "eagle")
    assert config.recipe["depth"] == 2 and [step for step, _ in config.recipe["val_top1_curve"]] == [5]
    # --init starts from saved heads (here not moved: lr 0), e.g. EAGLE-1 heads trained on deeper.
    again = train("eagle", smollm2_fp32, None, steps=1, lr=0.0, data=data, data_info=info, batch_size=3,
                  log_every=0, depth=3, init=tmp_path)
    assert again.config.recipe["init"] == str(tmp_path) and len(again.accuracy) == 3
    for name, tensor in result.heads.state_dict().items():
        torch.testing.assert_close(again.heads.state_dict()[name], tensor)
    for method, depth in (("eagle", 0), ("medusa", 2)):
        with pytest.raises(ThreefoldError, match="depth"):
            train(method, smollm2_fp32, None, data=data, depth=depth)


def test_draft_vocabulary_ranks_the_written_tokens_by_count():
    def rows(labels, first_row=0):
        labels = torch.tensor(labels)
        return Sequence(labels, torch.zeros(len(labels), 2), labels, answer_start=first_row + 1 if first_row else 0)

    data = [rows([5, 5, 7, 2, 9, 9, 9], first_row=1), rows([2, 7, 7, 5])]  # the first row of data[0] is a prompt's
    ranked = rank_draft_vocab(data, vocab_size=12)
    assert ranked.tolist() == [7, 9, 2, 5]  # 3, 3, 2, 2 times (the prompt's 5 not counted): ties by id
    assert draft_vocab_coverage(ranked, data, 12, sizes=(1, 3, 4)) == {1: 0.3, 3: 0.8, 4: 1.0}
    assert draft_vocab_coverage(ranked, [rows([1, 5])], 12, sizes=(4,)) == {4: 0.5}  # 1 was never written
    assert HeadsConfig("eagle", 2, 12, "t").draft_vocab_size == 0  # heads of older recipes: the whole vocabulary
