"""SpeculativeConfig: vLLM's shape, and a clear ThreefoldError for every bad value."""

from __future__ import annotations

import pytest

from threefold.errors import ThreefoldError
from threefold.spec.config import SpeculativeConfig
from threefold.spec.proposer import make_proposer, proposer_class


def test_issue_examples_parse():
    ngram = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1}')
    assert (ngram.method, ngram.num_speculative_tokens, ngram.lookup_max, ngram.lookup_min) == ("ngram", 5, 4, 1)
    assert ngram.num_lookahead_tokens == 5 and not ngram.uses_tree
    draft = SpeculativeConfig.parse({"method": "draft_model", "model": "qwen2.5-coder-0.5b",
                                     "num_speculative_tokens": 5})
    assert draft.model == "qwen2.5-coder-0.5b"
    eagle = SpeculativeConfig.parse({"method": "eagle", "model": "heads/", "num_speculative_tokens": 4,
                                     "tree_top_k": 3, "tree_total_tokens": 10})
    assert eagle.uses_tree and eagle.num_lookahead_tokens == 10
    medusa = SpeculativeConfig.parse({"method": "medusa", "model": "heads/", "num_speculative_tokens": 2,
                                      "speculative_token_tree": "[(0,), (1,), (0, 0), (1, 0)]"})
    assert medusa.tree_paths() == [(0,), (1,), (0, 0), (1, 0)] and medusa.num_lookahead_tokens == 4
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse(ngram) is ngram


BAD = [
    ('{"method": "ngram"', "not valid JSON", "speculative_config"),
    ('[1, 2]', "must be a JSON object", "speculative_config"),
    ({"num_speculative_tokens": 3}, "needs a method", "speculative_config.method"),
    ({"method": "lookahead"}, "unknown speculative method 'lookahead'", "speculative_config.method"),
    ({"method": "ngram", "k": 3}, "unknown speculative_config key(s) ['k']", "speculative_config"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "in [1, 16], got 0",
     "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "got 17", "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "got 2.5", "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "must not exceed",
     "speculative_config.prompt_lookup_min"),
    ({"method": "ngram", "prompt_lookup_max": 0}, "prompt_lookup_max must be an integer in [1, 32]",
     "speculative_config.prompt_lookup_max"),
    ({"method": "ngram", "model": "x"}, "takes no model", "speculative_config.model"),
    ({"method": "draft_model"}, "needs model", "speculative_config.model"),
    ({"method": "ngram", "quantization": "int8"}, "has no draft model", "speculative_config.quantization"),
    ({"method": "draft_model", "model": "m", "quantization": "int4"}, "must be 'int8' or null",
     "speculative_config.quantization"),
    ({"method": "ngram", "draft_vocab_size": 4096}, "method 'ngram' drafts from the context",
     "speculative_config.draft_vocab_size"),
    ({"method": "draft_model", "model": "m", "draft_vocab_size": -1}, "non-negative integer",
     "speculative_config.draft_vocab_size"),
    ({"method": "eagle", "model": ""}, "a heads directory", "speculative_config.model"),
    ({"method": "eagle", "model": "h", "prompt_lookup_max": 2}, "apply only to method 'ngram'",
     "speculative_config.prompt_lookup_max"),
    ({"method": "medusa", "model": "h", "tree_top_k": 4}, "EAGLE-2's dynamic tree", "speculative_config.tree_top_k"),
    ({"method": "eagle", "model": "h", "tree_top_k": 0}, "tree_top_k must be", "speculative_config.tree_top_k"),
    ({"method": "eagle", "model": "h", "tree_total_tokens": 500}, "tree_total_tokens must be",
     "speculative_config.tree_total_tokens"),
    ({"method": "eagle", "model": "h", "speculative_token_tree": "[(0,)]"}, "Medusa's static tree",
     "speculative_config.speculative_token_tree"),
    ({"method": "medusa", "model": "h", "speculative_token_tree": "[(0, 0)]"}, "comes before its parent",
     "speculative_config.speculative_token_tree"),
    ({"method": "medusa", "model": "h", "speculative_token_tree": "[(0,), (0,)]"}, "listed twice",
     "speculative_config.speculative_token_tree"),
    ({"method": "medusa", "model": "h", "num_speculative_tokens": 1, "speculative_token_tree": "[(0,), (0, 0)]"},
     "1..num_speculative_tokens=1", "speculative_config.speculative_token_tree"),
    ({"method": "medusa", "model": "h", "speculative_token_tree": "oops("}, "list of tuples",
     "speculative_config.speculative_token_tree"),
    ({"method": "ngram", "acceptance_ema_weight": 0}, "acceptance_ema_weight",
     "speculative_config.acceptance_ema_weight"),
    ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size",
     "speculative_config.disable_by_batch_size"),
    ({"method": "ngram", "adaptive": "yes"}, "adaptive must be", "speculative_config.adaptive"),
]


@pytest.mark.parametrize("value, message, param", BAD)
def test_bad_config_is_a_clear_error(value, message, param):
    with pytest.raises(ThreefoldError) as info:
        SpeculativeConfig.parse(value)
    assert message in info.value.message
    assert info.value.param == param and info.value.status_code == 400


def test_registry():
    assert proposer_class("ngram").__name__ == "NgramProposer"
    with pytest.raises(ThreefoldError, match="has no proposer here"):
        proposer_class("nope")
    assert make_proposer(SpeculativeConfig("ngram")).n_max == 4
