"""The draft-model proposer: drafts are the draft's own greedy continuation, its KV follows
the request incrementally, and a draft with another vocabulary is refused at startup."""

from __future__ import annotations

import json

import pytest

from threefold.errors import ThreefoldError
from threefold.spec.config import SpeculativeConfig
from threefold.spec.proposer import DraftRequest, make_proposer

from model_fixtures import greedy, smollm2_hf_tokenizer


def test_self_draft_is_the_greedy_continuation(smollm2_fp32):
    proposer = make_proposer(SpeculativeConfig("draft_model", 4, model="smollm2-135m"), smollm2_fp32)
    prompt = smollm2_fp32.tokenizer.encode("The three primary colours are")
    expected, _ = greedy(smollm2_fp32.model, prompt, 8)
    (first,) = proposer.propose([DraftRequest("r", prompt, 4)])
    assert first.token_ids == expected[:4]
    # Two drafts accepted plus the bonus: the cache catches up on three real tokens, not the prompt.
    tokens = prompt + expected[:3]
    (second,) = proposer.propose([DraftRequest("r", tokens, 4)])
    assert second.token_ids == expected[3:7]
    assert proposer.caches["r"][0].length == len(tokens)
    # Asked again with nothing new, it drafts the same; a rewritten history is recomputed.
    assert proposer.propose([DraftRequest("r", tokens, 4)])[0].token_ids == expected[3:7]
    assert proposer.propose([DraftRequest("r", prompt, 2)])[0].token_ids == expected[:2]
    proposer.remove("r")
    assert not proposer.caches


def test_draft_with_another_vocabulary_is_refused(smollm2_fp32, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    smollm2_hf_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    with pytest.raises(ThreefoldError, match="vocabulary of 32000 rows") as info:
        make_proposer(SpeculativeConfig("draft_model", 3, model=str(tmp_path)), smollm2_fp32)
    assert info.value.param == "speculative_config.model"


def test_prompt_prefill_is_catch_up_not_drafting(smollm2_fp32):
    """A prompt longer than any verify step adds is fed in a forward of its own, timed apart from the
    drafts (the adaptive controller's cost per draft token leaves it out); the drafts do not change."""
    proposer = make_proposer(SpeculativeConfig("draft_model", 4, model="smollm2-135m"), smollm2_fp32)
    prompt = smollm2_fp32.tokenizer.encode("Here is a list of the planets of the solar system, in order from the "
                                           "Sun, with one fact about each of them:\n1. Mercury")
    assert len(prompt) > 17  # MAX_SPECULATIVE_TOKENS + 1
    expected, _ = greedy(smollm2_fp32.model, prompt, 8)
    assert proposer.propose([DraftRequest("r", prompt, 4)])[0].token_ids == expected[:4]
    assert proposer.catch_up_seconds > 0
    assert proposer.propose([DraftRequest("r", prompt + expected[:3], 4)])[0].token_ids == expected[3:7]
    assert proposer.catch_up_seconds == 0  # a verify step's worth of new tokens is part of drafting
