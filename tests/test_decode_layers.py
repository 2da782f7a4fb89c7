"""kernels.decode_layers (and decode_layers_kivi over a KIVI cache): every layer of a decode-only step in
one native call must compute exactly what the model's Python loop computes with the same kernels (the
same hidden states bit for bit, the same cache writes), on every kernel build, every tiny architecture it
takes, and in the engine."""

from __future__ import annotations

import sys

import pytest
import torch

from threefold.kernels import available_targets, build_kernels
from threefold.kv.paged import PagedKVCache
from threefold.kv.registry import make_codec
from threefold.kv.window import ArenaShape, Window, WindowArena, window_dtype
from threefold.model.loader import load_model
from threefold.sample.params import SamplingParams
from threefold.worker.attention import AttentionMetadata, DecodeGroup, PagedAttention
from threefold.worker.kivi_attention import KiviAttention, KiviRequest

from model_fixtures import make_tiny_checkpoint
from prompts import PROMPTS

BLOCK = 4
NUM_BLOCKS = 64


@pytest.fixture(scope="module", params=available_targets() or ["native"])
def kernels(request):
    """Each build this CPU can run."""
    if sys.platform != "linux":
        pytest.skip("native kernels are built on Linux")
    return build_kernels(request.param)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return {variant: make_tiny_checkpoint(tmp_path_factory.mktemp(variant), variant)
            for variant in ("llama", "qwen2", "mistral")}


def _forward(model, input_ids, positions, attention, native: bool):
    """The model's hidden states through the native loop (native) or its Python layers, checking which ran."""
    model.native_decode = native
    calls: list[int] = []
    hook = model.layers[0].self_attn.register_forward_pre_hook(lambda *args, seen=calls: seen.append(1))
    try:
        with torch.inference_mode():
            hidden = model(input_ids, positions, attention)
    finally:
        hook.remove()
        model.native_decode = True
    assert bool(calls) != native, "the native call must replace the Python layers (and only it)"
    return hidden


