"""Speculative decoding in the engine on real SmolLM2: greedy output identical to speculation
off (solo, batched, chunked prefill, preemption, prefix caching), metrics and per-request
accepted counts, and a request's opt-out."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest

from threefold.sample.params import SamplingParams
from threefold.spec.ngram import ngram_lookup
from threefold.spec.proposer import Draft, DraftRequest, Proposer

from prompts import PROMPTS

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


def write_random_heads(method, loaded, path, draft_vocab_size=0):
    """draft_vocab_size: the heads draft over that many ids (a seeded random ranking)."""
    import torch

    from threefold.spec.heads import EagleHead, HeadsConfig, MedusaHeads, save_heads

    torch.manual_seed(0)
    arch = loaded.config
    heads = MedusaHeads(arch.hidden_size, 4) if method == "medusa" else EagleHead(arch)
    ranked = torch.randperm(arch.vocab_size)[:draft_vocab_size] if draft_vocab_size else None
    save_heads(path, HeadsConfig(method, arch.hidden_size, arch.vocab_size, loaded.name, 4,
                                 draft_vocab_size=draft_vocab_size), heads, ranked)


@pytest.mark.parametrize("method", ["draft_model", "draft_model:int8", "draft_model:vocab", "medusa", "eagle",
                                    "eagle:vocab"])
def test_every_method_greedy_is_identical(make_llm, smollm2_fp32, reference, method, tmp_path, monkeypatch):
    method, _, vocab = method.partition(":")  # vocab: drafts over a draft vocabulary (FR-Spec)
    config = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        # The target drafting for itself: every draft is accepted. A draft costing what the target costs
        # never pays, so the adaptive controller (its price profiled at startup) would not draft: fixed k.
        # int8: the target drafting through int8 weights; vocab: over 2000 ids; either may be rejected.
        config.update(model="smollm2-135m", adaptive=False)
        if vocab == "int8":
            config["quantization"] = "int8"
        elif vocab:
            import threefold.spec.draft_vocab as draft_vocab

            monkeypatch.setenv("THREEFOLD_HOME", str(tmp_path))
            monkeypatch.setattr(draft_vocab, "CORPUS_TOKENS", 20_000)
            config["draft_vocab_size"] = 2000
    else:
        write_random_heads(method, smollm2_fp32, tmp_path, 4096 if vocab else 0)
        config["model"] = str(tmp_path)
    llm = make_llm(speculative_config=config, max_num_batched_tokens=64)  # adaptive, chunked prefill
    outputs = llm.generate(REPEATING + PROMPTS[:6], GREEDY)
    assert token_ids(outputs) == reference
    stats = llm.engine.get_stats()
    assert stats.kv_cache_usage == 0.0
    if method == "draft_model" and not vocab:
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    elif method == "draft_model":
        assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens


def chi_square_two_sample(a: list[int], b: list[int], min_count: int = 10) -> tuple[float, int]:
    """Pearson's two-sample statistic over tokens, rare tokens pooled into one bin."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    common = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= min_count]
    bins = [(ca[t], cb[t]) for t in common]
    bins.append((len(a) - sum(x for x, _ in bins), len(b) - sum(y for _, y in bins)))
    bins = [(x, y) for x, y in bins if x + y > 0]
    return sum((x - y) ** 2 / (x + y) for x, y in bins), len(bins) - 1


CHI2_999 = [0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26, 32.91, 34.53, 36.12,
            37.70, 39.25, 40.79, 42.31, 43.82, 45.31]
"""Chi-square critical values at p = 0.001 by degrees of freedom."""


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=8, max_tokens=4, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, min_p=0.02, repetition_penalty=1.05, max_tokens=4, ignore_eos=True),
])
def test_sampling_distribution_is_unchanged(make_llm, params):
    prompt = "one two three four, one two three four, one two three four, one two"
    n = 300
    batches = {}
    for name, spec in (("off", None), ("on", NGRAM)):
        llm = make_llm(speculative_config=spec, enable_prefix_caching=True)
        outs = llm.generate([prompt] * n, [params.clone(seed=1000 * (name == "on") + i) for i in range(n)])
        batches[name] = token_ids(outs)
        if spec is not None:
            assert llm.engine.get_stats().spec_num_accepted_tokens > 0
    for position in (1, 2, 3):  # position 0 comes from the prefill, speculation or not
        stat, df = chi_square_two_sample([t[position] for t in batches["on"]], [t[position] for t in batches["off"]])
        assert stat < CHI2_999[min(df, 20)], (position, stat, df)


def test_logprobs_n_and_stop_strings(make_llm):
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=2, n=2, stop=["four, one two three"])
    plain = make_llm().generate(REPEATING[:1], params)[0]
    spec = make_llm(speculative_config=NGRAM).generate(REPEATING[:1], params)[0]
    for a, b in zip(plain.outputs, spec.outputs, strict=False):
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (b.token_ids, b.text, b.finish_reason,
                                                                       b.stop_reason)
        assert [sorted(p) for p in a.logprobs] == [sorted(p) for p in b.logprobs]
        for pa, pb in zip(a.logprobs, b.logprobs, strict=False):
            for token in pa:
                assert pa[token].logprob == pytest.approx(pb[token].logprob, abs=1e-4)
    assert spec.num_accepted_tokens > 0


