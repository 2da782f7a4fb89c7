"""kernels/tq_attention.cpp (TurboQuant blocks read in place) against the plain-torch reference paths:
tq_decode_attention against kv/native.py's `_reference_decode` (the codec's dense read + SDPA) on decode
rows and a prefill chunk's rows, with and without a sliding window; tq_window_attention (residual > 0)
against KiviAttention's reference step by step; the checks shown to catch a kernel that drops the QJL
term or the rotation's signs; the engine's greedy tokens with the kernel on and off."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.prompts import PROMPTS
from tests.test_kivi_kernel import Twin
from threefold.env import Env
from threefold.kernels import available_targets, build_kernels, cpu_kernels
from threefold.kv.native import _reference_decode
from threefold.kv.registry import make_codec
from threefold.sample.params import SamplingParams

_NONE = torch.empty(0, dtype=torch.long)


@pytest.fixture(scope="module", params=available_targets() or ["native"])
def kernels(request):
    """Each build this CPU can run (native: AVX-512 where the CPU has it; x86-64-v3, v2: the plain loops)."""
    if sys.platform != "linux":
        pytest.skip("native kernels are built on Linux")
    return build_kernels(request.param)


@pytest.fixture(scope="module")
def native_kernels_or_skip():
    if sys.platform != "linux" or Env.read().attention_backend == "torch":
        pytest.skip("native kernels are built on Linux unless THREEFOLD_ATTENTION=torch")
    module = cpu_kernels()
    assert module is not None, "the native CPU kernels failed to build (see the log warning)"
    return module


def tolerance(dtype: torch.dtype) -> dict:
    return {"atol": 3e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}


def filled_cache(spec: str, kvh: int, d: int, dtype: torch.dtype, num_blocks: int, bs: int):
    codec = make_codec(spec, kvh, d, dtype)
    storage = codec.allocate(num_blocks, bs, torch.device("cpu"))
    gen = torch.Generator().manual_seed(d + kvh)
    slots = torch.arange(num_blocks * bs)
    codec.write(storage, slots, torch.randn(len(slots), kvh, d, generator=gen) * 2,
                torch.randn(len(slots), kvh, d, generator=gen))
    return codec, storage


def decode_rows(num_blocks: int, bs: int):
    """Five decode rows with their own (shuffled) tables, lengths 1 to a full table, then a 20-row prefill
    chunk sharing one table (row i sees 37 + i keys: two query groups, one of 16 rows)."""
    gen = torch.Generator().manual_seed(5)
    width = 8
    lens = [1, bs - 1, bs + 3, 5 * bs, width * bs, *range(38, 58)]
    tables = [torch.randperm(num_blocks - 1, generator=gen)[:width] + 1 for _ in range(5)]
    chunk = torch.randperm(num_blocks - 1, generator=gen)[:width] + 1
    tables += [chunk] * 20
    return torch.stack(tables), torch.tensor(lens)


def attend(kernels, layout, q, tables, lens, window, **aux):
    out = torch.full_like(q, float("nan"))
    operands = dict(zip(("k_signs", "norms", "rot_signs", "projection", "k_book", "v_book"), layout.aux, strict=True))
    operands.update(aux)
    kernels.tq_decode_attention(out, q, layout.k, layout.v, *operands.values(), tables, lens, q.shape[-1] ** -0.5,
                                window, _NONE, _NONE)
    return out


@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("spec,heads,kvh,d,dtype", [
    ("turboquant", 9, 3, 64, torch.float32),                     # SmolLM2's grouping, the defaults
    ("turboquant", 14, 2, 64, torch.bfloat16),                   # Qwen2.5-0.5B's grouping
    ("turboquant:qjl=0", 8, 2, 128, torch.float32),              # MSE only, the other vector head_dim
    ("turboquant:kbits=4,vbits=4", 4, 4, 128, torch.bfloat16),   # 16 centroids, no GQA
    ("turboquant:kbits=2,vbits=3,seed=7", 4, 1, 64, torch.float32),
    ("turboquant:kbits=1,vbits=1", 6, 2, 32, torch.float32),     # a head_dim with no vector path
])
def test_decode_kernel_matches_reference(kernels, spec, heads, kvh, d, dtype, window):
    bs, num_blocks = 16, 60
    codec, storage = filled_cache(spec, kvh, d, dtype, num_blocks, bs)
    layout = codec.layout(storage)
    assert layout.kind == "turboquant"
    tables, lens = decode_rows(num_blocks, bs)
    q = (torch.randn(len(lens), heads, d, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    expected = torch.empty_like(q)
    _reference_decode(expected, q, layout.read, tables, lens, d ** -0.5, window)
    torch.testing.assert_close(attend(kernels, layout, q, tables, lens, window), expected, **tolerance(dtype))


def test_the_check_catches_a_dropped_qjl_term_or_rotation(kernels):
    """The comparison above fails for a kernel that leaves out the QJL residual (||r|| read as 0) or the
    rotation's random signs (R = H / sqrt(d)): neither is within the tolerance of the reference."""
    codec, storage = filled_cache("turboquant", 3, 64, torch.float32, 60, 16)
    layout = codec.layout(storage)
    tables, lens = decode_rows(60, 16)
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(3)) * 2
    expected = torch.empty_like(q)
    _reference_decode(expected, q, layout.read, tables, lens, 64 ** -0.5, 0)
    torch.testing.assert_close(attend(kernels, layout, q, tables, lens, 0), expected, **tolerance(torch.float32))
    no_qjl = storage.norms.clone()
    no_qjl[2] = 0
    no_signs = torch.ones_like(codec.signs)
    for broken in ({"norms": no_qjl}, {"rot_signs": no_signs}):
        with pytest.raises(AssertionError, match="Mismatched elements"):
            torch.testing.assert_close(attend(kernels, layout, q, tables, lens, 0, **broken), expected,
                                       **tolerance(torch.float32))


