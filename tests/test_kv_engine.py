"""The engine with every compressed KV codec: batch invariance (with chunked prefill),
preemption under a tiny pool, prefix-cache hits, n > 1, every block free after a run, and
no prefix-cache reuse across codecs."""

from __future__ import annotations

import pytest

from threefold.sample.params import SamplingParams

from prompts import PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
CODECS = ["int8", "fp8", "fp8_e5m2", "int4"]
NEAR_TIE = 0.5
"""Nats between the two tokens a run may swap. Measured (SmolLM2, these prompts, AVX2): every
divergence was a swap of the top two at a reference gap of at most 0.19 (fp8_e5m2)."""


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_matches(got, reference, min_prefix: int = 13) -> None:
    """Batched = solo (both lists of RequestOutputs, generated with GREEDY's logprobs), allowing
    what quantization amplifies. Matmuls round differently at other batch and chunk shapes
    (~1e-7: on AVX2 up to 16 rows take the few-row kernel and more take MKL, each with its own
    summation order, and other CPUs split differently again); rarely a K/V element sits that
    close to a rounding boundary and lands one code away. One code is a whole step (fp8_e5m2 has
    two mantissa bits), so it can flip a near-tie token, and after it the two runs continue
    different texts. So a run may differ from the reference only by such a flip: at the first
    token where they part, each picked the other's second choice, within `NEAR_TIE` nats in the
    reference. And the first 4 tokens of at least `min_prefix` prompts agree. A cache read from
    the wrong blocks or with the wrong scales moves whole distributions, not near-ties, and
    garbles nearly every prompt: it fails both."""
    assert len(got) == len(reference)
    assert sum(g[:4] == r[:4] for g, r in zip(tokens(got), tokens(reference), strict=True)) >= min_prefix, \
        (tokens(got), tokens(reference))
    for g, r in ((g.outputs[0], r.outputs[0]) for g, r in zip(got, reference, strict=True)):
        if g.token_ids == r.token_ids:
            continue
        i = next(i for i, (a, b) in enumerate(zip(g.token_ids, r.token_ids, strict=True)) if a != b)
        a, b = g.token_ids[i], r.token_ids[i]
        ours, theirs = g.logprobs[i], r.logprobs[i]
        swapped = a in theirs and theirs[a].rank == 2 and b in ours and ours[b].rank == 2
        assert swapped and theirs[b].logprob - theirs[a].logprob <= NEAR_TIE, (i, g.token_ids, r.token_ids, ours)


@pytest.fixture(scope="module", params=CODECS)
def codec_reference(request, make_llm):
    """(codec, each prompt alone under it): what every batched configuration must reproduce."""
    llm = make_llm(enable_prefix_caching=False, kv_cache_dtype=request.param)
    return request.param, [llm.generate([p], GREEDY)[0] for p in PROMPTS]


def test_batch_invariance(make_llm, codec_reference):
    codec, reference = codec_reference
    llm = make_llm(max_num_batched_tokens=512, kv_cache_dtype=codec)
    assert_matches(llm.generate(PROMPTS, GREEDY), reference)
    assert llm.engine.get_stats().kv_cache_usage == 0.0


def test_chunked_prefill(make_llm, codec_reference):
    """Prompts cut into chunks of a few tokens; every chunk after the first reads its context
    back from the compressed cache (the native kernel, in place)."""
    codec, reference = codec_reference
    llm = make_llm(enable_prefix_caching=False, max_num_batched_tokens=7, kv_cache_dtype=codec)
    assert_matches(llm.generate(PROMPTS, GREEDY), reference, min_prefix=12)
    assert llm.engine.get_stats().kv_cache_usage == 0.0


def test_preemption_under_a_tiny_pool(make_llm, codec_reference):
    codec, reference = codec_reference
    probe = make_llm(kv_cache_dtype=codec)
    block_bytes = probe.engine.core.runner.bytes_per_block()
    llm = make_llm(kv_cache_memory=12 * block_bytes, max_model_len=64, kv_cache_dtype=codec)
    assert llm.engine.core.kv.capacity_tokens == 12 * 16
    assert_matches(llm.generate(PROMPTS, GREEDY), reference)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_cache_usage == 0.0
    assert llm.engine.core.kv.req_to_blocks == {}


