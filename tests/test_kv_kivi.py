"""KIVI: specs, the quantizer against a naive per-group reference (codes exact, error inside the
bound), and the window on hand-built states: tokens inside it exact, a token's representation
changing exactly when its block leaves, and attention equal to a reference built from those rules,
whether the tokens come one at a time or in chunks."""

from __future__ import annotations

import pytest
import torch
from window_rules import oracle_quantized_len

from threefold.errors import ThreefoldError
from threefold.kv.codecs.kivi import unpack
from threefold.kv.paged import PagedKVCache
from threefold.kv.registry import make_codec
from threefold.kv.spec import parse_kv_spec
from threefold.kv.window import ArenaShape, WindowArena, arena_share, window_slots
from threefold.worker.kivi_attention import KiviAttention, KiviRequest


# ---- specs ---------------------------------------------------------------------------------
def test_spec_defaults_and_canonical_text():
    assert str(parse_kv_spec("kivi2")) == "kivi2:group=32,residual=128"
    assert str(parse_kv_spec("KIVI4: residual = 64, group=16")) == "kivi4:group=16,residual=64"
    assert str(parse_kv_spec("kivi2:residual=0")) == "kivi2:group=32,residual=0"


@pytest.mark.parametrize("text,needle", [
    ("kivi3", "choices: auto, fp8, fp8_e4m3, fp8_e5m2, gear, int4, int8, kivi2, kivi4, tiered, turboquant"),
    ("kivi2:group=12", "out of range; group in [8, 16, 32, 64, 128]"),
    ("kivi2:residual=40", "residual=40 must be a multiple of group=32"),
    ("kivi4:residual=-8", "out of range; residual in [0, 8, ..., 1024]"),
    ("kivi2:bits=3", "unknown parameter 'bits'"),
])
def test_bad_kivi_specs_raise_with_the_choices(text, needle):
    with pytest.raises(ThreefoldError, match="kv_cache_dtype") as err:
        parse_kv_spec(text)
    assert needle in str(err.value)


def test_block_size_must_be_a_multiple_of_the_group():
    codec = make_codec("kivi2", 2, 64, torch.float32)
    with pytest.raises(ThreefoldError, match="block_size a multiple of group=32"):
        codec.allocate(4, 16, torch.device("cpu"))
    with pytest.raises(ThreefoldError, match="must divide head_dim=48"):
        make_codec("kivi2", 2, 48, torch.float32)


def test_window_slots_come_from_the_budget():
    assert window_slots(100 << 20, 10 << 20, 256) == 5
    assert window_slots(100 << 20, 1 << 20, 8) == 8
    with pytest.raises(ThreefoldError, match="cannot hold one request's full-precision window"):
        window_slots(10 << 20, 6 << 20, 256)


def test_window_share_is_planned_for_max_model_len():
    # windows of 10 MiB beside the 15 MiB of blocks one max_model_len request needs: 40% of the budget
    assert arena_share(10 << 20, 15 << 20) == 0.4 and window_slots(100 << 20, 10 << 20, 256, 15 << 20) == 4
    assert window_slots(100 << 20, 10 << 20, 256, 2 << 20) == 5  # short requests: at most half
    assert window_slots(100 << 20, 10 << 20, 256, 90 << 20) == 2  # long ones: at least a quarter


# ---- quantizer -----------------------------------------------------------------------------
def _ref_group(x, bits):
    """Naive asymmetric min/max quantization of one group (fp16 scale and zero, as stored)."""
    scale = ((x.max() - x.min()) / (2 ** bits - 1)).half().float()
    zero = x.min().half().float()
    q = torch.round((x - zero) / scale).clamp(0, 2 ** bits - 1) if scale > 0 else torch.zeros_like(x)
    return q.to(torch.uint8), q * scale + zero, scale, zero


def _data(n, bs, kvh, d, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, bs, kvh, d, generator=gen) * torch.rand(n, 1, kvh, d, generator=gen) * 4
    x[0, :, 0, 3] = 0.7          # a constant key channel / value group entry: zero range, exact
    x[0, 2, 1, 9] = 200.0        # an outlier
    return x