def _step(model, kernels, dtype, context_lens: list[int], groups: list[int], window: int, tree: bool):
    """One decode step of len(context_lens) rows over a random cache: (hidden, cache) from
    decode_layers, and the same from the Python loop (each on its own copy of the cache)."""
    config = model.config
    gen = torch.Generator().manual_seed(len(context_lens))
    codec = make_codec("auto", config.num_kv_heads, config.head_dim, dtype)
    caches = [PagedKVCache(codec, config.num_layers, NUM_BLOCKS, BLOCK, torch.device("cpu")) for _ in range(2)]
    for a, b in zip(*(cache.layers for cache in caches), strict=True):
        a.copy_(torch.randn(a.shape, generator=gen).to(dtype))
        b.copy_(a)
    width = max(context_lens) // BLOCK + 1
    tables = torch.stack([torch.randperm(NUM_BLOCKS - 1, generator=gen)[:width] + 1 for _ in context_lens])
    seq_lens = torch.tensor(context_lens)
    positions = seq_lens - 1
    slots = tables.gather(1, (positions // BLOCK).unsqueeze(1)).squeeze(1) * BLOCK + positions % BLOCK
    decode_groups, start = [], 0
    for count in groups:
        rows = slice(start, start + count)
        starts = bits = None
        if tree:  # each row sees its own tree key and every other one (an arbitrary ancestor mask)
            starts = seq_lens[rows] - 1
            bits = torch.full((count, 1), 1, dtype=torch.long)
        decode_groups.append(DecodeGroup(start, count, tables[rows], seq_lens[rows], None, starts, bits))
        start += count
    meta = AttentionMetadata(slots, decode_groups, [], window or None)
    input_ids = torch.randint(100, 1000, (len(context_lens),), generator=gen)
    out = []
    for native, cache in zip((True, False), caches, strict=True):
        attention = PagedAttention(cache, meta, config.head_dim ** -0.5, dtype, kernels)
        assert attention.decode_step is not None
        hidden = _forward(model, input_ids, positions, attention, native)
        out.append((hidden, cache.layers))
    return out


@pytest.mark.parametrize("variant", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context_lens, groups, tree", [
    ([9], [1], False),  # batch 1
    ([5, 17, 33, 12, 8], [2, 3], False),  # two decode groups
    ([21, 21, 21], [3], True),  # a speculative verify's rows: one table, ancestor bits
    (list(range(5, 45, 2)), [20], False),  # 20 rows: past the few-row kernel, the GEMM path
])
def test_decode_layers_equals_the_python_loop(kernels, tiny_dirs, variant, dtype, context_lens, groups, tree):
    loaded = load_model(str(tiny_dirs[variant]), dtype="float32" if dtype == torch.float32 else "bfloat16")
    model = loaded.model
    model.use_kernels(kernels)
    window = 6 if variant == "mistral" else 0  # a window shorter than most contexts
    (native, native_cache), (python, python_cache) = _step(model, kernels, dtype, context_lens, groups, window, tree)
    assert torch.equal(native, python)
    for a, b in zip(native_cache, python_cache, strict=True):
        assert torch.equal(a, b)


def test_models_it_cannot_run_keep_the_python_loop(kernels, tmp_path):
    """q/k-norm layers (qwen3) are not in the native loop: no weights, so the Python layers run."""
    model = load_model(str(make_tiny_checkpoint(tmp_path, "qwen3")), dtype="float32").model
    model.use_kernels(kernels)
    assert model._layer_weights is None


def test_decode_layers_refuses_a_step_with_rows_that_do_not_decode(kernels, tiny_dirs):
    model = load_model(str(tiny_dirs["llama"]), dtype="float32").model
    model.use_kernels(kernels)
    config = model.config
    cache = PagedKVCache(make_codec("auto", config.num_kv_heads, config.head_dim, torch.float32),
                         config.num_layers, NUM_BLOCKS, BLOCK, torch.device("cpu"))
    hidden = torch.zeros(3, config.hidden_size)
    table = torch.ones(2, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="every row must decode"):
        kernels.decode_layers(hidden, torch.zeros(3, dtype=torch.long), model.rope_cos, model.rope_sin,
                              *model._layer_weights, model.norm.weight, 1e-5, *cache.dense_kv,
                              torch.zeros(3, dtype=torch.long), [0], [table], [torch.ones(2, dtype=torch.long)],
                              [torch.empty(0, dtype=torch.long)], [torch.empty(0, dtype=torch.long)],
                              config.num_heads, config.num_kv_heads, 0.125, 0)


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}])
def test_engine_outputs_are_identical_with_and_without_the_native_loop(make_llm, smollm2_fp32, spec):
    """Real SmolLM2 weights, batched greedy decoding with log-probs (and n-gram verify steps):
    the native loop changes nothing, not even the last bit of a log-prob."""
    llm = make_llm(speculative_config=spec)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    model = smollm2_fp32.model
    results = []
    try:
        for native in (True, False):
            model.native_decode = native
            outputs = llm.generate(PROMPTS[:4], params)
            results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs])
    finally:
        model.native_decode = True
    assert results[0] == results[1]


