"""`tiered` (recency-tiered precision): specs and their errors, the bit-plane split against a naive
4-bit quantizer written here (codes exact, far and middle reads inside their bounds), bytes counted
(blocks and the per-request band and sinks), the age rules through KiviAttention against a per-row
reference (decoding one token at a time and in chunks, both paths), and the engine."""

from __future__ import annotations

import pytest
import torch
from window_rules import oracle_quantized_len

from threefold.errors import ThreefoldError
from threefold.kv.codecs.kivi import unpack
from threefold.kv.guard import parse_guard
from threefold.kv.mix import parse_mix
from threefold.kv.paged import PagedKVCache
from threefold.kv.registry import make_codec
from threefold.kv.spec import parse_kv_spec
from threefold.kv.window import ArenaShape, WindowArena
from threefold.sample.params import SamplingParams
from threefold.worker.kivi_attention import KiviAttention, KiviRequest

from prompts import PROMPTS


def test_spec_defaults_and_canonical_text():
    assert str(parse_kv_spec("tiered")) == "tiered:group=32,residual=128,middle=512,sink=4"
    assert str(parse_kv_spec("tiered:sink=0,middle=64")) == "tiered:group=32,residual=128,middle=64,sink=0"


@pytest.mark.parametrize("text,needle", [
    ("tiered:middle=40", "multiple of group=32"),
    ("tiered:sink=40", "sink=40 is out of range"),
    ("tiered:bits=4", "unknown parameter 'bits'"),
    ("mix:tiered@0-1;kivi2@2", "cannot share a cache"),
])
def test_bad_tiered_specs_raise_with_the_choices(text, needle):
    with pytest.raises(ThreefoldError, match=needle):
        parse_mix(text) if text.startswith("mix:") else parse_kv_spec(text)


def test_the_guard_and_block_geometry_refuse_what_tiered_cannot_do():
    with pytest.raises(ThreefoldError, match="cannot be mixed"):
        parse_guard("guard:tiered")
    codec = make_codec("tiered:group=16,middle=48", 2, 32, torch.float32)
    with pytest.raises(ThreefoldError, match="middle=48 a multiple of block_size=32"):
        codec.check_block_size(32)
    with pytest.raises(ThreefoldError, match="sink=20 at most block_size=16"):
        make_codec("tiered:group=16,sink=20", 2, 32, torch.float32).check_block_size(16)


# ---- the split -------------------------------------------------------------------------------
def _ref_group(x):
    """Naive 4-bit min/max quantization of one group, then its planes and both reads (fp32 maths,
    fp16 stored scale and zero, as the codec stores them)."""
    s = ((x.max() - x.min()) / 15).half().float()
    z = x.min().half().float()
    q = torch.round((x - z) / s).clamp(0, 15) if s > 0 else torch.zeros_like(x)
    scale, zero = (s * 4).half().float(), (z + 1.5 * s).half().float()
    hi, lo = q.to(torch.uint8) >> 2, q.to(torch.uint8) & 3
    far = zero + scale * hi
    middle = zero + scale * (hi + lo / 4 - 0.375)
    return hi, lo, far, middle, s, z


@pytest.mark.parametrize("spec", ["tiered:group=16", "tiered:group=8"])
def test_split_matches_the_reference_and_reads_within_the_bounds(spec):
    kvh, d, bs = 2, 32, 32
    codec = make_codec(spec, kvh, d, torch.float32)
    g = codec.group
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(2, bs, kvh, d, generator=gen) * torch.rand(2, 1, kvh, d, generator=gen) * 4 for _ in range(2))
    k[0, :, 0, 3] = 0.7  # a constant channel: exact at every age
    v[1, 5, 1, 9] = 200.0  # an outlier
    storage = codec.allocate(4, bs, torch.device("cpu"))
    blocks = torch.tensor([3, 1])
    k_low, v_low = codec.encode(storage, blocks, k, v)
    k_far, v_far = codec.read_blocks(storage, blocks)
    k_mid, v_mid = codec.refine(k_far, v_far, storage, blocks, k_low.flatten(0, 1), v_low.flatten(0, 1))
    shape = (2, bs, kvh, d)
    got = {"k": (unpack(storage.codes[0][blocks], 2), unpack(k_low, 2), k_far.view(shape), k_mid.view(shape)),
           "v": (unpack(storage.codes[1][blocks], 2), unpack(v_low, 2), v_far.view(shape), v_mid.view(shape))}
    groups = [("k", (n, slice(t, t + g), h, c)) for n in range(2) for h in range(kvh) for c in range(d)
              for t in range(0, bs, g)] + \
             [("v", (n, t, h, slice(c, c + g))) for n in range(2) for h in range(kvh) for t in range(bs)
              for c in range(0, d, g)]
    for side, index in groups:
        x = (k if side == "k" else v)[index]
        hi, lo, far, middle, s, z = _ref_group(x)
        hi_got, lo_got, far_got, mid_got = (t[index] for t in got[side])
        assert torch.equal(hi_got, hi) and torch.equal(lo_got, lo)
        torch.testing.assert_close(far_got, far, atol=1e-5 * x.abs().max() + 1e-30, rtol=1e-6)
        torch.testing.assert_close(mid_got, middle, atol=1e-5 * x.abs().max() + 1e-30, rtol=1e-6)
        rounding = 16 * s * 2 ** -11 + z.abs() * 2 ** -10 + 1e-6  # fp16 scale (15 steps) and zero (twice)
        assert ((mid_got - x).abs() <= s / 2 + rounding).all()  # a 4-bit read
        assert ((far_got - x).abs() <= 2 * s + rounding).all()  # the centre of 4 fine cells
    assert torch.equal(k_far.view(shape)[0, :, 0, 3], k[0, :, 0, 3].half().float())  # as its fp16 zero


