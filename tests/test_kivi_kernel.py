"""kernels/kivi_attention.cpp (KIVI blocks read in place) against KiviAttention's plain-torch
reference path, step by step on hand-built requests, and the engine with the kernel on and off."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.prompts import PROMPTS
from threefold.env import Env
from threefold.kernels import available_targets, build_kernels, cpu_kernels
from threefold.kv.paged import PagedKVCache
from threefold.kv.registry import make_codec
from threefold.kv.window import ArenaShape, WindowArena, window_dtype
from threefold.sample.params import SamplingParams
from threefold.worker.kivi_attention import KiviAttention, KiviRequest


@pytest.fixture(scope="module", params=available_targets() or ["native"])
def kernels(request):
    """Each build this CPU can run."""
    if sys.platform != "linux":
        pytest.skip("native kernels are built on Linux")
    return build_kernels(request.param)


@pytest.fixture(scope="module")
def native_kernels_or_skip():
    """The engine's build."""
    if sys.platform != "linux" or Env.read().attention_backend == "torch":
        pytest.skip("native kernels are built on Linux unless THREEFOLD_ATTENTION=torch")
    module = cpu_kernels()
    assert module is not None, "the native CPU kernels failed to build (see the log warning)"
    return module


class Twin:
    """The same requests through two caches: the reference path and the kernel."""

    def __init__(self, spec, heads, kvh, d, bs, dtype, kernels, num_requests, ring_dtype=None):
        self.codec = make_codec(spec, kvh, d, dtype)
        self.heads, self.kvh, self.d, self.bs, self.dtype, self.kernels = heads, kvh, d, bs, dtype, kernels
        self.caches = [PagedKVCache(self.codec, 1, 40, bs, torch.device("cpu")) for _ in range(2)]
        ring_dtype = ring_dtype or window_dtype(dtype)  # the engine's: fp16 windows beside fp32 compute
        self.arenas = [WindowArena(ArenaShape.of([self.codec], bs), num_requests, kvh, d, ring_dtype,
                                   torch.device("cpu")) for _ in range(2)]
        self.windows = [[arena.acquire(str(i), 0) for i in range(num_requests)] for arena in self.arenas]
        # request i owns blocks 1 + 12 i ..., shuffled so tables are not contiguous
        self.blocks = [torch.randperm(12, generator=torch.Generator().manual_seed(i)) + 1 + 12 * i
                       for i in range(num_requests)]
        self.gen = torch.Generator().manual_seed(7)

    def step(self, chunks: list[tuple[int, int, int]]) -> None:
        """chunks: (request, context, length); attends with both paths and compares."""
        rand = lambda n, h: torch.randn(n, h, self.d, generator=self.gen).to(self.dtype)  # noqa: E731
        total = sum(n for _, _, n in chunks)
        q, k, v = rand(total, self.heads), rand(total, self.kvh), rand(total, self.kvh)
        outs = []
        for side in range(2):
            requests, start = [], 0
            for i, ctx, n in chunks:
                window = self.windows[side][i]
                requests.append(KiviRequest(start, n, ctx, self.blocks[i][: -(-(ctx + n) // self.bs)], window))
                start += n
            attention = KiviAttention(self.caches[side], self.arenas[side], requests, self.d ** -0.5,
                                      kernels=self.kernels if side else None)
            outs.append(attention(0, q, k, v))
            for i, ctx, n in chunks:
                self.windows[side][i].filled = ctx + n
        fp32 = self.dtype == torch.float32
        torch.testing.assert_close(outs[1], outs[0], atol=3e-5 if fp32 else 3e-2, rtol=1e-5 if fp32 else 2e-2)


@pytest.mark.parametrize("dtype,ring_dtype", [(torch.float32, None), (torch.float32, torch.float32),
                                              (torch.bfloat16, None)])
@pytest.mark.parametrize("spec,heads,kvh,d,bs", [
    ("kivi2:group=16,residual=16", 9, 3, 64, 16),    # SmolLM2's grouping
    ("kivi4:group=16,residual=32", 14, 2, 64, 32),   # Qwen2.5-0.5B's grouping, 2 key groups per block
    ("kivi2:group=32,residual=32", 4, 4, 128, 32),   # no GQA, head_dim 128
    ("kivi4:group=8,residual=8", 6, 2, 48, 16),      # a head_dim with no specialization
    ("tiered:group=16,residual=16,middle=32,sink=4", 9, 3, 64, 16),  # the band ring wraps, sinks
    ("tiered:group=8,residual=8,middle=16,sink=3", 6, 2, 48, 16),
    ("tiered:group=16,residual=16,middle=0,sink=0", 9, 3, 64, 16),   # no band, no sinks: kivi2's reads
])
def test_kivi_kernel_matches_reference(kernels, dtype, ring_dtype, spec, heads, kvh, d, bs):
    """Prefill chunks (the first one alone, a later one reading blocks and window), then decodes
    of two requests batched: contexts end inside the window, inside a partial key group and on
    block boundaries as they grow. Windows in the engine's dtype (fp16 beside fp32) or the model's."""
    twin = Twin(spec, heads, kvh, d, bs, dtype, kernels, 2, ring_dtype)
    assert twin.caches[1].layout(0).kind in ("kivi", "tiered")  # the kernel's layouts, not GEAR's
    twin.step([(0, 0, 45)])
    twin.step([(0, 45, 37), (1, 0, 7)])  # a chunk longer than the window beside a first one
    for t in range(40):
        twin.step([(0, 82 + t, 1), (1, 7 + t, 1)])
    assert twin.windows[1][0].filled == 122 and twin.windows[1][1].filled == 47


def test_kivi_kernel_rejects_bad_input(kernels):
    q = torch.zeros(1, 4, 64)
    codes = torch.zeros(3, 16, 2, 16, dtype=torch.uint8)
    k_meta, v_meta = torch.zeros(3, 1, 2, 64, dtype=torch.float16), torch.zeros(3, 16, 2, 4, dtype=torch.float16)
    ring, table = torch.zeros(2, 1, 32, 2, 64), torch.zeros(1, 1, dtype=torch.long)
    one = torch.ones(1, dtype=torch.long)
    args = [codes, codes, k_meta, k_meta, v_meta, v_meta, ring, table, one, one, one, one, 1.0]
    kernels.kivi_attention(torch.empty_like(q), q, *args)  # well formed
    bad = torch.zeros(3, 16, 2, 8, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="2 or 4 bits"):
        kernels.kivi_attention(torch.empty_like(q), q, bad, bad, *args[2:])
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.kivi_attention(torch.empty_like(q), q, *args[:6], ring.bfloat16(), *args[7:])
    with pytest.raises(RuntimeError, match="int64"):
        kernels.kivi_attention(torch.empty_like(q), q, *args[:7], table.int(), *args[8:])


def test_engine_kivi4_with_the_kernel_matches_the_torch_path(make_llm, smollm2_fp32, native_kernels_or_skip,
                                                            monkeypatch):
    """Greedy tokens through the kernel equal the reference path's (kivi4: the same quantized
    blocks, only the summation order differs); a chunked, batched run. The windows are held at the
    model's fp32 here: fp16 windows round a last-bit difference from the other passes (kernels off
    swaps them too) to a whole fp16 step, which 8 tokens through 30 layers grow to ~1e-2 in logprob;
    the kernel's fp16-window arithmetic is checked step by step above."""
    monkeypatch.setattr("threefold.worker.model_runner.window_dtype", lambda dtype: dtype)
    llm = make_llm(kv_cache_dtype="kivi4:group=16,residual=32", max_num_batched_tokens=24,
                   enable_prefix_caching=False)
    runner = llm.engine.core.runner
    assert runner.kernels is native_kernels_or_skip
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
    prompts = [" ".join([p] * 3) for p in PROMPTS[:3]]  # blocks leave the window mid-run
    native = llm.generate(prompts, params)
    try:
        runner.kernels = None
        plain = llm.generate(prompts, params)
    finally:
        runner.kernels = native_kernels_or_skip
    for a, b in zip(native, plain, strict=True):
        ids = a.outputs[0].token_ids
        assert ids == b.outputs[0].token_ids
        ours = [position[t].logprob for t, position in zip(ids, a.outputs[0].logprobs, strict=True)]
        theirs = [position[t].logprob for t, position in zip(ids, b.outputs[0].logprobs, strict=True)]
        # 2e-3: the prefill chunks' tiled kernel sums keys in tiles (an online softmax), so one of the 24
        # log-probs landed 1.02e-3 from the torch path's; its rows agree to 3e-5 step by step (fp32).
        assert ours == pytest.approx(theirs, abs=2e-3)
