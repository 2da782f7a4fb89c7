"""GEAR: specs, the compressor against a plain-torch reference written here (outlier sets and KIVI
codes exact, the power iteration equal, outliers read back exact, the error inside the bounds),
bytes counted, the window rules through KiviAttention, and the engine (batch invariance, every
block and window given back)."""

from __future__ import annotations

import pytest
import torch
from window_rules import oracle_quantized_len

from threefold.errors import ThreefoldError
from threefold.kv.codecs.kivi import unpack
from threefold.kv.paged import PagedKVCache
from threefold.kv.registry import make_codec
from threefold.kv.spec import parse_kv_spec
from threefold.kv.window import ArenaShape, WindowArena
from threefold.sample.params import SamplingParams
from threefold.worker.kivi_attention import KiviAttention, KiviRequest

from prompts import PROMPTS


def test_spec_defaults_and_canonical_text():
    assert str(parse_kv_spec("gear")) == "gear:bits=2,group=32,residual=128,rank=2,outliers=20,loop=3"
    assert str(parse_kv_spec("GEAR:bits=4,rank=4,outliers=0")) == \
        "gear:bits=4,group=32,residual=128,rank=4,outliers=0,loop=3"


@pytest.mark.parametrize("text,needle", [
    ("gear:bits=3", "bits=3 is out of range; bits in [2, 4]"),
    ("gear:outliers=0.02", "outliers='0.02' is not an integer; outliers in [0, 1, ..., 100] (outliers kept"),
    ("gear:rank=17", "rank=17 is out of range; rank in [0, 1, ..., 16]"),
    ("gear:residual=40", "residual=40 must be a multiple of group=32"),
    ("gear:loop=0", "loop=0 is out of range"),
    ("gears", "choices: auto, fp8, fp8_e4m3, fp8_e5m2, gear, int4, int8, kivi2, kivi4, tiered, turboquant"),
])
def test_bad_gear_specs_raise_with_the_choices(text, needle):
    with pytest.raises(ThreefoldError, match="kv_cache_dtype") as err:
        parse_kv_spec(text)
    assert needle in str(err.value)


def test_block_geometry_is_checked():
    with pytest.raises(ThreefoldError, match="rank <= min"):
        make_codec("gear:group=8,residual=8,rank=16", 2, 16, torch.float32).check_block_size(8)
    with pytest.raises(ThreefoldError, match="int16 outlier indices"):
        make_codec("gear", 2, 128, torch.float32).check_block_size(512)


# ---- the compressor against a reference ------------------------------------------------------
def _ref_power_iteration(r, p0, loop):
    p = p0.clone()
    for i in range(loop):
        if i == loop - 1:
            p = torch.linalg.qr(p).Q
        q = r @ p
        if i == loop - 1:
            q = torch.linalg.qr(q).Q
        p = r.T @ q
    return q, p


def _ref_block_head(x, bits, g, c, per_channel):
    """One block-head's matrix x [bs, d]: outlier indices (set), codes [bs, d], D [bs, d] (fp32)."""
    flat = x.flatten()
    order = flat.argsort()
    outliers = set(order[:c].tolist()) | set(order[len(flat) - c:].tolist())
    keep = torch.ones(len(flat), dtype=torch.bool)
    keep[list(outliers)] = False
    keep = keep.view(x.shape)
    codes, dq = torch.zeros(x.shape, dtype=torch.uint8), torch.zeros(x.shape)
    groups = ([(slice(t, t + g), ch) for t in range(0, x.shape[0], g) for ch in range(x.shape[1])] if per_channel
              else [(t, slice(ch, ch + g)) for t in range(x.shape[0]) for ch in range(0, x.shape[1], g)])
    for rows, cols in groups:
        values, kept = x[rows, cols], keep[rows, cols]
        low = values[kept].min() if kept.any() else torch.tensor(0.0)
        high = values[kept].max() if kept.any() else torch.tensor(0.0)
        scale, zero = ((high - low) / (2 ** bits - 1)).half().float(), low.half().float()
        stand_in = torch.where(kept, values, low)
        q = torch.round((stand_in - zero) / (scale if scale > 0 else 1)).clamp(0, 2 ** bits - 1)
        codes[rows, cols], dq[rows, cols] = q.to(torch.uint8), q * scale + zero
    return outliers, codes, dq, keep


