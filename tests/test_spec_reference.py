"""Speculative greedy decoding end to end on real SmolLM2, outside the engine: SpecDecoder's
propose -> one target forward over [last, *drafts] -> verify, for every method, must give the
plain greedy output token for token; a never-right proposer is driven to k = 0."""

from __future__ import annotations

import pytest
import torch

from threefold.sample.params import SamplingParams
from threefold.spec.adaptive import StepCostModel
from threefold.spec.config import SpeculativeConfig
from threefold.spec.decoder import Candidate, SpecDecoder
from threefold.spec.draft_model import DenseKV
from threefold.spec.heads import EagleHead, HeadsConfig, MedusaHeads, save_heads
from threefold.spec.proposer import Draft, Proposer, make_proposer

from model_fixtures import greedy

PROMPT = "Repeat after me: one two three four, one two three four, one two three four"
MAX_TOKENS = 24


@torch.inference_mode()
def speculative_generate(loaded, decoder: SpecDecoder, prompt: list[int], max_tokens: int,
                         params: SamplingParams) -> tuple[list[int], int]:
    """(output ids, target forward steps): a single-sequence engine over a dense KV cache."""
    model, cache = loaded.model, DenseKV()
    tokens, computed, drafts, steps = list(prompt), 0, [], 0
    while len(tokens) - len(prompt) < max_tokens:
        num_real = len(tokens) - computed
        hidden = model(torch.tensor(tokens[computed:] + drafts),
                       torch.arange(computed, len(tokens) + len(drafts)), cache)
        logits = model.compute_logits(hidden[num_real - 1 :])  # [k + 1, vocab]
        result = decoder.verify(["r"], logits, [drafts], [params], [len(tokens) - len(prompt)], [None], {},
                                loaded.eos_token_ids)
        accepted, steps = result.num_accepted[0], steps + 1
        cache.truncate(computed + num_real + accepted)  # rejected drafts' KV goes
        features, start = hidden[: num_real + accepted], computed
        computed += num_real + accepted
        tokens += result.token_ids[0][: max_tokens - (len(tokens) - len(prompt))]
        room = max_tokens - (len(tokens) - len(prompt)) - 1
        proposed = decoder.propose([Candidate("r", tokens, params, room, features, start)], 1, 1)
        drafts = proposed["r"].token_ids if "r" in proposed else []
    return tokens[len(prompt):], steps


def write_random_heads(method, loaded, path):
    torch.manual_seed(0)
    arch = loaded.config
    heads = MedusaHeads(arch.hidden_size, 3) if method == "medusa" else EagleHead(arch)
    save_heads(path, HeadsConfig(method, arch.hidden_size, arch.vocab_size, "smollm2-135m", 3), heads)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "medusa", "eagle"])
def test_greedy_output_is_identical(method, smollm2_fp32, tmp_path):
    prompt = smollm2_fp32.tokenizer.encode(PROMPT)
    options = {"ngram": {}, "draft_model": {"model": "smollm2-135m"}}.get(method, {"model": str(tmp_path)})
    if method in ("medusa", "eagle"):
        write_random_heads(method, smollm2_fp32, tmp_path)
    config = SpeculativeConfig(method, 3, adaptive=False, **options)
    decoder = SpecDecoder(config, make_proposer(config, smollm2_fp32))
    output, steps = speculative_generate(smollm2_fp32, decoder, prompt, MAX_TOKENS, SamplingParams(temperature=0))
    expected, _ = greedy(smollm2_fp32.model, prompt, MAX_TOKENS)
    assert output == expected
    assert decoder.stats.num_drafts > 0
    if method in ("ngram", "draft_model"):  # repetitive text / a perfect draft: speculation pays
        assert steps < MAX_TOKENS
    if method == "draft_model":
        assert decoder.stats.num_accepted_tokens == decoder.stats.num_draft_tokens


class NeverRight(Proposer):
    """Synthetic low-acceptance proposer: drafts a token the target never picks here."""

    @classmethod
    def from_config(cls, config, target=None):
        return cls()

    def propose(self, requests):
        return [Draft([3] * r.num_drafts) for r in requests]


def test_adaptive_k_falls_to_zero_under_low_acceptance(smollm2_fp32):
    prompt = smollm2_fp32.tokenizer.encode(PROMPT)
    config = SpeculativeConfig("ngram", 4)
    # Batch 1 on a small model: a draft costs ~5% of a step, so drafting would pay if it were right.
    cost = StepCostModel({1: 0.010, 2: 0.0105, 64: 0.04})
    decoder = SpecDecoder(config, NeverRight(), cost)
    output, steps = speculative_generate(smollm2_fp32, decoder, prompt, MAX_TOKENS, SamplingParams(temperature=0))
    expected, _ = greedy(smollm2_fp32.model, prompt, MAX_TOKENS)
    assert output == expected and steps == MAX_TOKENS  # the non-speculative step count
    assert decoder.stats.num_accepted_tokens == 0
    # 4 drafts at first, then k shrinks to 0 within a few steps (then a one-draft probe every 16 idle steps).
    assert decoder.stats.num_drafts <= 8 and decoder.stats.num_draft_tokens <= 16, decoder.stats
    assert decoder.controller.choose(["r"], 1, 1) == [0]
