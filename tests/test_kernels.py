"""threefold.kernels (native CPU passes) against plain-torch references, and the
engine with them on against the engine with them off.

The kernel checks run against every build this CPU can execute (native, x86-64-v3,
x86-64-v2: `available_targets()`), so each vector path is tested wherever the machine
has it, whichever one -march=native picks. The first build of each takes about a minute."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.prompts import PROMPTS
from threefold.env import Env
from threefold.kernels import (
    available_targets,
    build_kernels,
    cpu_kernels,
    few_rows_max,
    has_few_row_linear,
    has_int8_linear,
)
from threefold.model.llama import Linear, apply_rope
from threefold.sample.params import SamplingParams
from threefold.sample.sampler import Sampler, SamplingMetadata

NO_TREE = torch.empty(0, dtype=torch.long)
"""paged_decode_attention's candidate-tree mask arguments when there is none."""


@pytest.fixture(scope="module")
def native_kernels():
    """The engine's build."""
    if sys.platform != "linux" or Env.read().attention_backend == "torch":
        pytest.skip("native kernels are built on Linux unless THREEFOLD_ATTENTION=torch")
    module = cpu_kernels()
    assert module is not None, "the native CPU kernels failed to build (see the log warning)"
    return module


@pytest.fixture(scope="module", params=available_targets() or ["native"])
def kernels(request):
    """Each build this CPU can run."""
    if sys.platform != "linux":
        pytest.skip("native kernels are built on Linux")
    return build_kernels(request.param)


def test_portable_builds_hold_their_vector_paths():
    targets = available_targets()
    if sys.platform != "linux":
        assert targets == []
        return
    assert targets[0] == "native"
    if "x86-64-v3" in targets:
        assert build_kernels("x86-64-v3").build_isa() == "avx2"
    if "x86-64-v2" in targets:
        assert build_kernels("x86-64-v2").build_isa() == "generic"
    with pytest.raises(ValueError, match="x86-64-v3"):
        build_kernels("x86-64-v9")


