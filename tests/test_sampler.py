"""Sampler: every transform against a plain per-row reference, plus seeding and statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from threefold.sample.metadata import SamplingMetadata, TokenCounts
from threefold.sample.ops import (
    _apply_top_k_top_p_sorted,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
)
from threefold.sample.params import SamplingParams
from threefold.sample.sampler import Sampler, compute_logprobs_tensors

VOCAB = 64
EOS = 3


def build(params, outputs=None, prompts=None, generators=None, vocab=VOCAB, eos=(EOS,)):
    n = len(params)
    prompts = prompts if prompts is not None else [[] for _ in range(n)]
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    counts = [TokenCounts.for_params(p, prompt, output, vocab, "cpu")
              for p, prompt, output in zip(params, prompts, outputs)]
    return SamplingMetadata.build(params, [len(o) for o in outputs], counts, generators or {}, list(eos), vocab, "cpu")


def random_logits(n, vocab=VOCAB, seed=0, scale=3.0):
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def kept(row):
    return {i for i, x in enumerate(row.tolist()) if x != -math.inf}


# ---------------------------------------------------------------- references (plain loops)


def ref_top_k(row, k):
    values = sorted(row, reverse=True)
    return {i for i, x in enumerate(row) if x >= values[k - 1]}


def ref_top_p(row, p):
    probs = np.exp(np.array(row, dtype=np.float64) - max(row))
    probs /= probs.sum()
    keep, mass = set(), 0.0
    for i in sorted(range(len(row)), key=lambda i: -row[i]):
        keep.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return keep


def ref_min_p(row, min_p):
    probs = np.exp(np.array(row, dtype=np.float64) - max(row))
    probs /= probs.sum()
    return {i for i, x in enumerate(probs) if x >= min_p * probs.max()}


def ref_penalties(row, prompt, output, rep, freq, pres):
    row = list(row)
    for t in range(len(row)):
        if t in prompt or t in output:
            row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
        count = output.count(t)
        row[t] -= freq * count
        row[t] -= pres * (count > 0)
    return row


# ---------------------------------------------------------------- metadata


def test_build_picks_none_for_unused_features():
    meta = build([SamplingParams(), SamplingParams(temperature=0.5)])
    for name in ("top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "output_token_counts", "prompt_token_mask", "max_num_logprobs"):
        assert getattr(meta, name) is None, name
    assert meta.min_tokens_mask == {} and meta.max_top_k == 0
    assert not meta.all_greedy and meta.all_random and not meta.has_penalties


def test_build_fills_used_features_and_neutralises_greedy_rows():
    g = torch.Generator().manual_seed(1)
    params = [
        SamplingParams(temperature=0, top_k=5, top_p=0.5, seed=1, logprobs=2),  # greedy: filters ignored
        SamplingParams(top_k=7, repetition_penalty=1.2, logprobs=0),
        SamplingParams(top_k=VOCAB + 5, min_p=0.1),  # k >= vocab is off
    ]
    meta = build(params, prompts=[[1, 2], [4], []], generators={0: g, 1: torch.Generator()})
    assert meta.temperature.tolist() == [0.0, 1.0, 1.0]
    assert not meta.all_greedy and not meta.all_random
    assert meta.top_k.tolist() == [0, 7, 0] and meta.max_top_k == 7
    assert meta.top_p is None  # only the greedy row asked for it
    assert meta.min_p.tolist() == pytest.approx([0.0, 0.0, 0.1])
    assert meta.repetition_penalty.tolist() == pytest.approx([1.0, 1.2, 1.0])
    assert meta.presence_penalty is None and meta.frequency_penalty is None
    assert [set(row.nonzero().flatten().tolist()) for row in meta.prompt_token_mask] == [set(), {4}, set()]
    assert not meta.output_token_counts.any()
    assert meta.max_num_logprobs == 2
    assert list(meta.generators) == [1]  # a greedy row never consumes its generator

    all_greedy = build([SamplingParams(temperature=0, top_k=3, min_p=0.2)] * 2)
    assert all_greedy.all_greedy and all_greedy.top_k is None and all_greedy.min_p is None


def test_build_min_tokens_mask():
    params = [
        SamplingParams(min_tokens=3, stop_token_ids=[9, 10, VOCAB + 1]),  # out-of-vocab id dropped
        SamplingParams(min_tokens=3, stop_token_ids=[9], ignore_eos=True),
        SamplingParams(min_tokens=2, stop_token_ids=[9]),  # already has 2 outputs
        SamplingParams(),
    ]
    meta = build(params, outputs=[[5, 6], [5], [5, 6], []])
    assert meta.min_tokens_mask == {0: [EOS, 9, 10], 1: [9]}


# ---------------------------------------------------------------- transforms vs references


@pytest.mark.parametrize("k", [1, 2, 10, VOCAB - 1])
def test_top_k_matches_reference(k):
    logits = random_logits(4, seed=k)
    top_k = torch.tensor([k, 0, k, 1])
    out = apply_top_k_top_p(logits.clone(), top_k, k, None)
    for r, kr in enumerate(top_k.tolist()):
        expect = set(range(VOCAB)) if kr == 0 else ref_top_k(logits[r].tolist(), kr)
        assert kept(out[r]) == expect
        assert torch.equal(out[r][list(expect)], logits[r][list(expect)])  # survivors untouched


def test_top_k_keeps_ties_with_kth_value():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    out = apply_top_k_top_p(logits.clone(), torch.tensor([2]), 2, None)
    assert kept(out[0]) == {1, 2, 3}


# Three ways through top-p: candidates that always settle it (width = vocab), a narrow
# candidate set that falls back to sorting on some rows, and the sorted path alone.
TOP_P_PATHS = {
    "candidates": lambda logits, k, max_k, p: apply_top_k_top_p(logits, k, max_k, p, num_candidates=VOCAB),
    "narrow": lambda logits, k, max_k, p: apply_top_k_top_p(logits, k, max_k, p, num_candidates=4),
    "sorted": lambda logits, k, max_k, p: _apply_top_k_top_p_sorted(
        logits, k if k is not None else torch.zeros_like(p, dtype=torch.long), p),
}


@pytest.mark.parametrize("path", TOP_P_PATHS)
@pytest.mark.parametrize("p", [0.05, 0.3, 0.7, 0.95, 1.0])
def test_top_p_matches_reference(p, path):
    logits = random_logits(5, seed=int(p * 100))
    out = TOP_P_PATHS[path](logits.clone(), None, 0, torch.full((5,), p))
    for r in range(5):
        assert kept(out[r]) == ref_top_p(logits[r].tolist(), p)


@pytest.mark.parametrize("path", TOP_P_PATHS)
def test_top_k_then_top_p_matches_reference(path):
    logits = random_logits(6, seed=7)
    top_k = torch.tensor([5, 0, 20, 1, 3, 0])
    top_p = torch.tensor([0.6, 0.8, 0.9, 0.5, 1.0, 1.0])
    out = TOP_P_PATHS[path](logits.clone(), top_k, 20, top_p)
    for r in range(6):
        row, k = logits[r].tolist(), int(top_k[r])
        after_k = [x if k == 0 or i in ref_top_k(row, k) else -math.inf for i, x in enumerate(row)]
        assert kept(out[r]) == ref_top_p(after_k, float(top_p[r]))


@pytest.mark.parametrize("path", TOP_P_PATHS)
def test_top_p_always_keeps_at_least_one_token(path):
    peaked = torch.tensor([[0.0, 20.0, 1.0, 2.0]])
    out = TOP_P_PATHS[path](peaked.clone(), None, 0, torch.tensor([1e-6]))
    assert kept(out[0]) == {1}
    flat = torch.zeros(2, 8)  # all ties: still at least one survivor
    out = TOP_P_PATHS[path](flat.clone(), None, 0, torch.tensor([1e-6, 1e-6]))
    assert all(len(kept(row)) >= 1 for row in out)
    tokens = Sampler()(torch.tensor([[0.0, 20.0, 1.0, 2.0]]), build([SamplingParams(top_p=1e-6)]))
    assert tokens.sampled_token_ids.tolist() == [1]


@pytest.mark.parametrize("min_p", [0.0, 0.01, 0.2, 1.0])
def test_min_p_matches_reference(min_p):
    logits = random_logits(4, seed=3)
    out = apply_min_p(logits.clone(), torch.full((4,), min_p))
    for r in range(4):
        assert kept(out[r]) == ref_min_p(logits[r].tolist(), min_p)


def test_temperature_divides_random_rows_and_leaves_greedy_rows():
    logits = random_logits(3)
    out = apply_temperature(logits.clone(), torch.tensor([0.5, 0.0, 2.0]))
    torch.testing.assert_close(out, torch.stack([logits[0] / 0.5, logits[1], logits[2] / 2.0]))


@pytest.mark.parametrize("rep,freq,pres", [(1.5, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, -1.3), (0.8, 0.4, 1.1)])
def test_penalties_match_reference(rep, freq, pres):
    logits = random_logits(3, seed=11)
    prompts = [[1, 2, 2, 40], [], [5]]
    outputs = [[2, 7, 7, 7], [9, 9, 1], []]
    params = [SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)] * 2
    params.append(SamplingParams())  # neutral row in the same batch
    meta = build(params, outputs=outputs, prompts=prompts)
    out = apply_penalties(logits.clone(), meta)
    for r, p in enumerate(params):
        expect = ref_penalties(logits[r].tolist(), prompts[r], outputs[r], p.repetition_penalty,
                               p.frequency_penalty, p.presence_penalty)
        torch.testing.assert_close(out[r], torch.tensor(expect))


def test_counts_kept_token_by_token_match_a_recount():
    """The runner keeps TokenCounts across steps (add per sampled token): the penalties
    they give must equal the reference over the whole lists at every step."""
    logits = random_logits(2, seed=13)
    prompts = [[1, 2, 2, 40], [5, 63]]
    params = [SamplingParams(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2),
              SamplingParams(frequency_penalty=-0.5)]
    counts = [TokenCounts.for_params(p, prompt, [], VOCAB, "cpu") for p, prompt in zip(params, prompts)]
    outputs = [[], []]
    for step, new in enumerate([(7, 9), (7, 9), (2, 5), (63, 9), (40, 40)]):
        for row, token in enumerate(new):
            outputs[row].append(token)
            counts[row].add(token)
        meta = SamplingMetadata.build(params, [len(o) for o in outputs], counts, {}, [EOS], VOCAB, "cpu")
        out = apply_penalties(logits.clone(), meta)
        for r, p in enumerate(params):
            expect = ref_penalties(logits[r].tolist(), prompts[r], outputs[r], p.repetition_penalty,
                                   p.frequency_penalty, p.presence_penalty)
            torch.testing.assert_close(out[r], torch.tensor(expect), msg=f"step {step} row {r}")


def test_min_tokens_forbids_eos_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[:, EOS] = 50.0
    logits[:, 9] = 40.0  # a stop token, next most likely
    logits[:, 20] = 30.0
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[9])] * 2
    meta = build(params, outputs=[[1], [1, 2]])
    assert Sampler()(logits.expand(2, -1), meta).sampled_token_ids.tolist() == [20, EOS]
    # Random sampling honours it too: EOS and 9 can never be drawn.
    meta = build([SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[9])] * 200)
    assert not set(Sampler()(logits.expand(200, -1), meta).sampled_token_ids.tolist()) & {EOS, 9}


# ---------------------------------------------------------------- sampling


def test_greedy_is_argmax_after_penalties_and_ignores_filters():
    logits = random_logits(8, seed=5)
    params = [SamplingParams(temperature=0, top_k=3, top_p=0.1)] * 8
    assert torch.equal(Sampler()(logits, build(params)).sampled_token_ids, logits.argmax(-1))
    top = int(logits[0].argmax())
    penalised = build([SamplingParams(temperature=0, presence_penalty=2.0)], outputs=[[top]])
    shifted = logits[:1].clone()
    shifted[0, top] -= 2.0
    assert Sampler()(logits[:1], penalised).sampled_token_ids.tolist() == [int(shifted.argmax())]


def test_mixed_batch_greedy_rows_are_argmax():
    logits = random_logits(6, seed=9, scale=0.5)  # flat enough that random rows rarely hit argmax
    params = [SamplingParams(temperature=0 if r % 2 else 1.5) for r in range(6)]
    meta = build(params)
    for _ in range(5):
        out = Sampler()(logits, meta).sampled_token_ids
        assert torch.equal(out[1::2], logits[1::2].argmax(-1))


def test_caller_logits_are_not_modified():
    logits = random_logits(2)
    before = logits.clone()
    params = [SamplingParams(top_k=3, top_p=0.5, min_p=0.1, repetition_penalty=2.0, min_tokens=3)] * 2
    Sampler()(logits, build(params, outputs=[[1], [2]], prompts=[[4], [5]]))
    assert torch.equal(logits, before)


def test_seeded_row_is_independent_of_batch_composition_and_position():
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234)
    alone, in_batch = [], []
    g_alone, g_batch = torch.Generator().manual_seed(1234), torch.Generator().manual_seed(1234)
    torch.manual_seed(0)
    for step in range(30):
        logits = random_logits(8, seed=100 + step, scale=1.0)
        target = logits[5:6]
        alone += Sampler()(target, build([params], generators={0: g_alone})).sampled_token_ids.tolist()
        # In a batch of 8 at row 2, alongside greedy, unseeded and differently seeded rows.
        batch = torch.cat([logits[:2], target, logits[2:5], logits[6:]])
        others = [SamplingParams(temperature=0), SamplingParams(top_k=3), params,
                  SamplingParams(seed=7, temperature=2.0), SamplingParams(), SamplingParams(min_p=0.3),
                  SamplingParams(temperature=0.5), SamplingParams()]
        gens = {2: g_batch, 3: torch.Generator().manual_seed(step)}
        in_batch.append(Sampler()(batch, build(others, generators=gens)).sampled_token_ids[2].item())
    assert alone == in_batch
    assert len(set(alone)) > 5  # genuinely random, not collapsed to argmax
    again = torch.Generator().manual_seed(1234)
    logits = random_logits(8, seed=100, scale=1.0)[5:6]
    assert Sampler()(logits, build([params], generators={0: again})).sampled_token_ids.item() == alone[0]


def test_empirical_distribution_matches_filtered_softmax():
    vocab, num_draws, temperature = 12, 40_000, 0.7
    row = torch.linspace(-2.0, 2.0, vocab)[torch.randperm(vocab, generator=torch.Generator().manual_seed(3))]
    params = SamplingParams(temperature=temperature, top_k=8, top_p=0.9, min_p=0.05)
    # Reference: the three filters applied in order, each by its plain definition.
    scaled = (row / temperature).tolist()
    survivors = ref_min_p(scaled, 0.05) & ref_top_k(scaled, 8)
    survivors &= ref_top_p([x if i in survivors else -math.inf for i, x in enumerate(scaled)], 0.9)
    expect = np.zeros(vocab)
    for i in survivors:
        expect[i] = math.exp(scaled[i])
    expect /= expect.sum()
    torch.manual_seed(1)
    meta = build([params] * num_draws, vocab=vocab)
    tokens = Sampler()(row.expand(num_draws, -1), meta).sampled_token_ids
    empirical = np.bincount(tokens.numpy(), minlength=vocab) / num_draws
    assert set(np.nonzero(empirical)[0]) <= survivors
    assert 0.5 * np.abs(empirical - expect).sum() < 0.015  # TV; sampling noise is ~0.005


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_ranks_correct():
    logits = random_logits(4, seed=21)
    params = [SamplingParams(logprobs=3, temperature=0.3, top_k=2, repetition_penalty=1.7),
              SamplingParams(logprobs=1), SamplingParams(temperature=0), SamplingParams(logprobs=0)]
    out = Sampler()(logits, build(params, prompts=[[1], [2], [3], [4]]))
    lp = out.logprobs
    assert lp.token_ids.shape == (4, 4) and lp.logprobs.shape == (4, 4) and lp.ranks.shape == (4,)
    for r in range(4):
        raw = torch.log_softmax(logits[r].double(), -1)
        token = int(out.sampled_token_ids[r])
        order = sorted(range(VOCAB), key=lambda i: -raw[i].item())
        assert lp.token_ids[r].tolist() == [token, *order[:3]]
        torch.testing.assert_close(lp.logprobs[r].double(), raw[lp.token_ids[r]], rtol=1e-5, atol=1e-5)
        assert int(lp.ranks[r]) == order.index(token) + 1
    assert Sampler()(logits, build([SamplingParams()] * 4)).logprobs is None


def test_compute_logprobs_tensors_reference_and_zero_top():
    logprobs = torch.log_softmax(random_logits(3, seed=2), -1)
    token_ids = torch.tensor([5, 0, 63])
    zero = compute_logprobs_tensors(logprobs, 0, token_ids)
    assert zero.token_ids.tolist() == [[5], [0], [63]]
    torch.testing.assert_close(zero.logprobs[:, 0], logprobs[[0, 1, 2], token_ids])
    for r, t in enumerate(token_ids.tolist()):
        assert int(zero.ranks[r]) == 1 + sum(1 for x in logprobs[r].tolist() if x > logprobs[r, t].item())
    top = compute_logprobs_tensors(logprobs, 5, logprobs.argmax(-1))
    assert top.ranks.tolist() == [1, 1, 1]
    assert torch.equal(top.token_ids[:, 0], top.token_ids[:, 1])
