"""The native compressed-KV attention kernel against the plain-torch reference path (the
codec's dense read + fp32 softmax), over the shapes test_kernels covers; and the engine's
attention with the kernel on against the same attention with it off."""

from __future__ import annotations

import sys

import pytest
import torch

from threefold.env import Env
from threefold.kernels import available_targets, build_kernels, cpu_kernels
from threefold.kv.native import decode_attention
from threefold.kv.paged import PagedKVCache
from threefold.kv.registry import make_codec
from threefold.worker.attention import AttentionMetadata, PagedAttention, PrefillChunk

SPECS = ["int8", "fp8", "fp8_e5m2", "int4", "int4:group=16"]


@pytest.fixture(scope="module")
def kernels():
    if sys.platform != "linux" or Env.read().attention_backend == "torch":
        pytest.skip("native kernels are built on Linux unless THREEFOLD_ATTENTION=torch")
    module = cpu_kernels()
    assert module is not None, "the native kernels failed to build"
    return module


@pytest.fixture(scope="module", params=available_targets() or ["native"])
def builds(request):
    """Each build this CPU can run (native, x86-64-v3, x86-64-v2): every vector path of the kernel."""
    if sys.platform != "linux":
        pytest.skip("native kernels are built on Linux")
    return build_kernels(request.param)


def _reference(codec, storage, q, tables, lens, scale, window):
    """Per sequence: the codec's dense read of its blocks, fp32 softmax, weighted sum."""
    keys, values = codec.read(storage, tables)  # [B, kvh, L, d]
    group = q.shape[1] // keys.shape[1]
    out = torch.empty_like(q)
    for b, length in enumerate(lens.tolist()):
        first = max(0, length - window) if window else 0
        k = keys[b, :, first:length].float().repeat_interleave(group, 0)  # [H, n, d]
        v = values[b, :, first:length].float().repeat_interleave(group, 0)
        scores = torch.einsum("hd,hnd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,hnd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


def _filled_cache(spec, kv_heads, head_dim, block_size, num_blocks, dtype, gen):
    codec = make_codec(spec, kv_heads, head_dim, dtype)
    storage = codec.allocate(num_blocks, block_size, torch.device("cpu"))
    slots = torch.arange(num_blocks * block_size)
    k = torch.randn(len(slots), kv_heads, head_dim, generator=gen)
    v = torch.randn(len(slots), kv_heads, head_dim, generator=gen)
    codec.write(storage, slots, k, v)
    return codec, storage


def _tolerance(dtype):
    # The kernel dequantizes to fp32; the reference reads back in the compute dtype (bf16: 8 bits).
    return {"atol": 3e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window", [
    (9, 3, 64, 16, 0),     # SmolLM2's shape
    (14, 2, 64, 16, 0),    # Qwen2.5-0.5B's grouping
    (4, 4, 128, 4, 0),     # no GQA, the other specialized head_dim, small blocks
    (6, 2, 48, 8, 0),      # a head_dim with no specialization (runtime loop)
    (8, 2, 64, 16, 37),    # sliding window: rows start mid-block
    (17, 1, 64, 32, 0),    # a large group, blocks of 32
])
def test_kv_decode_attention_matches_reference(builds, spec, dtype, heads, kv_heads, head_dim, block_size, window):
    if spec == "int4" and head_dim % 32:
        spec = "int4:group=16"
    gen = torch.Generator().manual_seed(0)
    lens = torch.tensor([1, 5, 16, 17, 100, 333, 64], dtype=torch.long)
    width = -(-int(lens.max()) // block_size) + 2  # a trailing null block, as the runner pads
    num_blocks = len(lens) * width + 1
    codec, storage = _filled_cache(spec, kv_heads, head_dim, block_size, num_blocks, dtype, gen)
    tables = torch.randperm(num_blocks - 1, generator=gen)[: len(lens) * width].view(len(lens), width) + 1
    tables[:, -1] = 0
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    out = torch.empty_like(q)
    scale = head_dim ** -0.5
    decode_attention(builds, out, q, codec.layout(storage), tables.contiguous(), lens, scale, window)
    torch.testing.assert_close(out, _reference(codec, storage, q, tables, lens, scale, window), **_tolerance(dtype))


@pytest.mark.parametrize("spec,q_len", [("int8", 23), ("int4", 23), ("auto", 5)])  # dense: short chunks only
@pytest.mark.parametrize("window", [None, 20])
def test_prefill_with_context_reads_the_cache_in_place(kernels, spec, q_len, window, monkeypatch):
    """A chunk resuming at position 45 through the kernel = the torch path (dense read + SDPA)."""
    calls = []
    monkeypatch.setattr(PagedAttention, "_prefill_in_place",
                        lambda self, *args, _f=PagedAttention._prefill_in_place: calls.append(1) or _f(self, *args))
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, block_size, context = 6, 2, 64, 16, 45
    codec = make_codec(spec, kv_heads, head_dim, torch.float32)
    cache = PagedKVCache(codec, 1, 9, block_size, torch.device("cpu"))
    blocks = torch.tensor([[7, 2, 5, 8, 3]])
    pos = torch.arange(context + q_len)
    slots = blocks[0, pos // block_size] * block_size + pos % block_size
    k_all = torch.randn(len(pos), kv_heads, head_dim, generator=gen)
    v_all = torch.randn(len(pos), kv_heads, head_dim, generator=gen)
    cache.write(0, slots[:context], k_all[:context], v_all[:context])
    q = torch.randn(q_len, heads, head_dim, generator=gen)
    meta = AttentionMetadata(slots[context:], [], [PrefillChunk(0, q_len, context, blocks)], window)
    args = (0, q, k_all[context:], v_all[context:])
    native = PagedAttention(cache, meta, head_dim ** -0.5, torch.float32, kernels)(*args)
    plain = PagedAttention(cache, meta, head_dim ** -0.5, torch.float32, None)(*args)
    torch.testing.assert_close(native, plain, atol=3e-5, rtol=1e-5)
    assert calls  # the kernel path ran
