"""kernels/gear_attention.cpp (GEAR blocks read in place, decode rows and prefill chunks) against
KiviAttention's plain-torch reference path, step by step on hand-built requests over every kernel
build, and the engine's greedy tokens with the kernel on and off on SmolLM2's real weights."""

from __future__ import annotations

import pytest
import torch

from tests.prompts import PROMPTS
from tests.test_kivi_kernel import Twin, kernels, native_kernels_or_skip  # noqa: F401  # fixtures
from tests.test_kivi_prefill import _chunks
from threefold.sample.params import SamplingParams
from threefold.worker.kivi_attention import KiviAttention

SHAPES = [
    ("gear:bits=2,group=16,residual=16,rank=2,outliers=20", 9, 3, 64, 16),   # SmolLM2's grouping, defaults
    ("gear:bits=4,group=32,residual=32,rank=4,outliers=10", 4, 2, 128, 32),  # head_dim 128, GQA 2
    ("gear:bits=4,group=16,residual=32,rank=0,outliers=0", 14, 2, 64, 32),   # Qwen2.5-0.5B's grouping: KIVI alone
    ("gear:bits=2,group=16,residual=16,rank=2,outliers=0", 9, 3, 64, 16),    # low rank, no outliers
    ("gear:bits=2,group=8,residual=8,rank=0,outliers=40", 6, 2, 48, 16),     # outliers alone, no specialization
]


def _steps(twin: Twin) -> None:
    """Prefill chunks straddling the window boundary beside decodes, a prefix hit (window.start > 0, a
    chunk from there), then batched decodes of both requests across block boundaries."""
    _chunks(twin)
    hit_end = 2 * twin.bs + 50
    for t in range(twin.bs + 2):
        twin.step([(0, 144 + t, 1), (1, hit_end + t, 1)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec,heads,kvh,d,bs", SHAPES)
def test_gear_kernel_matches_reference(kernels, dtype, spec, heads, kvh, d, bs):  # noqa: F811
    twin = Twin(spec, heads, kvh, d, bs, dtype, kernels, 2)
    assert twin.caches[1].layout(0).kind == "gear"
    _steps(twin)
    assert twin.windows[1][1].start == 2 * bs


@pytest.mark.parametrize("term", ["low rank", "outliers"])
def test_dropping_a_term_is_caught(kernels, monkeypatch, term):  # noqa: F811
    """The comparison above is sharp: the kernel given zero factors Q (no Q P^T) or no outliers fails it."""
    right = KiviAttention._gear

    def dropped(self, layout, *args):
        values, index, factor_q, factor_p = layout.aux
        if term == "low rank":
            factor_q = torch.zeros_like(factor_q)
        else:
            values, index = values[..., :0].contiguous(), index[..., :0].contiguous()
        right(self, type(layout)(**{**vars(layout), "aux": (values, index, factor_q, factor_p)}), *args)

    monkeypatch.setattr(KiviAttention, "_gear", dropped)
    twin = Twin("gear:bits=4,group=16,residual=16,rank=2,outliers=20", 9, 3, 64, 16, torch.float32, kernels, 2)
    with pytest.raises(AssertionError, match="not close"):
        _steps(twin)


def test_gear_kernel_rejects_bad_input(kernels):  # noqa: F811
    n, bs, kvh, d, r, c = 3, 16, 2, 64, 2, 4
    q = torch.zeros(2, 4, d)
    codes = torch.zeros(n, bs, kvh, d // 4, dtype=torch.uint8)
    k_meta, v_meta = torch.zeros(n, 1, kvh, d, dtype=torch.float16), torch.zeros(n, bs, kvh, 4, dtype=torch.float16)
    values, index = torch.zeros(2, n, kvh, 2 * c, dtype=torch.float16), torch.zeros(2, n, kvh, 2 * c, dtype=torch.int16)
    fq, fp = torch.zeros(2, n, kvh, bs, r, dtype=torch.float16), torch.zeros(2, n, kvh, d, r, dtype=torch.float16)
    exact, tables = torch.zeros(2, 32, kvh, d), torch.ones(2, 1, dtype=torch.long)
    meta = torch.tensor([[16, 0], [20, 5], [0, 1], [0, 0]])  # row 0: a block and 4 exact keys; row 1: 5 exact
    args = [codes, codes, k_meta, k_meta, v_meta, v_meta, values, index, fq, fp, exact, exact, tables, meta, 1.0]
    kernels.gear_attention(torch.empty_like(q), q, *args)  # well formed
    with pytest.raises(RuntimeError, match="int16"):
        kernels.gear_attention(torch.empty_like(q), q, *args[:7], index.int(), *args[8:])
    with pytest.raises(RuntimeError, match="factors"):
        kernels.gear_attention(torch.empty_like(q), q, *args[:8], fq[..., :1].contiguous(), *args[9:])
    with pytest.raises(RuntimeError, match="exact keys"):  # 40 exact keys, a ring of 32
        kernels.gear_attention(torch.empty_like(q), q, *args[:13], torch.tensor([[16, 0], [20, 40], [0, 1], [0, 0]]),
                               1.0)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.gear_attention(torch.empty_like(q), q, *args[:12], tables * 3, *args[13:])


def test_engine_gear_with_the_kernel_matches_the_torch_path(make_llm, native_kernels_or_skip,  # noqa: F811
                                                           monkeypatch):
    """Greedy tokens through the kernel equal the reference path's (the runner with no kernels, as
    THREEFOLD_ATTENTION=torch gives it) on SmolLM2's real weights, fp32: the same GEAR blocks (encoded
    in torch either way), only the summation order differs; a chunked, batched run in which blocks
    leave the window. Windows held at fp32, as test_kivi_kernel's engine test explains."""
    monkeypatch.setattr("threefold.worker.model_runner.window_dtype", lambda dtype: dtype)
    llm = make_llm(kv_cache_dtype="gear:group=16,residual=32", max_num_batched_tokens=24,
                   enable_prefix_caching=False)
    runner = llm.engine.core.runner
    assert runner.kernels is native_kernels_or_skip
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
    prompts = [" ".join([p] * 8) for p in PROMPTS[:2]]
    native = llm.generate(prompts, params)
    assert all(len(o.prompt_token_ids) > 32 for o in native)  # past R: blocks read compressed
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
        assert ours == pytest.approx(theirs, abs=2e-3)