@pytest.mark.parametrize("spec", ["gear:group=16", "gear:bits=4,group=16,rank=4,outliers=40", "gear:group=8,rank=0"])
def test_compress_matches_the_reference(spec):
    kvh, d, bs = 2, 32, 32
    codec = make_codec(spec, kvh, d, torch.float32)
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(2, bs, kvh, d, generator=gen) * torch.rand(1, 1, kvh, d, generator=gen) * 4
    v = torch.randn(2, bs, kvh, d, generator=gen)
    k[0, 3, 1, 7], v[1, 9, 0, 2] = 60.0, -40.0  # outliers
    storage = codec.allocate(4, bs, torch.device("cpu"))
    blocks = torch.tensor([3, 1])
    codec.encode(storage, blocks, k, v)
    k_read, v_read = (t.view(2, bs, kvh, d) for t in codec.read_blocks(storage, blocks))
    c = codec.num_outliers(bs)
    for kind, x, read in ((0, k, k_read), (1, v, v_read)):
        codes = unpack(storage.codes[kind][blocks], codec.bits)
        for n in range(2):
            for h in range(kvh):
                outliers, ref_codes, dq, keep = _ref_block_head(x[n, :, h], codec.bits, codec.group, c, kind == 0)
                index = storage.outlier_index[kind, blocks[n], h].long()
                assert set(index.tolist()) == outliers and len(outliers) == 2 * c
                assert torch.equal(codes[n, :, h], ref_codes)
                got = read[n, :, h]
                # outliers read back exact (fp16 values, as stored)
                assert torch.equal(got.flatten()[index], x[n, :, h].flatten()[index].half().float())
                residual = torch.where(keep, x[n, :, h] - dq, 0)
                if codec.rank:
                    q, p = _ref_power_iteration(residual, codec.p0, codec.loop)
                    low_rank = q.half().float() @ p.half().float().T
                    torch.testing.assert_close(storage.factor_q[kind, blocks[n], h].float() @
                                               storage.factor_p[kind, blocks[n], h].float().T, low_rank,
                                               atol=2e-3, rtol=1e-2)
                else:
                    low_rank = torch.zeros_like(residual)
                torch.testing.assert_close(got[keep], (dq + low_rank)[keep], atol=2e-3, rtol=1e-3)
                # the residual term only helps: Q is orthonormal and P = R^T Q, so ||R - Q P^T|| <= ||R||
                # (plus the fp16 rounding of the factors)
                error = (got - x[n, :, h])[keep]
                assert error.norm() <= residual.norm() * (1 + 1e-2) + 1e-3
                if codec.rank:
                    assert error.norm() < residual.norm() * 0.95


def test_power_iteration_recovers_a_low_rank_residual():
    """A residual of rank r is found exactly (up to fp32), whatever the fixed start; rank r - 1 keeps
    the best rank-(r - 1) part of it (the truncated SVD's error, within 1%)."""
    gen = torch.Generator().manual_seed(0)
    residual = torch.randn(3, 32, 2, generator=gen) @ torch.randn(3, 2, 64, generator=gen)  # [3, bs, d], rank 2
    q, p = make_codec("gear:rank=2", 1, 64, torch.float32).low_rank(residual)
    torch.testing.assert_close(q @ p.transpose(-1, -2), residual, atol=1e-4, rtol=1e-4)
    q, p = make_codec("gear:rank=1,loop=6", 1, 64, torch.float32).low_rank(residual)
    singular = torch.linalg.svdvals(residual)
    error = (residual - q @ p.transpose(-1, -2)).norm(dim=(-2, -1))
    torch.testing.assert_close(error, singular[:, 1], rtol=1e-2, atol=1e-4)


