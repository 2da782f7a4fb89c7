"""Candidate trees verified in the engine on real SmolLM2 (worker/tree_verify.py): greedy output
identical to speculation off (and to HF transformers once), the rejected branches' blocks freed each
step and on abort with exact block-pool accounting, and T > 0 sampling still distributed as the target.

`NgramTreeProposer` makes trees whose accepted path runs through later siblings: every level holds a
decoy first, then the n-gram draft, so the accepted nodes are not the chain slots and their K/V must
move (a wrong move changes the next tokens)."""

from __future__ import annotations

import numpy as np
import pytest
from test_spec_engine import CHI2_999, GREEDY, REPEATING, chi_square_two_sample, token_ids, write_random_heads

from threefold.sample.params import SamplingParams
from threefold.spec.ngram import ngram_lookup
from threefold.spec.proposer import ROOT, Draft, DraftRequest, Proposer

from prompts import PROMPTS

TREE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive": False}


class NgramTreeProposer(Proposer):
    """A tree per request: at each depth a decoy (the draft two ahead, else the next id), then the
    n-gram draft, which carries the next level."""

    @classmethod
    def from_config(cls, config, target=None) -> NgramTreeProposer:
        return cls()

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = []
        for request in requests:
            chain = ngram_lookup(np.asarray(request.token_ids), 1, 3, request.num_drafts).tolist()
            tokens: list[int] = []
            parents: list[int] = []
            parent = ROOT
            for depth, token in enumerate(chain):
                decoy = chain[depth + 2] if depth + 2 < len(chain) else token + 1
                tokens += [decoy if decoy != token else token + 1, token]
                parents += [parent, parent]
                parent = len(tokens) - 1
            drafts.append(Draft(tokens, parents) if tokens else Draft([]))
        return drafts


@pytest.fixture
def tree_proposer(monkeypatch):
    from threefold.spec import proposer

    monkeypatch.setitem(proposer.PROPOSERS, "ngram", "test_spec_tree_engine:NgramTreeProposer")


@pytest.fixture(scope="module")
def reference(make_llm):
    return token_ids(make_llm(enable_prefix_caching=False).generate(REPEATING + PROMPTS[:2], GREEDY))