def test_bytes_counted_for_blocks_band_and_sinks():
    codec = make_codec("tiered", 3, 64, torch.bfloat16)
    assert codec.bytes_per_block(32) == make_codec("kivi2", 3, 64, torch.bfloat16).bytes_per_block(32)
    storage = codec.allocate(4, 32, torch.device("cpu"))
    assert sum(t.nbytes for t in vars(storage).values()) == 4 * codec.bytes_per_block(32)
    shape = ArenaShape.of([codec] * 30, 32)
    assert (shape.layers, shape.size, shape.band, shape.sink) == (30, 128, 640, 4)
    arena = WindowArena(shape, 2, 3, 64, torch.bfloat16, torch.device("cpu"))
    stored = arena.ring.nbytes + arena.band.nbytes + arena.sinks.nbytes
    assert stored == 2 * shape.bytes_per_slot(3, 64, torch.bfloat16)
    # per layer and request: a kivi2 window (128 bf16 tokens) + 640 tokens' low planes + 4 sinks, K and V
    assert shape.bytes_per_slot(3, 64, torch.bfloat16) == 30 * 2 * 3 * ((128 + 4) * 64 * 2 + 640 * 16)


def test_capacity_rows_set_the_band_and_sinks_aside():
    from types import SimpleNamespace

    from threefold.kv.capacity import capacity_rows

    config = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    kivi2, tiered = capacity_rows(config, 256 << 20, codecs=("kivi2", "tiered"), max_model_len=4096)
    assert tiered["bytes_per_token"] == kivi2["bytes_per_token"] == 4320  # the blocks are kivi2 blocks
    assert tiered["window_bytes_per_seq"] == kivi2["window_bytes_per_seq"] + 30 * 2 * 3 * (4 * 64 * 2 + 640 * 16)
    assert tiered["max_num_seqs"] < kivi2["max_num_seqs"]  # the band's bytes bound how many run at once
    # its window is under a quarter of one 4k request's blocks: the arena gets its floor share (kv/window.py)
    window, plan = tiered["window_bytes_per_seq"], 4096 * 4320
    assert window / (window + plan) < 0.25 and tiered["max_num_seqs"] == (64 << 20) // window
    assert tiered["capacity_tokens"] == ((256 << 20) - tiered["max_num_seqs"] * window) // (32 * 4320) * 32


# ---- the age rules -----------------------------------------------------------------------------
def _reference(codec, q, k, v, bs, start=0):
    """Row p of a sequence read token by token: keys at nq (tests/window_rules.py) and above
    exact; [nm, nq) at 4 bits (nm = max(start, nq - M)); below nm 2 bits; the first S exact when
    start = 0 (once quantized). Blocks quantized whole, one at a time, as `_ref_group` does."""
    n, kvh, d = k.shape
    full = n // bs * bs
    blocks = (-1, bs, kvh, d)
    storage = codec.allocate(full // bs + 1, bs, torch.device("cpu"))
    ids = torch.arange(1, full // bs + 1)
    k_low, v_low = codec.encode(storage, ids, k[:full].reshape(blocks), v[:full].reshape(blocks))
    k_far, v_far = codec.read_blocks(storage, ids)
    k_mid, v_mid = codec.refine(k_far, v_far, storage, ids, k_low.flatten(0, 1), v_low.flatten(0, 1))
    out = []
    for p in range(n):
        nq = oracle_quantized_len(p + 1, codec.residual, bs, start)
        nm = max(start, nq - codec.middle)
        sinks = min(codec.sink if start == 0 else 0, nq)
        keys = torch.cat([k[:sinks], k_far[sinks:nm], k_mid[max(nm, sinks):nq], k[nq:p + 1]])
        values = torch.cat([v[:sinks], v_far[sinks:nm], v_mid[max(nm, sinks):nq], v[nq:p + 1]])
        group = q.shape[1] // kvh
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[p], keys.repeat_interleave(group, 1)) * d ** -0.5, -1)
        out.append(torch.einsum("hn,nhd->hd", weights, values.repeat_interleave(group, 1)))
    return torch.stack(out)