def test_bytes_per_block_counts_everything_stored():
    for spec in ["gear", "gear:bits=4,group=16,rank=4,outliers=10", "gear:rank=0,outliers=0"]:
        codec = make_codec(spec, 3, 64, torch.bfloat16)
        storage = codec.allocate(4, 32, torch.device("cpu"))
        assert sum(t.nbytes for t in vars(storage).values()) == 4 * codec.bytes_per_block(32)
    kivi2 = make_codec("kivi2", 3, 64, torch.bfloat16).bytes_per_block(32)
    # + per K/V and head: 40 outliers (2% of 32 x 64) at 4 bytes, Q [32, 2] and P [64, 2] in fp16
    assert make_codec("gear", 3, 64, torch.bfloat16).bytes_per_block(32) == kivi2 + 2 * 3 * (40 * 4 + 96 * 2 * 2)
    assert make_codec("gear:rank=0,outliers=0", 3, 64, torch.bfloat16).bytes_per_block(32) == kivi2


# ---- the window ------------------------------------------------------------------------------
def test_window_tokens_are_exact_and_blocks_read_as_compressed():
    kvh, d, heads, bs = 2, 16, 4, 8
    codec = make_codec("gear:group=8,residual=16,rank=2,outliers=40", kvh, d, torch.float32)
    cache = PagedKVCache(codec, 1, 8, bs, torch.device("cpu"))
    arena = WindowArena(ArenaShape.of([codec], bs), 1, kvh, d, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    n = 40
    q, k, v = torch.randn(n, heads, d, generator=gen), torch.randn(n, kvh, d, generator=gen), \
        torch.randn(n, kvh, d, generator=gen)
    window, blocks, outs = arena.acquire("r", 0), torch.arange(1, 8), []
    for pos in range(n):  # one token at a time, as decoding
        request = KiviRequest(0, 1, pos, blocks[: pos // bs + 1], window)
        outs.append(KiviAttention(cache, arena, [request], d ** -0.5, codec.residual)(
            0, q[pos:pos + 1], k[pos:pos + 1], v[pos:pos + 1]))
        window.filled = pos + 1
    got = torch.cat(outs)
    parts = [codec.decompress(*codec.compress(k[b:b + bs].unsqueeze(0), v[b:b + bs].unsqueeze(0)))
             for b in range(0, 32, bs)]  # one block at a time, as they fill
    kc, vc = torch.cat([p[0][0] for p in parts]), torch.cat([p[1][0] for p in parts])
    for p in range(n):
        nq = oracle_quantized_len(p + 1, codec.residual, bs)  # KIVI's rule: at most R tokens stay exact
        keys = torch.cat([kc[:nq], k[nq:p + 1]]).repeat_interleave(2, 1)
        values = torch.cat([vc[:nq], v[nq:p + 1]]).repeat_interleave(2, 1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[p], keys) * d ** -0.5, -1)
        torch.testing.assert_close(got[p], torch.einsum("hn,nhd->hd", weights, values), atol=2e-5, rtol=1e-5)
    assert not torch.equal(kc[:8], k[:8])  # the compressed blocks did differ from exact


# ---- the engine ------------------------------------------------------------------------------
GEAR = "gear:group=16,residual=16"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_engine_batch_invariance_and_everything_given_back(make_llm):
    prompts = [" ".join([p] * 4) for p in PROMPTS[:3]]  # 20-40 tokens: blocks leave the window mid-run
    solo_llm = make_llm(enable_prefix_caching=False, kv_cache_dtype=GEAR)
    solo = [solo_llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    llm = make_llm(kv_cache_dtype=GEAR, max_num_batched_tokens=24)  # batched, and chunked
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert sum(a[:4] == b[:4] for a, b in zip(solo, batched, strict=True)) >= 2, (solo, batched)
    assert sum(a == b for a, b in zip(solo, batched, strict=True)) >= 2, (solo, batched)
    core = llm.engine.core
    assert "gear:bits=2" in core.cache_info["kv_cache_dtype"]
    assert core.cache_info["bytes_per_token"] == core.runner.bytes_per_block() / 16
    assert llm.engine.get_stats().kv_cache_usage == 0.0
    core.step()  # the runner hears of the last finished requests on the next step
    assert core.kv.req_to_blocks == {} and core.runner.windows.windows == {}