@pytest.mark.parametrize("spec", ["kivi2:group=16", "kivi4:group=16", "kivi2:group=32", "kivi4:group=8"])
def test_round_trip_matches_the_reference(spec):
    kvh, d, bs = 2, 32, 32
    codec = make_codec(spec, kvh, d, torch.float32)
    bits, g = codec.bits, codec.group
    storage = codec.allocate(4, bs, torch.device("cpu"))
    k, v = _data(2, bs, kvh, d, 1), _data(2, bs, kvh, d, 2)
    blocks = torch.tensor([3, 1])
    codec.encode(storage, blocks, k, v)
    k_read, v_read = codec.read_blocks(storage, blocks)
    k_read, v_read = k_read.view(2, bs, kvh, d), v_read.view(2, bs, kvh, d)
    k_codes, v_codes = unpack(storage.codes[0][blocks], bits), unpack(storage.codes[1][blocks], bits)
    for n in range(2):
        for h in range(kvh):
            for c in range(d):  # keys: per channel, groups of g tokens
                for t0 in range(0, bs, g):
                    _check(k[n, t0:t0 + g, h, c], k_codes[n, t0:t0 + g, h, c], k_read[n, t0:t0 + g, h, c], bits)
            for t in range(bs):  # values: per token, groups of g channels
                for c0 in range(0, d, g):
                    _check(v[n, t, h, c0:c0 + g], v_codes[n, t, h, c0:c0 + g], v_read[n, t, h, c0:c0 + g], bits)


def _check(x, codes, got, bits):
    ref_codes, recon, scale, zero = _ref_group(x, bits)
    assert torch.equal(codes, ref_codes)
    torch.testing.assert_close(got, recon, atol=1e-5 * x.abs().max() + 1e-30, rtol=1e-6)
    # Half a step, plus what fp16 rounding of the scale (over 2^b - 1 steps) and of the zero adds.
    bound = scale / 2 + (2 ** bits) * scale * 2 ** -11 + zero.abs() * 2 ** -11 + 1e-6
    assert ((got - x).abs() <= bound).all()


def test_bytes_per_block_counts_everything_stored():
    for spec in ["kivi2", "kivi4:group=16"]:
        codec = make_codec(spec, 3, 64, torch.bfloat16)
        storage = codec.allocate(4, 32, torch.device("cpu"))
        assert sum(t.nbytes for t in vars(storage).values()) == 4 * codec.bytes_per_block(32)
    auto = make_codec("auto", 3, 64, torch.bfloat16).bytes_per_block(32)
    # kivi2 at head_dim 64, G=32: 2 bits of code + 2 fp16 (scale, zero) per 32 values, for K and V.
    assert auto / make_codec("kivi2", 3, 64, torch.bfloat16).bytes_per_block(32) == pytest.approx(16 / 3)


# ---- the window, on hand-built states ------------------------------------------------------
KVH, D, HEADS, BS = 2, 16, 4, 8


def _setup(spec, num_blocks=12):
    codec = make_codec(spec, KVH, D, torch.float32)
    cache = PagedKVCache(codec, 1, num_blocks, BS, torch.device("cpu"))
    arena = WindowArena(ArenaShape.of([codec], BS), 1, KVH, D, torch.float32, torch.device("cpu"))
    return codec, cache, arena