@pytest.mark.parametrize("chunks", [[1] * 90, [37, 1, 1, 20, 31], [90]])
def test_attention_follows_the_age_rules(chunks):
    """Small tiers (window 8 + 8, band 16, sinks 3) so 90 tokens cross every boundary and the band
    ring (32 tokens) wraps; a chunk longer than the band reads the planes it overwrote."""
    kvh, d, heads, bs = 2, 16, 4, 8
    codec = make_codec("tiered:group=8,residual=8,middle=16,sink=3", kvh, d, torch.float32)
    cache = PagedKVCache(codec, 1, 14, bs, torch.device("cpu"))
    arena = WindowArena(ArenaShape.of([codec], bs), 1, kvh, d, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    n = sum(chunks)
    q, k, v = torch.randn(n, heads, d, generator=gen), torch.randn(n, kvh, d, generator=gen), \
        torch.randn(n, kvh, d, generator=gen)
    window, blocks, outs, pos = arena.acquire("r", 0), torch.arange(1, 13), [], 0
    for size in chunks:
        request = KiviRequest(0, size, pos, blocks[: -(-(pos + size) // bs)], window)
        span = slice(pos, pos + size)
        outs.append(KiviAttention(cache, arena, [request], d ** -0.5)(0, q[span], k[span], v[span]))
        pos += size
        window.filled = pos
    torch.testing.assert_close(torch.cat(outs), _reference(codec, q, k, v, bs), atol=3e-5, rtol=1e-5)


def test_a_prefix_hit_reads_its_tokens_and_sinks_at_two_bits():
    kvh, d, heads, bs = 1, 16, 2, 8
    codec = make_codec("tiered:group=8,residual=8,middle=8,sink=2", kvh, d, torch.float32)
    cache = PagedKVCache(codec, 1, 10, bs, torch.device("cpu"))
    arena = WindowArena(ArenaShape.of([codec], bs), 2, kvh, d, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    n, hit = 48, 16
    q, k, v = torch.randn(n, heads, d, generator=gen), torch.randn(n, kvh, d, generator=gen), \
        torch.randn(n, kvh, d, generator=gen)
    blocks = torch.arange(1, 7)
    first = arena.acquire("a", 0)  # computes the prefix, which the second request then hits
    KiviAttention(cache, arena, [KiviRequest(0, hit, 0, blocks[:2], first)], d ** -0.5)(0, q[:hit], k[:hit], v[:hit])
    second = arena.acquire("b", hit)
    request = KiviRequest(0, n - hit, hit, blocks, second)
    got = KiviAttention(cache, arena, [request], d ** -0.5)(0, q[hit:], k[hit:], v[hit:])
    torch.testing.assert_close(got, _reference(codec, q, k, v, bs, start=hit)[hit:], atol=3e-5, rtol=1e-5)


# ---- the engine ------------------------------------------------------------------------------
TIERED = "tiered:group=16,residual=16,middle=16,sink=4"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_engine_batch_invariance_prefix_hits_and_everything_given_back(make_llm):
    prompts = [" ".join([p] * 6) for p in PROMPTS[:3]]  # 30-60 tokens: blocks reach the 2-bit tier mid-run
    solo_llm = make_llm(enable_prefix_caching=False, kv_cache_dtype=TIERED)
    solo = [solo_llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    llm = make_llm(kv_cache_dtype=TIERED, max_num_batched_tokens=24)  # batched, and chunked
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert sum(a[:4] == b[:4] for a, b in zip(solo, batched, strict=True)) >= 2, (solo, batched)
    assert sum(a == b for a, b in zip(solo, batched, strict=True)) >= 2, (solo, batched)
    again = llm.generate(prompts[:1], GREEDY)[0]  # a prefix hit (its tokens read at 2 bits: close, not equal)
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids[:2] == solo[0][:2]
    core = llm.engine.core
    assert core.cache_info["kv_cache_dtype"] == TIERED
    assert core.cache_info["bytes_per_token"] == core.runner.bytes_per_block() / 16
    assert llm.engine.get_stats().kv_cache_usage == 0.0
    core.step()  # the runner hears of the last finished requests on the next step
    assert core.kv.req_to_blocks == {} and core.runner.windows.windows == {}