def _kivi_step(model, kernels, dtype, spec: str, context_lens: list[int], starts: list[int]):
    """One decode step over a KIVI cache with random blocks and windows: (hidden, cache tensors, rings)
    from decode_layers_kivi and from the Python loop, each on its own copy of the cache and arena."""
    config = model.config
    gen = torch.Generator().manual_seed(sum(context_lens))
    codec = make_codec(spec, config.num_kv_heads, config.head_dim, dtype)
    bs = codec.group
    caches = [PagedKVCache(codec, config.num_layers, NUM_BLOCKS, bs, torch.device("cpu")) for _ in range(2)]
    shape = ArenaShape.of([codec] * config.num_layers, bs)
    arenas = [WindowArena(shape, len(context_lens) + 1, config.num_kv_heads, config.head_dim, window_dtype(dtype),
                          torch.device("cpu")) for _ in range(2)]
    for storage in caches[0].layers:
        for tensor in vars(storage).values():  # arbitrary codes, scales and zeros: the kernels read any
            if tensor.dtype == torch.uint8:
                tensor.copy_(torch.randint(0, 256, tensor.shape, generator=gen, dtype=torch.uint8))
            else:
                tensor.copy_((torch.rand(tensor.shape, generator=gen) * 0.1).to(tensor.dtype))
    arenas[0].ring.copy_(torch.randn(arenas[0].ring.shape, generator=gen).to(arenas[0].ring.dtype))
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        for name, tensor in vars(a).items():
            getattr(b, name).copy_(tensor)
    arenas[1].ring.copy_(arenas[0].ring)
    width = max(context_lens) // bs + 1
    tables = [torch.randperm(NUM_BLOCKS - 1, generator=gen)[:width] + 1 for _ in context_lens]
    input_ids = torch.randint(100, 1000, (len(context_lens),), generator=gen)
    positions = torch.tensor(context_lens)
    out = []
    for native, cache, arena in zip((True, False), caches, arenas, strict=True):
        requests = [KiviRequest(i, 1, ctx, tables[i][: ctx // bs + 1], Window(i + 1, start, ctx))
                    for i, (ctx, start) in enumerate(zip(context_lens, starts, strict=True))]
        attention = KiviAttention(cache, arena, requests, config.head_dim ** -0.5, kernels=kernels)
        assert attention.decode_step is not None
        hidden = _forward(model, input_ids, positions, attention, native)
        out.append((hidden, [t for storage in cache.layers for t in vars(storage).values()], arena.ring))
    return out


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", ["kivi2:group=16,residual=32", "kivi4:group=16,residual=0", "kivi2:group=16"])
@pytest.mark.parametrize("context_lens, starts", [
    ([40], [0]),  # batch 1, mid-block
    ([15, 47, 31, 100, 6, 63], [0, 0, 16, 0, 0, 32]),  # four rows complete a block (two after a prefix hit)
    (list(range(3, 143, 7)), [0] * 20),  # 20 rows: the GEMM path
])
def test_decode_layers_kivi_equals_the_python_loop(kernels, tiny_dirs, variant, dtype, spec, context_lens, starts):
    """The windows' writes (fp16 beside fp32), the blocks completed this step (encoded from the windows)
    and the attention: bit for bit, every layer, every build."""
    loaded = load_model(str(tiny_dirs[variant]), dtype="float32" if dtype == torch.float32 else "bfloat16")
    model = loaded.model
    model.use_kernels(kernels)
    (native, native_cache, native_ring), (python, python_cache, python_ring) = _kivi_step(
        model, kernels, dtype, spec, context_lens, starts)
    assert torch.equal(native, python)
    assert torch.equal(native_ring, python_ring)
    for a, b in zip(native_cache, python_cache, strict=True):
        assert torch.equal(a, b)


def test_kivi_steps_the_native_loop_cannot_take_keep_the_python_loop(kernels, tiny_dirs):
    """A prefill row, or a codec mix (rows), or tiered layers: no decode_step, the per-layer path runs."""
    model = load_model(str(tiny_dirs["llama"]), dtype="float32").model
    config = model.config

    def attention(spec, query_len, rows=None):
        codec = make_codec(spec, config.num_kv_heads, config.head_dim, torch.float32)
        cache = PagedKVCache(codec, config.num_layers, NUM_BLOCKS, 16, torch.device("cpu"))
        arena = WindowArena(ArenaShape.of([codec] * config.num_layers, 16), 2, config.num_kv_heads,
                            config.head_dim, torch.float16, torch.device("cpu"))
        request = KiviRequest(0, query_len, 8, torch.tensor([1]), arena.acquire("a", 0))
        return KiviAttention(cache, arena, [request], 0.125, rows=rows, kernels=kernels)

    assert attention("kivi2:group=16", 1).decode_step is not None
    assert attention("kivi2:group=16", 4).decode_step is None
    assert attention("kivi2:group=16", 1, rows={0: 0, 1: 1}).decode_step is None
    assert attention("tiered:group=16,middle=16", 1).decode_step is None


@pytest.mark.parametrize("spec", ["kivi2:residual=32", "kivi4:residual=32"])
def test_engine_kivi_outputs_are_identical_with_and_without_the_native_loop(make_llm, smollm2_fp32, spec,
                                                                          monkeypatch):
    """Real SmolLM2 weights over kivi2 / kivi4 (fp16 windows): batched greedy decoding with log-probs,
    blocks leaving the windows mid-run; the native loop runs and changes nothing, not a last bit."""
    llm = make_llm(kv_cache_dtype=spec, block_size=32, enable_prefix_caching=False)
    kernels = llm.engine.core.runner.kernels
    if kernels is None:
        pytest.skip("no native kernels (THREEFOLD_ATTENTION=torch)")
    calls: list[int] = []
    fused = kernels.decode_layers_kivi
    monkeypatch.setattr(kernels, "decode_layers_kivi", lambda *args: calls.append(1) or fused(*args))
    params = SamplingParams(max_tokens=72, temperature=0, ignore_eos=True, logprobs=2)
    model = smollm2_fp32.model
    results = []
    try:
        for native in (True, False):
            model.native_decode = native
            outputs = llm.generate(PROMPTS[:4], params)
            results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs])
    finally:
        model.native_decode = True
    assert len(calls) >= 60, "the decode steps must take the native loop"
    assert results[0] == results[1]