def test_prefix_cache_hits_and_n_completions(make_llm, codec_reference):
    codec, _ = codec_reference
    llm = make_llm(kv_cache_dtype=codec)
    prefix = "You are a helpful assistant. Answer briefly and precisely, in one sentence. " * 2
    first = llm.generate([prefix + "What is a cat?"], GREEDY)[0]
    second = llm.generate([prefix + "What is a dog?"], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 16 * (len(first.prompt_token_ids) // 16 - 1) > 0
    cold = make_llm(enable_prefix_caching=False, kv_cache_dtype=codec).generate([prefix + "What is a dog?"], GREEDY)
    assert second.outputs[0].token_ids[:4] == cold[0].outputs[0].token_ids[:4]
    many = llm.generate([prefix], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=3))[0]
    assert len(many.outputs) == 3 and all(len(c.token_ids) == 8 for c in many.outputs)
    assert llm.engine.get_stats().kv_cache_usage == 0.0


def test_no_prefix_cache_reuse_across_codecs(make_llm):
    prompt = "The same prompt, long enough to fill two blocks of sixteen tokens each, under two codecs."
    hashes = {}
    for codec in ["auto", "int8", "int4", "int4:group=16", KIVI, "kivi4:group=16,residual=16"]:
        llm = make_llm(kv_cache_dtype=codec)
        llm.generate([prompt], GREEDY)
        hashes[codec] = set(llm.engine.core.kv.pool.cached)
        assert hashes[codec]
    assert all(a.isdisjoint(b) for x, a in hashes.items() for y, b in hashes.items() if x != y)


# ---- KIVI: a full-precision window per request beside the quantized blocks -------------------
KIVI = "kivi2:group=16,residual=32"
"""2-bit, and a window small enough that these prompts' first blocks are quantized mid-run."""
KIVI_PROMPTS = [" ".join([p] * 4) for p in PROMPTS[:5]]  # 20-50 tokens, + 12 generated


@pytest.fixture(scope="module")
def kivi_reference(make_llm):
    llm = make_llm(enable_prefix_caching=False, kv_cache_dtype=KIVI)
    return [llm.generate([p], GREEDY)[0] for p in KIVI_PROMPTS]


def test_kivi_batch_and_chunk_invariance(make_llm, kivi_reference):
    for args in [{"max_num_batched_tokens": 512}, {"max_num_batched_tokens": 24, "enable_prefix_caching": False}]:
        llm = make_llm(kv_cache_dtype=KIVI, **args)
        assert_matches(llm.generate(KIVI_PROMPTS, GREEDY), kivi_reference, min_prefix=4)
        assert llm.engine.get_stats().kv_cache_usage == 0.0
        llm.engine.core.step()  # the runner hears of the last finished requests on the next step
        assert llm.engine.core.runner.windows.windows == {}  # every window given back


def test_kivi_outputs_stay_close_to_auto(make_llm, kivi_reference):
    auto = tokens(make_llm(enable_prefix_caching=False).generate(KIVI_PROMPTS, GREEDY))
    kivi = tokens(kivi_reference)
    assert sum(a[:4] == b[:4] for a, b in zip(auto, kivi, strict=True)) >= 3, (auto, kivi)


def test_kivi_preemption_under_a_tiny_pool(make_llm, kivi_reference, monkeypatch):
    monkeypatch.setattr("threefold.kv.window.ARENA_SHARE", (0.85, 0.85))  # room for two windows beside 6 blocks
    probe = make_llm(kv_cache_dtype=KIVI).engine.core
    window, block = probe.runner.window_bytes_per_seq(), probe.runner.bytes_per_block()
    llm = make_llm(kv_cache_memory=2 * window + 6 * block, max_model_len=96, kv_cache_dtype=KIVI)
    core = llm.engine.core
    assert core.kv.capacity_tokens == 6 * 16 and core.cache_info["max_num_seqs"] == 2
    assert_matches(llm.generate(KIVI_PROMPTS, GREEDY), kivi_reference, min_prefix=4)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.kv_cache_usage == 0.0
    core.step()
    assert core.kv.req_to_blocks == {} and core.runner.windows.windows == {}


def test_kivi_prefix_cache_hits(make_llm):
    llm = make_llm(kv_cache_dtype=KIVI)
    prefix = "You are a helpful assistant. Answer briefly and precisely, in one sentence. " * 2
    first = llm.generate([prefix + "What is a cat?"], GREEDY)[0]
    second = llm.generate([prefix + "What is a dog?"], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 16 * (len(first.prompt_token_ids) // 16 - 1) > 0
    cold = make_llm(enable_prefix_caching=False, kv_cache_dtype=KIVI).generate([prefix + "What is a dog?"], GREEDY)
    assert second.outputs[0].token_ids[:4] == cold[0].outputs[0].token_ids[:4]
    assert llm.engine.get_stats().kv_cache_usage == 0.0
