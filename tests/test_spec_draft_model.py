"""The draft-model proposer: drafts are the draft's own greedy continuation, its KV follows
the request incrementally, and a draft with another vocabulary is refused at startup."""

from __future__ import annotations

import json

import pytest
import torch

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


def test_int8_draft_streams_int8_weights_and_drafts_its_own_greedy_continuation(smollm2_fp32):
    """quantization="int8": every few-row linear of the draft streams int8 codes with per-row scales
    (where the native kernel runs), and the drafts are that int8 model's own greedy tokens."""
    from threefold.kernels import has_int8_linear
    from threefold.model.llama import Linear

    proposer = make_proposer(SpeculativeConfig("draft_model", 4, model="smollm2-135m", quantization="int8"),
                             smollm2_fp32)
    linears = [m for m in proposer.model.modules() if isinstance(m, Linear)]
    if has_int8_linear(proposer.model.kernels):
        assert all(m.stream_weight.dtype == torch.int8 and m.stream_scale is not None and m.kernels is not None
                   for m in linears)
    else:  # no AVX2 build: the draft keeps the target's dtype, and says so
        assert all(m.stream_scale is None for m in linears)
    prompt = smollm2_fp32.tokenizer.encode("The three primary colours are")
    expected, _ = greedy(proposer.model, prompt, 4)
    assert proposer.propose([DraftRequest("r", prompt, 4)])[0].token_ids == expected


def test_draft_native_steps_equal_the_python_loop(smollm2_fp32, monkeypatch):
    """A few-row draft forward runs every layer in one native call (kernels.decode_layers over the
    DenseKV buffers), with the very hidden states of the layer-by-layer loop; a prompt-sized one
    takes the loop."""
    from threefold.spec.draft_model import DenseKV

    proposer = make_proposer(SpeculativeConfig("draft_model", 4, model="smollm2-135m"), smollm2_fp32)
    model = proposer.model
    if not model.runs_decode_steps:
        pytest.skip("no native decode loop on this machine")
    calls = []
    real = model.kernels.decode_layers
    monkeypatch.setattr(model.kernels, "decode_layers", lambda *args: calls.append(1) or real(*args))
    prompt = smollm2_fp32.tokenizer.encode("Here is a list of the planets of the solar system, in order from the "
                                           "Sun:\n1. Mercury")
    native, loop = DenseKV(model.kernels, len(model.layers)), DenseKV(model.kernels, len(model.layers))
    for cache in (native, loop):
        proposer._forward(cache, prompt, 0)
    assert not calls  # the prompt: more rows than a verify step adds
    tokens = [11, 42, 7]
    got = proposer._forward(native, tokens, len(prompt))
    assert len(calls) == 1 and native.length == len(prompt) + 3 and native.decode_step is None
    model.native_decode = False
    try:
        expected = proposer._forward(loop, tokens, len(prompt))
    finally:
        model.native_decode = True
    assert len(calls) == 1 and loop.length == len(prompt) + 3
    assert torch.equal(got, expected)
    for layer in range(len(model.layers)):
        assert torch.equal(native.k[layer][0, : native.length], loop.k[layer][0, : loop.length])
    native.truncate(len(prompt) + 1)  # a rejected draft's K/V: cut, then overwritten
    assert native.length == len(prompt) + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", [False, True])
def test_dense_kv_attention_matches_sdpa(dtype, native):
    """DenseKV over a few calls (a prompt, one row, a 5-row catch-up), through the native kernel or
    grouped_attention, equals SDPA over the whole context with K/V repeated per query head."""
    import torch.nn.functional as F

    from threefold.kernels import cpu_kernels
    from threefold.spec.draft_model import DenseKV

    kernels = cpu_kernels() if native else None
    if native and kernels is None:
        pytest.skip("no native kernels on this machine")
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim = 14, 2, 64  # Qwen2.5-0.5B's GQA shape
    cache = DenseKV(kernels)
    keys, values = [], []
    for rows in (9, 1, 5):
        q, k, v = (torch.randn(rows, h, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
        keys.append(k)
        values.append(v)
        out = cache(0, q, k, v)
        kk, vv = torch.cat(keys), torch.cat(values)
        offset = kk.shape[0] - rows
        mask = torch.arange(kk.shape[0])[None, :] <= torch.arange(rows)[:, None] + offset
        expected = F.scaled_dot_product_attention(
            q.double().transpose(0, 1), kk.double().repeat_interleave(heads // kv_heads, 1).transpose(0, 1),
            vv.double().repeat_interleave(heads // kv_heads, 1).transpose(0, 1), attn_mask=mask).transpose(0, 1)
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(out.double(), expected, **({"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32
                                                             else {"atol": 2e-2, "rtol": 2e-2}))


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


def test_rank_tokens_orders_by_count_then_id():
    from threefold.spec.draft_vocab import rank_tokens

    order, seen = rank_tokens(torch.tensor([5, 3, 3, 5, 1, 3]), 7)
    assert order.tolist() == [3, 5, 1, 0, 2, 4, 6] and seen == 3


def test_draft_vocabulary_drafts_the_argmax_over_its_ids(smollm2_fp32, tmp_path, monkeypatch):
    """draft_vocab_size N: the draft's LM head computes only the N ShareGPT-train-most-frequent rows, each
    draft is the argmax over them (a greedy chain within the vocabulary), and the ranking is cached."""
    import threefold.spec.draft_vocab as draft_vocab

    monkeypatch.setenv("THREEFOLD_HOME", str(tmp_path))
    monkeypatch.setattr(draft_vocab, "CORPUS_TOKENS", 20_000)
    proposer = make_proposer(SpeculativeConfig("draft_model", 4, model="smollm2-135m", draft_vocab_size=2000),
                             smollm2_fp32)
    ids = proposer.head.ids
    assert proposer.head.size == len(ids) == 2000 and len(set(ids.tolist())) == 2000
    (cached,) = (tmp_path / "spec" / "draft-vocab").glob("*-sharegpt-train-20000.safetensors")
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(cached))["ranked"][:2000], ids)
    model = smollm2_fp32.model
    prompt = smollm2_fp32.tokenizer.encode("The three primary colours are")
    expected, tokens = [], list(prompt)
    with torch.inference_mode():
        for _ in range(4):  # the chain, recomputed from scratch each token
            logits = model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens)), causal)[-1:])
            expected.append(int(ids[logits[0, ids].argmax()]))
            tokens.append(expected[-1])
    assert proposer.propose([DraftRequest("r", prompt, 4)])[0].token_ids == expected


def causal(layer_idx, q, k, v):
    from threefold.spec.draft_model import grouped_attention

    return grouped_attention(q, k, v)
