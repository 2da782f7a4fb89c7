"""kernels/kivi_prefill.cpp: the tiled prefill kernel (kivi_prefill_attention) against KiviAttention's
plain-torch reference path and against attention built from the window rules (chunked = unchunked =
decoded), and kivi_encode against the torch quantizer, bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.test_kivi_kernel import Twin, kernels  # noqa: F401  # kernels: the fixture (each build)
from tests.test_kv_kivi import _qkv, _reference
from threefold.kv.codecs.tiered import TieredCodec
from threefold.kv.paged import PagedKVCache
from threefold.kv.registry import make_codec
from threefold.kv.window import ArenaShape, WindowArena
from threefold.worker.kivi_attention import KiviAttention, KiviRequest

SHAPES = [
    ("kivi2:group=16,residual=16", 9, 3, 64, 16),    # SmolLM2's grouping
    ("kivi4:group=16,residual=32", 14, 2, 64, 32),   # Qwen2.5-0.5B's grouping, 2 key groups per block
    ("kivi2:group=32,residual=32", 4, 4, 128, 32),   # no GQA, head_dim 128
    ("kivi4:group=8,residual=8", 6, 2, 48, 16),      # a head_dim with no specialization
    ("tiered:group=16,residual=16,middle=32,sink=4", 9, 3, 64, 16),
    ("tiered:group=8,residual=8,middle=16,sink=3", 6, 2, 48, 16),
]


def _chunks(twin: Twin) -> None:
    """Chunks that start mid-block and straddle the window boundary, longer than the ring (R + B) and
    than a tile of rows, beside decodes; then a prefix hit (request 1 restarts at a block boundary)."""
    twin.step([(0, 0, 45)])
    twin.step([(0, 45, 37), (1, 0, 7)])
    twin.step([(0, 82, 1), (1, 7, 100)])
    twin.step([(0, 83, 60), (1, 107, 1)])
    hit = 2 * twin.bs
    for arena, windows in zip(twin.arenas, twin.windows, strict=True):
        arena.release("1")
        windows[1] = arena.acquire("hit", hit)  # blocks 0..1 hold request 1's encoded positions
    twin.step([(1, hit, 50), (0, 143, 1)])


@pytest.mark.parametrize("dtype,ring_dtype", [(torch.float32, None), (torch.bfloat16, None)])
@pytest.mark.parametrize("spec,heads,kvh,d,bs", SHAPES)
def test_prefill_kernel_matches_reference(kernels, dtype, ring_dtype, spec, heads, kvh, d, bs):  # noqa: F811
    twin = Twin(spec, heads, kvh, d, bs, dtype, kernels, 2, ring_dtype)
    _chunks(twin)
    assert twin.windows[1][1].start == 2 * bs and twin.windows[1][1].filled == 2 * bs + 50


@pytest.mark.parametrize("field,spec", [(0, "kivi2:group=16,residual=16"),  # nq: the window's edge
                                        (0, "tiered:group=16,residual=16,middle=32,sink=4"),
                                        (1, "tiered:group=16,residual=16,middle=32,sink=4"),  # nm: the band's
                                        (2, "tiered:group=16,residual=16,middle=32,sink=4")])  # ns: the sinks
def test_a_wrong_mask_is_caught(kernels, monkeypatch, field, spec):  # noqa: F811
    """The comparison above is sharp: a block more read quantized (nq) or at 2 bits (nm), or two sinks
    fewer (ns), fails it (or, where the band ring no longer covers the rows, the kernel's own check)."""
    right = KiviAttention._prefill_meta

    def moved(self, i, residual, tiered):
        meta = right(self, i, residual, tiered).clone()
        meta[field] = (meta[field] - 2).clamp(min=0) if field == 2 else meta[field] + self.block_size
        return meta

    monkeypatch.setattr(KiviAttention, "_prefill_meta", moved)
    twin = Twin(spec, 9, 3, 64, 16, torch.float32, kernels, 2)
    with pytest.raises((AssertionError, RuntimeError), match=r"not close|lie outside sinks / band"):
        _chunks(twin)


@pytest.mark.parametrize("chunks", [[20, 1, 1, 7, 16], [45], [3, 42]])
@pytest.mark.parametrize("spec", ["kivi2:group=8,residual=16", "kivi4:group=8,residual=8"])
def test_kernel_follows_the_window_rules(kernels, spec, chunks):  # noqa: F811
    """Through the kernels, chunked = unchunked = decoded: every row equals attention over keys
    < nq(p + 1) quantized and the rest exact (test_kv_kivi's reference)."""
    kvh, d, bs = 2, 16, 8
    codec = make_codec(spec, kvh, d, torch.float32)
    cache = PagedKVCache(codec, 1, 12, bs, torch.device("cpu"))
    arena = WindowArena(ArenaShape.of([codec], bs), 1, kvh, d, torch.float32, torch.device("cpu"))
    q, k, v = _qkv(45)
    window, blocks, outs, pos = arena.acquire("r", 0), torch.arange(1, 12), [], 0
    for n in chunks:
        request = KiviRequest(0, n, pos, blocks[: -(-(pos + n) // bs)], window)
        outs.append(KiviAttention(cache, arena, [request], d ** -0.5, kernels=kernels)(
            0, q[pos:pos + n], k[pos:pos + n], v[pos:pos + n]))
        pos += n
        window.filled = pos
    torch.testing.assert_close(torch.cat(outs), _reference(codec, q, k, v, codec.residual), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec,kvh,d,bs", [("kivi2:group=16", 3, 64, 32), ("kivi4:group=32", 2, 128, 32),
                                           ("kivi4:group=8", 2, 48, 16),
                                           ("tiered:group=8,residual=8,middle=16,sink=3", 2, 48, 16)])
def test_encode_matches_the_torch_quantizer_bit_for_bit(kernels, dtype, spec, kvh, d, bs):  # noqa: F811
    """Codes, scales and zeros (tiered: and the low planes) equal codec.encode's, with constant groups,
    an outlier and many exact halves (round half to even) among random blocks."""
    codec = make_codec(spec, kvh, d, torch.float32)
    gen, n = torch.Generator().manual_seed(1), 12
    k = torch.randn(n, bs, kvh, d, generator=gen) * torch.rand(n, 1, kvh, d, generator=gen) * 4
    v = torch.randn(n, bs, kvh, d, generator=gen) * 3
    k[0, :, 0, 3], v[1, 2, 1, :], k[2, 3, 1, 5] = 0.7, -1.25, 300.0
    k[3] = torch.randint(-8, 8, k[3].shape, generator=gen) / 4  # exact halves of a step: round half to even
    v[3] = torch.randint(-8, 8, v[3].shape, generator=gen) / 4
    k, v = k.to(dtype), v.to(dtype)
    ids = torch.randperm(n, generator=gen) + 2
    torch_cache, native_cache = (PagedKVCache(codec, 1, n + 3, bs, torch.device("cpu")) for _ in range(2))
    low = codec.encode(torch_cache.layers[0], ids, k, v)
    layout = native_cache.layout(0)
    tiered = isinstance(codec, TieredCodec)
    native_low = torch.zeros(2, n, bs, kvh, d // 4, dtype=torch.uint8) if tiered else torch.empty(0, dtype=torch.uint8)
    kernels.kivi_encode(layout.k, layout.v, layout.k_scales, layout.k_zeros, layout.v_scales, layout.v_zeros, ids, k,
                        v, 4 if tiered else codec.bits, native_low)
    for name in ("codes", "k_scales", "k_zeros", "v_scales", "v_zeros"):
        assert torch.equal(getattr(native_cache.layers[0], name), getattr(torch_cache.layers[0], name)), name
    if tiered:
        assert torch.equal(native_low[0], low[0]) and torch.equal(native_low[1], low[1])


def test_prefill_kernel_rejects_bad_input(kernels):  # noqa: F811
    q = torch.zeros(4, 4, 64)
    codes = torch.zeros(3, 16, 2, 16, dtype=torch.uint8)
    k_meta, v_meta = torch.zeros(3, 1, 2, 64, dtype=torch.float16), torch.zeros(3, 16, 2, 4, dtype=torch.float16)
    exact, table, none = torch.zeros(4, 2, 64), torch.ones(1, dtype=torch.long), torch.empty(0, dtype=torch.uint8)
    meta = torch.zeros(3, 4, dtype=torch.long)
    args = [codes, codes, k_meta, k_meta, v_meta, v_meta, exact, exact, 0, table, meta, 0, none, 0, none, False, 1.0]
    kernels.kivi_prefill_attention(torch.empty_like(q), q, *args)  # well formed: 4 exact rows
    with pytest.raises(RuntimeError, match="exact keys"):  # a row past the exact K/V given
        kernels.kivi_prefill_attention(torch.empty_like(q), q, *args[:11], 1, *args[12:])
    with pytest.raises(RuntimeError, match="int64"):
        kernels.kivi_prefill_attention(torch.empty_like(q), q, *args[:10], meta.int(), *args[11:])
    with pytest.raises(RuntimeError, match="fine must be"):
        kernels.kivi_encode(codes, codes, k_meta, k_meta, v_meta, v_meta, torch.zeros(1, dtype=torch.long),
                            torch.zeros(1, 16, 2, 64), torch.zeros(1, 16, 2, 64), 3, none)