def test_a_build_lock_left_by_an_interrupted_build_does_not_hang_the_next_load():
    """torch's build `lock` file outlives a killed build (Ctrl-C, timeout); loading must clear it, not wait forever."""
    if "x86-64-v2" not in available_targets():
        pytest.skip("no x86-64-v2 build on this machine")
    from threefold.kernels import _build_dir, _flags, _sources

    build_kernels("x86-64-v2")  # built (or cached) here first: the check below times only the load
    stale = _build_dir("x86-64-v2", _sources(), _flags("x86-64-v2")) / "lock"
    stale.touch()
    load = "from threefold.kernels import build_kernels; print(build_kernels('x86-64-v2').build_isa())"
    done = subprocess.run([sys.executable, "-c", load], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "generic", done.stderr[-2000:]
    assert not stale.exists()


def test_a_build_compiles_copies_in_its_own_folder_so_every_checkout_shares_it():
    """ninja names files by absolute path: a build from the checkout's own files was rebuilt in every checkout."""
    if "x86-64-v2" not in available_targets():
        pytest.skip("no x86-64-v2 build on this machine")
    from threefold.kernels import _DIR, _build_dir, _flags, _sources

    build_kernels("x86-64-v2")
    build_dir = _build_dir("x86-64-v2", _sources(), _flags("x86-64-v2"))
    ninja = (build_dir / "build.ninja").read_text()
    assert str(_DIR) not in ninja and str(build_dir / "src" / "linear.cpp") in ninja
    assert (build_dir / "src" / "kernel_common.h").read_text() == (_DIR / "kernel_common.h").read_text()


def _tolerance(dtype: torch.dtype) -> dict:
    # fp32: summation order only. bf16: both sides round to bf16 (8 bits of mantissa), the
    # reference at more intermediate steps, so a few ulps at the outputs' magnitude (~1).
    return {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}


def _reference_decode(q, k_cache, v_cache, tables, lens, scale, window):
    """Per sequence: gather its keys in order, softmax in fp32, weighted sum of values."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.empty_like(q)
    for b, length in enumerate(lens.tolist()):
        pos = torch.arange(length)
        slots = tables[b, pos // block_size] * block_size + pos % block_size
        k = k_cache.reshape(-1, kv_heads, q.shape[2])[slots].float()  # [L, kvh, d]
        v = v_cache.reshape(-1, kv_heads, q.shape[2])[slots].float()
        if window:
            k, v = k[-window:], v[-window:]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [L, H, d]
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


_ATTENTION_SHAPES = pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window", [
    (9, 3, 64, 16, 0),     # SmolLM2's shape
    (14, 2, 64, 16, 0),    # Qwen2.5-0.5B's grouping
    (4, 4, 128, 4, 0),     # no GQA, the other specialized head_dim, small blocks
    (6, 2, 48, 8, 0),      # a head_dim with no specialization (runtime loop; no AMX path)
    (8, 2, 64, 16, 37),    # sliding window: tiles start mid-block
    (16, 1, 128, 32, 0),   # the largest group one AMX tile holds; blocks of two tiles
    (17, 1, 64, 16, 0),    # a larger group: the vector path even where AMX is on
])


def _check_decode_attention(kernels, dtype, heads, kv_heads, head_dim, block_size, window):
    gen = torch.Generator().manual_seed(0)
    lens = torch.tensor([1, 5, 16, 17, 100, 333, 64], dtype=torch.long)
    width = -(-int(lens.max()) // block_size) + 2  # padded with a trailing null block, as the runner does
    num_blocks = len(lens) * width + 1
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks - 1, generator=gen)[: len(lens) * width].view(len(lens), width) + 1
    tables[:, -1] = 0
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    kernels.paged_decode_attention(out, q, cache[0], cache[1], tables, lens, scale, window, NO_TREE, NO_TREE)
    expected = _reference_decode(q, cache[0], cache[1], tables, lens, scale, window)
    torch.testing.assert_close(out, expected, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@_ATTENTION_SHAPES
def test_paged_decode_attention_matches_reference(kernels, dtype, heads, kv_heads, head_dim, block_size, window):
    """The vector path (bf16 too: AMX off), in every build."""
    kernels.set_amx(False)
    try:
        _check_decode_attention(kernels, dtype, heads, kv_heads, head_dim, block_size, window)
    finally:
        kernels.set_amx(True)  # the default


@_ATTENTION_SHAPES
def test_amx_decode_attention_matches_reference(native_kernels, heads, kv_heads, head_dim, block_size, window):
    """bf16 decode attention on AMX tiles, where the native build and the CPU (and OS) have them."""
    if not native_kernels.set_amx(True):
        pytest.skip("this CPU (or OS) gives no AMX tiles")
    _check_decode_attention(native_kernels, torch.bfloat16, heads, kv_heads, head_dim, block_size, window)


def _grouped_rows(block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Block tables and lengths as a step with speculative verifies lays them out: each request's
    rows in a run sharing its table (a verify's k + 1 rows see one more key each; a chunk read in
    place, longer than one group), lone decodes between, and two requests that share their first
    block (a prefix hit) but not the next, whose rows read the same blocks only up to it."""
    requests = [(40, 5), (3, 1), (130, 3), (16, 20), (70, 2), (0, 1), (47, 4)]  # (context, rows)
    width = -(-max(c + r for c, r in requests) // block_size) + 1
    num_blocks = 2 * len(requests) * width + 1
    blocks = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, lens = [], []
    for context, rows in requests:
        table = [blocks.pop() for _ in range(width)]
        tables += [table] * rows
        lens += range(context + 1, context + rows + 1)
    shared = [tables[-1][0]] + [blocks.pop() for _ in range(width - 1)]  # a prefix hit on the last request's block 0
    tables += [shared] * 2
    lens += [block_size, block_size + 1]  # the first reads only the shared block, the second one more
    tables.append(tables[0])  # a row of the first request again, not next to it, with fewer keys
    lens.append(2)
    return torch.tensor(tables, dtype=torch.long), torch.tensor(lens, dtype=torch.long), num_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@_ATTENTION_SHAPES
def test_paged_decode_attention_reads_shared_blocks_once_per_group(kernels, dtype, heads, kv_heads, head_dim,
                                                                   block_size, window):
    """Rows that read through the same blocks (a verify's k + 1 rows) are attended as one group
    where the build's path groups them: each row still sees exactly its own keys (its length,
    its window), against the per-row reference, in every build."""
    gen = torch.Generator().manual_seed(1)
    tables, lens, num_blocks = _grouped_rows(block_size, gen)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    kernels.set_amx(False)
    try:
        kernels.paged_decode_attention(out, q, cache[0], cache[1], tables, lens, head_dim ** -0.5, window,
                                       NO_TREE, NO_TREE)
    finally:
        kernels.set_amx(True)
    expected = _reference_decode(q, cache[0], cache[1], tables, lens, head_dim ** -0.5, window)
    torch.testing.assert_close(out, expected, **_tolerance(dtype))


def test_paged_decode_attention_rejects_bad_input(kernels):
    q = torch.zeros(2, 4, 64)
    cache = torch.zeros(3, 16, 2, 64)
    with pytest.raises(RuntimeError, match="int64"):
        kernels.paged_decode_attention(torch.empty_like(q), q, cache, cache, torch.zeros(2, 1, dtype=torch.int32),
                                       torch.ones(2, dtype=torch.long), 1.0, 0, NO_TREE, NO_TREE)
    with pytest.raises(RuntimeError, match="multiple"):
        kernels.paged_decode_attention(torch.zeros(2, 3, 64), torch.zeros(2, 3, 64), cache, cache,
                                       torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long), 1.0, 0,
                                       NO_TREE, NO_TREE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_torch(kernels, dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, 576, generator=gen).to(dtype)
    residual = torch.randn(37, 576, generator=gen).to(dtype)
    weight = torch.rand(576, generator=gen).to(dtype) + 0.5
    expected_residual = x + residual
    expected = F.rms_norm(expected_residual.float(), (576,), weight.float(), 1e-5)
    got_x, got_residual = x.clone(), residual.clone()
    kernels.add_rms_norm(got_x, got_residual, weight, 1e-5, True)
    assert torch.equal(got_residual, expected_residual)  # the sum rounds exactly as `x + residual`
    torch.testing.assert_close(got_x.float(), expected, **_tolerance(dtype))
    alone = x.clone()
    kernels.add_rms_norm(alone, alone, weight, 1e-5, False)
    torch.testing.assert_close(alone.float(), F.rms_norm(x.float(), (576,), weight.float(), 1e-5),
                               **_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_silu_and_mul_match_torch(kernels, dtype):
    gen = torch.Generator().manual_seed(2)
    max_len, half = 64, 32
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), torch.rand(half, generator=gen))
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    qkv = torch.randn(9, 5 * 64 + 64, generator=gen).to(dtype)
    qk = qkv[:, : 5 * 64].view(9, 5, 64)  # a strided view, as the model hands it over
    positions = torch.tensor([0, 3, 63, 7, 7, 1, 20, 40, 2])
    expected = apply_rope(qk.float(), cos[positions].float().unsqueeze(1), sin[positions].float().unsqueeze(1))
    v_before = qkv[:, 5 * 64:].clone()
    kernels.rotary_embedding(qk, positions, cos, sin)
    torch.testing.assert_close(qk.float(), expected, **_tolerance(dtype))
    assert torch.equal(qkv[:, 5 * 64:], v_before)  # only q/k rotate

    gate_up = torch.randn(11, 2 * 96, generator=gen).to(dtype)
    out = torch.empty(11, 96, dtype=dtype)
    kernels.silu_and_mul(out, gate_up)
    gate, up = gate_up.float().split(96, dim=-1)
    torch.testing.assert_close(out.float(), F.silu(gate) * up, **_tolerance(dtype))


def _bf16_linear(seed: int, rows: int) -> tuple[Linear, torch.Tensor, torch.Tensor]:
    """A [576 -> 960] bf16 Linear with bias (SmolLM2's qkv), an input of `rows`, and F.linear's output."""
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(576, 960, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(960, 576, generator=gen))
        layer.bias.copy_(torch.randn(960, generator=gen))
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    return layer, x, F.linear(x, layer.weight, layer.bias)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_bf16_linear_is_bit_exact(rows):
    layer, x, expected = _bf16_linear(3, rows)
    if not layer.pack():
        pytest.skip("this torch build has no oneDNN linear")
    assert torch.equal(layer(x), expected)


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_packed_fp32_linear_matches_float64(rows):
    """fp32 weights are prepacked for oneDNN too (MKL's F.linear is 2-3x slower on AMD EPYCs)."""
    gen = torch.Generator().manual_seed(5)
    layer = Linear(576, 960, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(960, 576, generator=gen))
        layer.bias.copy_(torch.randn(960, generator=gen))
    x = torch.randn(rows, 576, generator=gen)
    expected = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    if not layer.pack():
        pytest.skip("this torch build has no oneDNN linear")
    assert layer.packed is not None and layer.packed.dtype == torch.float32
    torch.testing.assert_close(layer(x).double(), expected, atol=1e-4, rtol=1e-5)


_F32, _BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("x_dtype,w_dtype", [(_F32, _F32), (_BF16, _BF16), (_F32, _BF16)])
@pytest.mark.parametrize("rows,out_features,in_features,bias", [
    (1, 960, 576, True),     # SmolLM2's qkv at batch 1
    (2, 576, 1536, False),   # its down projection at batch 2
    (1, 35, 50, True),       # a partial row block and a partial K chunk
    (5, 17, 96, False),      # a partial tile of x rows
    (16, 130, 203, True),    # FEW_ROWS_MAX-sized batches, every tail at once
])
def test_linear_small_matches_float64(kernels, x_dtype, w_dtype, rows, out_features, in_features, bias):
    out_dtype = _BF16 if x_dtype == w_dtype == _BF16 else _F32  # bias and output: fp32 unless all bf16
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(rows, 2 * in_features, generator=gen).to(x_dtype)[:, :in_features]  # strided rows
    w = torch.randn(out_features, in_features, generator=gen).to(w_dtype)
    b = torch.randn(out_features, generator=gen).to(out_dtype) if bias else None
    out = torch.full((rows, out_features), float("nan"), dtype=out_dtype)
    if kernels.build_isa() == "generic":  # no vector path (x86-64-v2): declined, nothing written
        assert not kernels.linear_small(out, x, w, b)
        assert torch.isnan(out).all()
        assert not has_few_row_linear(kernels, x_dtype, w_dtype)  # so the loader keeps no plain weights for it
        return
    assert kernels.linear_small(out, x, w, b)
    assert has_few_row_linear(kernels, x_dtype, w_dtype)
    expected = F.linear(x.double(), w.double(), None if b is None else b.double())
    # Each side sums in fp32 in its own order, then rounds once to the dtype, as F.linear does.
    torch.testing.assert_close(out.double(), expected, **({"atol": 1e-4, "rtol": 1e-5} if out_dtype == _F32
                                                          else {"atol": 0.25, "rtol": 8e-3}))
    assert not kernels.linear_small(out, x, w.t(), b)  # a transposed (strided) weight: declined, not misread
    assert not kernels.linear_small(out[:, :-1], x, w, b)  # shapes that disagree: declined
    assert not kernels.linear_small(out, x.to(torch.float16), w, b)  # a dtype it does not take: declined
    if bias:
        assert not kernels.linear_small(out, x, w, b.to(_BF16 if out_dtype == _F32 else _F32))  # bias not out's dtype


@pytest.mark.parametrize("x_dtype", [_F32, _BF16])
@pytest.mark.parametrize("rows,out_features,in_features,bias", [
    (1, 960, 576, True),     # SmolLM2's qkv at batch 1
    (1, 35, 50, True),       # a partial row block and a partial K chunk
    (5, 17, 96, False),      # a partial tile of x rows
    (16, 130, 203, True),    # FEW_ROWS_MAX-sized batches, every tail at once
])
def test_linear_small_int8_matches_float64(kernels, x_dtype, rows, out_features, in_features, bias):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(rows, 2 * in_features, generator=gen).to(x_dtype)[:, :in_features]  # strided rows
    w = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    scale = torch.rand(out_features, generator=gen) / 64 + 1e-3
    b = torch.randn(out_features, generator=gen).to(x_dtype) if bias else None
    out = torch.full((rows, out_features), float("nan"), dtype=x_dtype)
    if kernels.build_isa() == "generic":  # no vector path (x86-64-v2): declined, nothing written
        assert not kernels.linear_small_int8(out, x, w, scale, b)
        assert torch.isnan(out).all() and not has_int8_linear(kernels)
        return
    assert kernels.linear_small_int8(out, x, w, scale, b) and has_int8_linear(kernels)
    expected = F.linear(x.double(), w.double() * scale.double()[:, None], None if b is None else b.double())
    torch.testing.assert_close(out.double(), expected, **({"atol": 1e-4, "rtol": 1e-5} if x_dtype == _F32
                                                          else {"atol": 0.25, "rtol": 8e-3}))
    assert not kernels.linear_small_int8(out, x, w.t(), scale, b)  # a strided weight: declined
    assert not kernels.linear_small_int8(out, x, w, scale[:-1], b)  # a scale per row, or nothing
    assert not kernels.linear_small_int8(out, x, w.float(), scale, b)  # not int8: declined
    assert not kernels.linear_small_int8(out.to(_BF16 if x_dtype == _F32 else _F32), x, w, scale, b)  # out not x's


def test_linear_store_int8_is_within_half_a_step_and_serves_few_rows(native_kernels):
    kernels = native_kernels
    if not has_int8_linear(kernels):
        pytest.skip("this build has no int8 few-row linear (no AVX2)")
    layer, x, _ = _bf16_linear(5, few_rows_max(kernels) + 3)
    weight = layer.weight.detach().double()
    layer.pack()
    layer.store_int8()
    layer.use_kernels(kernels, torch.bfloat16)
    q, scale = layer.stream_weight, layer.stream_scale
    assert q.dtype == torch.int8 and layer.kernels is kernels and layer.max_rows == few_rows_max(kernels)
    error = (q.double() * scale.double()[:, None] - weight).abs()
    assert (error <= scale.double()[:, None] * (0.5 + 1e-4)).all()  # round to nearest: half a step (+ fp32's division)
    assert (q.abs().amax(dim=1) == 127).all()  # each row's largest weight sets its scale
    dequantized = q.double() * scale.double()[:, None]
    expected = F.linear(x.double(), dequantized, layer.bias.double())
    few = x[: layer.max_rows]
    torch.testing.assert_close(layer(few).double(), expected[: layer.max_rows], atol=0.25, rtol=8e-3)
    torch.testing.assert_close(layer(x).double(), F.linear(x.double(), weight, layer.bias.double()),
                               atol=0.25, rtol=8e-3)  # more rows: the packed bf16 weight, not the int8 codes
    sliced = layer.rows(torch.tensor([3, 0, 2]))  # a draft vocabulary's rows keep the int8 stream
    assert torch.equal(sliced.stream_weight, q[[3, 0, 2]]) and torch.equal(sliced.stream_scale, scale[[3, 0, 2]])


def test_few_row_linear_probe_names_the_dtype_pairs(kernels):
    vector = kernels.build_isa() != "generic"
    assert has_few_row_linear(kernels, _F32) == vector
    assert has_few_row_linear(kernels, _F32, _BF16) == vector
    assert has_few_row_linear(kernels) == vector  # bf16 x and w
    assert not has_few_row_linear(kernels, _BF16, _F32)  # bf16 x with fp32 weights: not a combination it takes
    assert not has_few_row_linear(None)


def test_linear_module_routes_few_rows_to_the_kernel(native_kernels):
    kernels = native_kernels
    if not has_few_row_linear(kernels):
        pytest.skip("this build has no few-row linear (no AVX2)")
    limit = few_rows_max(kernels)
    layer, x, expected = _bf16_linear(5, limit + 3)
    layer.pack()
    calls = []
    real = kernels.linear_small

    class Spy:
        def linear_small(self, *args):
            calls.append(args[1].shape[0])
            return real(*args)
    layer.kernels, layer.stream_weight, layer.max_rows = Spy(), layer.weight.detach(), limit
    torch.testing.assert_close(layer(x[:1]), expected[:1], atol=0.25, rtol=8e-3)
    torch.testing.assert_close(layer(x[:limit]), expected[:limit], atol=0.25, rtol=8e-3)
    torch.testing.assert_close(layer(x), expected, atol=0.25, rtol=8e-3)
    assert calls == [1, limit]  # up to the limit took the kernel; more rows took the packed GEMM


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_matches_torch_argmax(kernels, dtype):
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(9, 49152 + 5, generator=gen).to(dtype)  # a partial 16-lane tail
    logits[0, [7, 9000]] = 100.0      # a tie: the first index
    logits[1, -1] = 100.0             # the max in the tail
    logits[2, [77, 99]] = float("nan")  # a NaN wins, as in torch
    logits[3] = float("-inf")
    logits[4] = 0.0
    assert torch.equal(kernels.argmax_rows(logits), logits.argmax(-1))
    assert kernels.argmax_rows(logits)[:5].tolist() == [7, 49156, 77, 0, 0]
    short = torch.randn(5, 37, generator=gen).to(dtype)
    assert torch.equal(kernels.argmax_rows(short), short.argmax(-1))
    greedy = SamplingMetadata.build([SamplingParams(temperature=0.0)] * 9, [0] * 9, [None] * 9, {}, [2],
                                    logits.shape[-1], torch.device("cpu"))
    assert torch.equal(Sampler(kernels)(logits, greedy).sampled_token_ids, logits.argmax(-1))


def test_engine_with_kernels_matches_the_torch_path(make_llm, smollm2_fp32, native_kernels):
    """The same greedy tokens, with close logprobs, whichever path runs attention and the
    small ops; decodes of different lengths in one batch exercise the load balancing."""
    llm = make_llm(max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True)
    prompts = PROMPTS[:6]
    runner, kernels = llm.engine.core.runner, native_kernels
    assert runner.kernels is kernels
    native = llm.generate(prompts, params)
    try:
        smollm2_fp32.model.use_kernels(None)
        runner.kernels = None
        plain = llm.generate(prompts, params)
    finally:
        smollm2_fp32.model.use_kernels(kernels)
        runner.kernels = kernels
    for a, b in zip(native, plain, strict=True):
        ids = a.outputs[0].token_ids
        assert ids == b.outputs[0].token_ids
        ours = [position[t].logprob for t, position in zip(ids, a.outputs[0].logprobs, strict=True)]
        theirs = [position[t].logprob for t, position in zip(ids, b.outputs[0].logprobs, strict=True)]
        assert ours == pytest.approx(theirs, abs=1e-3)