def check_blocks(llm) -> None:
    """Every running request holds exactly the blocks of its computed tokens; the rest are free."""
    core = llm.engine.core
    kv, block_size = core.kv, core.kv.block_size
    held = 0
    for request in core.scheduler.running:
        blocks = kv.req_to_blocks.get(request.request_id, [])
        assert len(blocks) == -(-request.num_computed_tokens // block_size), request.request_id
        row = core.runner.requests.states[request.request_id].row
        assert core.runner.requests.block_table.block_ids(row)[: len(blocks)] == [b.block_id for b in blocks]
        held += len(blocks)
    assert kv.pool.num_free_blocks + held == kv.pool.num_blocks - 1


@pytest.mark.parametrize("engine_args,attention", [
    ({"enable_prefix_caching": False}, "kernel"),                               # batched: trees in the native kernel
    ({"enable_prefix_caching": False}, "torch"),                                # the torch tree path (the reference)
    ({"enable_prefix_caching": False, "max_num_batched_tokens": 9}, "kernel"),  # chunked prefill, trees cut short
])
def test_tree_greedy_is_identical_and_frees_rejected_blocks(make_llm, reference, tree_proposer, engine_args,
                                                            attention, monkeypatch):
    from threefold.worker import batch

    paths: list[str] = []  # which attention path each step's trees took
    monkeypatch.setattr(batch, "_tree_decode_group", lambda *a, _f=batch._tree_decode_group: paths.append("kernel")
                        or _f(*a))
    monkeypatch.setattr(batch, "tree_group", lambda *a, _f=batch.tree_group: paths.append("torch") or _f(*a))
    llm = make_llm(speculative_config=TREE, **engine_args)
    if attention == "torch":
        llm.engine.core.runner.kernels = None
    elif llm.engine.core.runner.kernels is None:
        pytest.skip("no native kernels here (THREEFOLD_ATTENTION=torch or no compiler)")
    engine = llm.engine
    for i, prompt in enumerate(REPEATING + PROMPTS[:2]):
        engine.add_request(str(i), prompt, GREEDY)
    outputs = {}
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        check_blocks(llm)
        if not engine.has_unfinished_requests():
            break
    assert [outputs[str(i)].outputs[0].token_ids for i in range(len(reference))] == reference
    stats = engine.get_stats()
    assert stats.spec_num_accepted_tokens > 0 and stats.kv_cache_usage == 0.0
    assert sum(stats.spec_num_accepted_tokens_per_pos) == stats.spec_num_accepted_tokens
    assert paths and set(paths) == {attention}


def test_tree_under_preemption_and_prefix_caching(make_llm, reference, tree_proposer):
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4
    llm = make_llm(speculative_config=TREE, kv_cache_memory=8 * block_bytes, max_model_len=96)
    assert token_ids(llm.generate(REPEATING + PROMPTS[:2], GREEDY)) == reference
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0 and stats.kv_cache_usage == 0.0


def test_abort_mid_tree_frees_every_block(make_llm, tree_proposer):
    llm = make_llm(speculative_config=TREE, enable_prefix_caching=False)
    engine, pool = llm.engine, llm.engine.core.kv.pool
    free_before = pool.num_free_blocks
    engine.add_request("a", REPEATING[0], GREEDY.clone(max_tokens=200))
    engine.add_request("b", REPEATING[1], GREEDY.clone(max_tokens=200))
    for _ in range(6):
        engine.step()
        check_blocks(llm)
    assert engine.get_stats().spec_num_drafts > 0
    engine.abort_request(["a"])
    engine.step()
    check_blocks(llm)
    engine.abort_request(["b"])
    engine.step()
    assert pool.num_free_blocks == free_before


def test_tree_matches_transformers(make_llm, tree_proposer):
    """Once against HF transformers on the same weights: greedy ids and the logprobs of each emitted
    token (read from the row of its accepted parent node)."""
    import torch
    from transformers import AutoModelForCausalLM

    from model_fixtures import hf_reference_greedy, smollm2_gguf_path

    path = smollm2_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    llm = make_llm(speculative_config=TREE)
    params = GREEDY.clone(logprobs=0)
    outputs = llm.generate(REPEATING, params)
    for prompt, output in zip(REPEATING, outputs, strict=True):
        ids, logprobs = hf_reference_greedy(hf, llm.get_tokenizer().encode(prompt), GREEDY.max_tokens)
        completion = output.outputs[0]
        assert completion.token_ids == ids
        ours = [position[t].logprob for t, position in zip(ids, completion.logprobs, strict=True)]
        assert ours == pytest.approx(logprobs, abs=2e-3)  # fp32 op order only (test_engine_parity)
    assert llm.engine.get_stats().spec_num_accepted_tokens > 0


@pytest.mark.parametrize("method,options", [
    ("medusa", {"speculative_token_tree": "[(0,), (1,), (0, 0), (1, 0), (0, 1), (0, 0, 0)]"}),
    ("eagle", {"tree_top_k": 3, "tree_total_tokens": 8}),
])
def test_heads_trees_greedy_is_identical(make_llm, smollm2_fp32, reference, method, options, tmp_path):
    write_random_heads(method, smollm2_fp32, tmp_path)
    config = {"method": method, "model": str(tmp_path), "num_speculative_tokens": 3, **options}
    llm = make_llm(speculative_config=config, max_num_batched_tokens=64)
    assert token_ids(llm.generate(REPEATING, GREEDY)) == reference[: len(REPEATING)]
    stats = llm.engine.get_stats()
    assert stats.spec_num_drafts > 0 and stats.kv_cache_usage == 0.0


def test_tree_sampling_distribution_is_unchanged(make_llm, tree_proposer):
    """Seeded samples with trees on and off, per position: a wrong rule (accept-if-argmax, or not
    removing a rejected sibling's mass) moves the histogram well past p = 0.001."""
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.05, max_tokens=4,
                            ignore_eos=True)
    prompt = REPEATING[0]
    n = 300
    batches = {}
    for name, spec in (("off", None), ("on", TREE)):
        llm = make_llm(speculative_config=spec)
        outs = llm.generate([prompt] * n, [params.clone(seed=1000 * (name == "on") + i) for i in range(n)])
        batches[name] = token_ids(outs)
        if spec is not None:
            assert llm.engine.get_stats().spec_num_accepted_tokens > 0
    for position in (1, 2, 3):
        stat, df = chi_square_two_sample([t[position] for t in batches["on"]], [t[position] for t in batches["off"]])
        assert stat < CHI2_999[min(df, 20)], (position, stat, df)