def test_decode_kernel_rejects_bad_input(kernels):
    codec, storage = filled_cache("turboquant", 2, 64, torch.float32, 4, 16)
    layout = codec.layout(storage)
    q, table, lens = torch.zeros(1, 4, 64), torch.tensor([[1, 2]]), torch.tensor([20])
    attend(kernels, layout, q, table, lens, 0)  # well formed
    with pytest.raises(RuntimeError, match="block out of range"):
        attend(kernels, layout, q, torch.tensor([[1, 9]]), lens, 0)
    with pytest.raises(RuntimeError, match="past its block table"):
        attend(kernels, layout, q, table, torch.tensor([40]), 0)
    with pytest.raises(RuntimeError, match="norms must be"):
        attend(kernels, layout, q, table, lens, 0, norms=storage.norms[:2].contiguous())
    with pytest.raises(RuntimeError, match="2\\^bits"):
        attend(kernels, layout, q, table, lens, 0, k_book=layout.aux[5])


@pytest.mark.parametrize("dtype,ring_dtype", [(torch.float32, None), (torch.float32, torch.float32),
                                              (torch.bfloat16, None)])
@pytest.mark.parametrize("spec,heads,kvh,d,bs", [
    ("turboquant:residual=16", 9, 3, 64, 16),                       # SmolLM2's grouping
    ("turboquant:qjl=0,kbits=4,vbits=3,residual=32", 8, 2, 128, 32),  # 2 blocks of window
    ("turboquant:kbits=2,residual=8", 6, 2, 32, 16),                # no vector path
])
def test_window_kernel_matches_reference(kernels, dtype, ring_dtype, spec, heads, kvh, d, bs):
    """residual > 0 (KiviAttention): a first chunk, a chunk reading blocks and window, then decodes of two
    requests batched, as blocks leave the window; windows in fp16 beside fp32 (the engine's) or the model's."""
    twin = Twin(spec, heads, kvh, d, bs, dtype, kernels, 2, ring_dtype)
    assert twin.caches[1].layout(0).kind == "turboquant"
    twin.step([(0, 0, 45)])
    twin.step([(0, 45, 37), (1, 0, 7)])
    for t in range(30):
        twin.step([(0, 82 + t, 1), (1, 7 + t, 1)])
    assert twin.windows[1][0].filled == 112 and twin.windows[1][1].filled == 37


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
PROMPTS3 = [" ".join([p] * 3) for p in PROMPTS[:3]]  # with residual=32, blocks leave the window mid-run


@pytest.mark.parametrize("spec", ["turboquant:residual=32"])
def test_engine_greedy_tokens_with_the_kernel_equal_the_torch_path(make_llm, native_kernels_or_skip, monkeypatch,
                                                                   spec):
    """Real SmolLM2 weights (fp32), chunked and batched: the same greedy tokens (and logprobs to 2e-3)
    through the kernel as through the torch path (the runner without kernels, as THREEFOLD_ATTENTION=torch).
    Windows at the model's fp32 (see test_kivi_kernel's engine test)."""
    monkeypatch.setattr("threefold.worker.model_runner.window_dtype", lambda dtype: dtype)
    llm = make_llm(kv_cache_dtype=spec, max_num_batched_tokens=24, enable_prefix_caching=False)
    runner = llm.engine.core.runner
    assert runner.kernels is native_kernels_or_skip
    native = llm.generate(PROMPTS3, GREEDY)
    try:
        runner.kernels = None
        plain = llm.generate(PROMPTS3, GREEDY)
    finally:
        runner.kernels = native_kernels_or_skip
    for a, b in zip(native, plain, strict=True):
        ids = a.outputs[0].token_ids
        assert ids == b.outputs[0].token_ids
        ours = [position[t].logprob for t, position in zip(ids, a.outputs[0].logprobs, strict=True)]
        theirs = [position[t].logprob for t, position in zip(ids, b.outputs[0].logprobs, strict=True)]
        assert max(abs(x - y) for x, y in zip(ours, theirs, strict=True)) < 2e-3


def test_engine_without_a_window_every_call_matches_the_reference(make_llm, native_kernels_or_skip, monkeypatch):
    """residual = 0: every token is quantized as it is written, and a last-bit difference in one layer's
    attention flips a code or QJL sign of the next layer's keys (a whole quantization step), so greedy
    tokens are chaotic here: even the two plain-torch paths (kv/native.py's reference and the runner's
    SDPA path) disagree on one of these prompts. So each of the engine's attention calls, on the real
    model's K/V (decode rows and the chunks' in-place rows, batched), is checked against the reference."""
    from threefold.kv import native

    calls = []

    def checked(kernels, out, q, layout, block_table, seq_lens, scale, window, tree_starts=None, tree_bits=None):
        native.decode_attention(kernels, out, q, layout, block_table, seq_lens, scale, window, tree_starts, tree_bits)
        expected = torch.empty_like(out)
        native._reference_decode(expected, q, layout.read, block_table, seq_lens, scale, window, tree_starts,
                                 tree_bits)
        calls.append((len(q), (out - expected).abs().max().item(), expected.abs().max().item()))

    monkeypatch.setattr("threefold.worker.attention.decode_attention", checked)
    llm = make_llm(kv_cache_dtype="turboquant", max_num_batched_tokens=24, enable_prefix_caching=False)
    assert llm.engine.core.runner.kernels is native_kernels_or_skip
    llm.generate(PROMPTS3, GREEDY)
    assert len(calls) > 30 * 8 and max(rows for rows, _, _ in calls) > 1  # decodes and chunks, every layer
    assert max(err / max(1.0, size) for _, err, size in calls) < 1e-5