def _run(cache, arena, codec, q, k, v, chunks, start=0):
    """Feed positions [start, start + len(q)) in chunks of the given sizes; return every row's output."""
    window = arena.acquire("r", start)
    blocks = torch.arange(1, cache.num_blocks)
    outs, pos = [], start
    for n in chunks:
        request = KiviRequest(0, n, pos, blocks[: -(-(pos + n) // BS)], window)
        attention = KiviAttention(cache, arena, [request], D ** -0.5, codec.residual)
        span = slice(pos - start, pos - start + n)
        outs.append(attention(0, q[span], k[span], v[span]))
        pos += n
        window.filled = pos
    return torch.cat(outs)


def _reference(codec, q, k, v, residual, start=0):
    """Row p: keys j < nq(p + 1) as quantized, the rest exact (tests/window_rules.py)."""
    n = k.shape[0]
    pad = -n % BS
    kq, vq = codec.dequantize(*codec.quantize(torch.cat([k, k[:pad]]).view(-1, BS, KVH, D),
                                              torch.cat([v, v[:pad]]).view(-1, BS, KVH, D)))
    kq, vq = kq.flatten(0, 1)[:n], vq.flatten(0, 1)[:n]
    out = torch.empty(n, HEADS, D)
    for p in range(n):
        nq = oracle_quantized_len(p + 1, residual, BS, start)
        keys = torch.cat([kq[:nq], k[nq : p + 1]]).repeat_interleave(HEADS // KVH, 1)  # [p + 1, H, d]
        values = torch.cat([vq[:nq], v[nq : p + 1]]).repeat_interleave(HEADS // KVH, 1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[p], keys) * D ** -0.5, dim=-1)
        out[p] = torch.einsum("hn,nhd->hd", weights, values)
    return out


def _qkv(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, HEADS, D, generator=gen), torch.randn(n, KVH, D, generator=gen) * 2,
            torch.randn(n, KVH, D, generator=gen))


@pytest.mark.parametrize("spec", ["kivi2:group=8,residual=16", "kivi4:group=8,residual=8", "kivi2:group=8,residual=0"])
@pytest.mark.parametrize("chunks", [[1] * 45, [20, 1, 1, 7, 16], [45]])
def test_attention_follows_the_window_rules(spec, chunks):
    codec, cache, arena = _setup(spec)
    q, k, v = _qkv(45)
    got = _run(cache, arena, codec, q, k, v, chunks)
    torch.testing.assert_close(got, _reference(codec, q, k, v, codec.residual), atol=2e-5, rtol=1e-5)


def test_tokens_inside_the_window_are_exact_and_change_when_they_leave():
    codec, cache, arena = _setup("kivi2:group=8,residual=16")
    q, k, v = _qkv(45)
    exact = _reference(codec, q, k, v, residual=10 ** 6)  # attention over exact K/V (`auto`)
    got = _run(cache, arena, codec, q, k, v, [1] * 45)
    # Rows that see at most R tokens read no quantized key: exact up to summation order.
    torch.testing.assert_close(got[:16], exact[:16], atol=1e-6, rtol=1e-6)
    assert (got[16:] - exact[16:]).abs().amax() > 1e-3  # from p + 1 = 17 on, block 0 is quantized
    assert arena.size == 16  # the ring is R tokens: never more than R are exact
    ring = arena.ring[0, :, 0]  # the window holds the last R positions bit for bit
    slots = torch.arange(45 - arena.size, 45) % arena.size
    assert torch.equal(ring[0][slots], k[45 - arena.size:]) and torch.equal(ring[1][slots], v[45 - arena.size:])
    # A token is read exact while inside the window and quantized from the step it leaves:
    # position 3 (block 0) is exact at n = 16 and quantized at n = 17.
    before = _run(*_setup("kivi2:group=8,residual=16")[1:], codec, q[:16], k[:16], v[:16], [16])
    torch.testing.assert_close(before[-1], _reference(codec, q[:16], k[:16], v[:16], 10 ** 6)[-1],
                               atol=1e-6, rtol=1e-6)
    after = _run(*_setup("kivi2:group=8,residual=16")[1:], codec, q[:17], k[:17], v[:17], [17])
    assert (after[-1] - _reference(codec, q[:17], k[:17], v[:17], 10 ** 6)[-1]).abs().amax() > 1e-3


def test_a_prefix_hit_starts_with_its_tokens_quantized():
    codec, cache, arena = _setup("kivi4:group=8,residual=16")
    q, k, v = _qkv(40, seed=3)
    _run(cache, arena, codec, q, k, v, [24])  # blocks 1..3 now hold positions 0..23, encoded
    arena.release("r")
    got = _run(cache, arena, codec, q[16:], k[16:], v[16:], [10, 1, 1, 1, 1], start=16)
    ref = _reference(codec, q, k, v, codec.residual, start=16)[16:30]
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def test_capacity_rows_set_the_windows_aside():
    from types import SimpleNamespace

    from threefold.kv.capacity import capacity_rows

    config = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    row = capacity_rows(config, 256 << 20, codecs=("kivi2",))[0]
    window = 30 * 2 * 128 * 3 * 64 * 2  # R tokens of bf16 K and V, every layer
    assert row["kv_cache_dtype"] == "kivi2:group=32,residual=128" and row["window_bytes_per_seq"] == window
    assert row["max_num_seqs"] == (128 << 20) // window
    # 2-bit K and V codes, fp16 scale + zero per 32 tokens of a key channel and per 32 channels of a value
    assert row["bytes_per_token"] == 30 * (2 * 3 * 64 * 2 / 8 + 3 * 64 * 4 / 32 + 3 * 2 * 4) == 4320
    assert row["capacity_tokens"] == ((256 << 20) - row["max_num_seqs"] * window) // (32 * 4320) * 32
    # planned for 2k-token requests (blocks of 2048 * 4320 bytes beside each window): fewer windows,
    # more blocks, and every window has the blocks of one such request
    row = capacity_rows(config, 256 << 20, codecs=("kivi2",), max_model_len=2048)[0]
    assert row["max_num_seqs"] == int((256 << 20) * window / (window + 2048 * 4320)) // window == 22
    assert row["capacity_tokens"] // 2048 >= row["max_num_seqs"]
