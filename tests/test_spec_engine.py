"""Speculative decoding in the engine on real SmolLM2: greedy output identical to speculation
off (solo, batched, chunked prefill, preemption, prefix caching), metrics and per-request
accepted counts, and a request's opt-out."""

from __future__ import annotations

import pytest

from prompts import PROMPTS
from threefold.sample.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
REPEATING = ["one two three four, one two three four, one two three four, one two",
             "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "adaptive": False}


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(make_llm):
    llm = make_llm(enable_prefix_caching=False)
    return token_ids(llm.generate(REPEATING + PROMPTS[:6], GREEDY))


@pytest.mark.parametrize("engine_args", [
    {},                                           # batched, prefix caching on
    {"max_num_batched_tokens": 7},                # chunked prefill, drafts cut by the budget
    {"enable_prefix_caching": False, "max_num_seqs": 1},  # solo
])
def test_ngram_greedy_is_identical(make_llm, reference, engine_args):
    llm = make_llm(speculative_config=NGRAM, **engine_args)
    outputs = llm.generate(REPEATING + PROMPTS[:6], GREEDY)
    assert token_ids(outputs) == reference
    stats = llm.engine.get_stats()
    assert stats.spec_num_drafts > 0 and 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert sum(stats.spec_num_accepted_tokens_per_pos) == stats.spec_num_accepted_tokens
    assert sum(o.num_accepted_tokens for o in outputs) == stats.spec_num_accepted_tokens
    assert stats.kv_cache_usage == 0.0


def test_ngram_greedy_under_preemption(make_llm, reference):
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4
    llm = make_llm(speculative_config=NGRAM, kv_cache_memory=12 * block_bytes, max_model_len=96)
    outputs = llm.generate(REPEATING + PROMPTS[:6], GREEDY)
    assert token_ids(outputs) == reference
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0
    assert stats.kv_cache_usage == 0.0


def test_request_can_opt_out(make_llm, reference):
    llm = make_llm(speculative_config=NGRAM)
    outputs = llm.generate(REPEATING[:1], GREEDY.clone(speculative=False))
    assert token_ids(outputs) == reference[:1]
    assert llm.engine.get_stats().spec_num_drafts == 0