def test_server_metrics_and_streaming(smollm2_fp32):
    import openai

    from threefold.engine.llm_engine import EngineArgs, LLMEngine

    from server_harness import ServerThread
    from server_helpers import metrics

    engine = LLMEngine(smollm2_fp32, EngineArgs(dtype="float32", kv_cache_memory=64 << 20, max_model_len=512,
                                                speculative_config=NGRAM))
    with ServerThread(engine) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        chunks = client.completions.create(model=engine.model_name, prompt=REPEATING[0], max_tokens=20,
                                           temperature=0.0, stream=True)
        streamed = "".join(c.choices[0].text for c in chunks)
        whole = client.completions.create(model=engine.model_name, prompt=REPEATING[0], max_tokens=20,
                                          temperature=0.0).choices[0].text
        m = metrics(server.url)
    assert streamed == whole
    assert m["vllm:spec_decode_num_drafts_total"] > 0
    assert 0 < m["vllm:spec_decode_num_accepted_tokens_total"] <= m["vllm:spec_decode_num_draft_tokens_total"]
    assert m["vllm:spec_decode_num_accepted_tokens_per_pos_total{position=0}"] > 0


def test_llm_takes_speculative_config_and_refuses_a_bad_one():
    from threefold.engine.llm import LLM
    from threefold.errors import ThreefoldError

    with pytest.raises(ThreefoldError, match="num_speculative_tokens must be") as info:
        LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 0})  # refused before the model loads
    assert info.value.param == "speculative_config.num_speculative_tokens"
    llm = LLM(dtype="float32", kv_cache_memory=64 << 20, max_model_len=256,
              speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}')
    out = llm.generate([REPEATING[0]], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert out.num_accepted_tokens > 0



class HiddenRecordingNgram(Proposer):
    """An n-gram proposer that asks for the target's hidden states, as Medusa and EAGLE do, and keeps
    every DraftRequest it sees (accepted n-gram drafts put verify rows among the features it is fed).
    With `wrong`, every draft is a token the target never picks, so adaptive k falls to 0 with probes."""

    needs_hidden_states = True
    calls: ClassVar[list] = []
    wrong: ClassVar[bool] = False

    @classmethod
    def from_config(cls, config, target=None) -> HiddenRecordingNgram:
        return cls()

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        for r in requests:
            self.calls.append((r.request_id, list(r.token_ids), r.hidden_start,
                               None if r.hidden_states is None else r.hidden_states.clone()))
        if self.wrong:
            return [Draft([49151] * r.num_drafts) for r in requests]
        return [Draft(ngram_lookup(np.asarray(r.token_ids), 1, 3, r.num_drafts).tolist()) for r in requests]


@pytest.mark.parametrize("wrong", [False, True])
def test_head_proposers_get_the_target_features_of_each_real_position(make_llm, smollm2_fp32, monkeypatch, wrong):
    """What Medusa/EAGLE heads are trained on (spec/train.py): f_t = the target's final (normed) hidden
    state at position t, the LM head's input, whose argmax predicted x_{t+1}. The engine must hand the
    proposer exactly those rows, every position once and in order (EAGLE attends over all of them, as in
    training; also across steps where adaptive k was 0), up to the token just sampled (its last row
    predicted token_ids[-1]), accepted drafts' rows in and rejected ones out, across chunked prefill.
    Checked against one plain forward over the whole sequence."""
    import torch

    from threefold.spec import proposer
    from threefold.spec.train import causal_attention

    monkeypatch.setitem(proposer.PROPOSERS, "ngram", "test_spec_engine:HiddenRecordingNgram")
    monkeypatch.setattr(HiddenRecordingNgram, "calls", [])
    monkeypatch.setattr(HiddenRecordingNgram, "wrong", wrong)
    if wrong:  # the controller's prices pinned, not measured: k must reach 0 (and probes) whatever the load
        from threefold.spec import adaptive, runner

        monkeypatch.setattr(runner, "profile_step_cost", lambda forward: adaptive.StepCostModel({1: 0.01, 64: 0.05}))
        monkeypatch.setattr(runner, "profile_draft_cost", lambda proposer: 0.002)
        monkeypatch.setattr(adaptive.AdaptiveController, "observe_step", lambda self, *args, **kwargs: None)
        monkeypatch.setattr(adaptive.AdaptiveController, "observe_draft_cost", lambda self, *args, **kwargs: None)
    config = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": wrong}
    llm = make_llm(speculative_config=config, max_num_batched_tokens=16, enable_prefix_caching=False)
    llm.generate(REPEATING, GREEDY.clone(max_tokens=48 if wrong else 24))
    stats = llm.engine.get_stats()
    assert (stats.spec_num_accepted_tokens == 0) if wrong else (stats.spec_num_accepted_tokens > 0)
    fed = [c for c in HiddenRecordingNgram.calls if c[3] is not None]
    rows: dict[str, list] = {}
    last_tokens: dict[str, list[int]] = {}
    for rid, tokens, start, hidden in fed:
        assert start == sum(len(r) for r in rows.get(rid, [])), "a gap or an overlap in the rows the proposer got"
        assert start + len(hidden) == len(tokens) - 1
        rows.setdefault(rid, []).append(hidden)
        last_tokens[rid] = tokens
    # Rows from steps where accepted drafts were kept (n-gram) or where nothing was drafted (probes).
    assert any(len(c[3]) > 1 and c[2] > 20 for c in fed)
    for rid, tokens in last_tokens.items():
        with torch.inference_mode():
            features = smollm2_fp32.model(torch.tensor(tokens[:-1]), torch.arange(len(tokens) - 1), causal_attention)
        torch.testing.assert_close(torch.cat(rows[rid]), features, atol=2e-3, rtol=2e-3)
