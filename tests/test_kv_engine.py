"""The engine with every compressed KV codec: batch invariance (with chunked prefill),
preemption under a tiny pool, prefix-cache hits, n > 1, every block free after a run, and
no prefix-cache reuse across codecs."""

from __future__ import annotations

import pytest

from prompts import PROMPTS
from threefold.sample.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
CODECS = ["int8", "fp8", "fp8_e5m2", "int4"]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_matches(got: list[list[int]], reference: list[list[int]], min_prefix: int = 13) -> None:
    """Batched = solo, allowing what quantization amplifies. Matmuls round differently at other
    batch and chunk shapes (~1e-7: on AVX2 up to 16 rows take the few-row kernel and more take
    MKL, each with its own summation order); rarely a K/V element sits that close to a rounding
    boundary and lands one code away. One code is a whole step (int8: amax / 127 of a row whose
    amax is often an outlier channel), so it can flip a near-tie token. Measured on SmolLM2
    (a 60-token prompt, chunks of 7 vs one chunk): log-prob differences 1e-4 (auto), 0.6 (int8),
    1.7 (fp8), 6.6 (int4). So: the first 4 tokens of at least `min_prefix` of the 16 prompts,
    and at least 12 prompts whole. A cache read from the wrong blocks or with the wrong scales
    garbles nearly every prompt, and fails both."""
    assert len(got) == len(reference)
    assert sum(g[:4] == r[:4] for g, r in zip(got, reference, strict=True)) >= min_prefix, (got, reference)
    assert sum(g == r for g, r in zip(got, reference, strict=True)) >= len(reference) - 4, (got, reference)


@pytest.fixture(scope="module", params=CODECS)
def codec_reference(request, make_llm):
    """(codec, each prompt alone under it): what every batched configuration must reproduce."""
    llm = make_llm(enable_prefix_caching=False, kv_cache_dtype=request.param)
    return request.param, [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


def test_batch_invariance(make_llm, codec_reference):
    codec, reference = codec_reference
    llm = make_llm(max_num_batched_tokens=512, kv_cache_dtype=codec)
    assert_matches(tokens(llm.generate(PROMPTS, GREEDY)), reference)
    assert llm.engine.get_stats().kv_cache_usage == 0.0


def test_chunked_prefill(make_llm, codec_reference):
    """Prompts cut into chunks of a few tokens; every chunk after the first reads its context
    back from the compressed cache (the native kernel, in place)."""
    codec, reference = codec_reference
    llm = make_llm(enable_prefix_caching=False, max_num_batched_tokens=7, kv_cache_dtype=codec)
    assert_matches(tokens(llm.generate(PROMPTS, GREEDY)), reference, min_prefix=12)
    assert llm.engine.get_stats().kv_cache_usage == 0.0


def test_preemption_under_a_tiny_pool(make_llm, codec_reference):
    codec, reference = codec_reference
    probe = make_llm(kv_cache_dtype=codec)
    block_bytes = probe.engine.core.runner.bytes_per_block()
    llm = make_llm(kv_cache_memory=12 * block_bytes, max_model_len=64, kv_cache_dtype=codec)
    assert llm.engine.core.kv.capacity_tokens == 12 * 16
    assert_matches(tokens(llm.generate(PROMPTS, GREEDY)), reference)
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
    for codec in ["auto", "int8", "int4", "int4:group=16"]:
        llm = make_llm(kv_cache_dtype=codec)
        llm.generate([prompt], GREEDY)
        hashes[codec] = set(llm.engine.core.kv.pool.cached)
        assert hashes[codec]
    assert all(a.isdisjoint(b) for x, a in hashes.items() for y, b in hashes.items() if x != y)
