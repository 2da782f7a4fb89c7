"""KV codecs: spec strings, round trips against naive per-row reference quantizers (codes
exact, error inside the format's bound), bytes per block, and the prefix-hash seed."""

from __future__ import annotations

import pytest
import torch

from threefold.config import CacheConfig
from threefold.core.hashing import seed_hash
from threefold.errors import ThreefoldError
from threefold.kv.quant import unpack_int4
from threefold.kv.registry import CODECS, make_codec
from threefold.kv.spec import ALIASES, SCHEMAS, parse_kv_spec, split_spec_list

CODEC_SPECS = ["int8", "fp8", "fp8_e5m2", "int4", "int4:group=16", "int4:group=64"]


# ---- specs -------------------------------------------------------------------------------
def test_every_schema_has_a_codec():
    assert set(SCHEMAS) == set(CODECS)
    assert set(ALIASES.values()) <= set(CODECS)


@pytest.mark.parametrize("text,canonical", [
    ("auto", "auto"), ("INT8", "int8"), ("fp8", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2"),
    ("int4", "int4:group=32"), ("int4:group=16", "int4:group=16"), (" int4 : group = 64 ", "int4:group=64"),
])
def test_spec_canonical_text(text, canonical):
    assert str(parse_kv_spec(text)) == canonical


@pytest.mark.parametrize("text,needle", [
    ("int3", "choices: auto, fp8, fp8_e4m3, fp8_e5m2, gear, int4, int8, kivi2, kivi4, tiered, turboquant"),
    ("int4:group", "malformed"),
    ("int4:group=", "malformed"),
    ("int4:bits=4", "unknown parameter 'bits'"),
    ("int4:group=33", "out of range; group in [8, 16, 32, 64, 128]"),
    ("int4:group=abc", "not an integer"),
    ("int4:group=16,group=32", "given twice"),
    ("int8:group=32", "unknown parameter 'group'; parameters: none"),
    ("", "non-empty"),
])
def test_bad_specs_raise_with_the_choices(text, needle):
    with pytest.raises(ThreefoldError, match="kv_cache_dtype") as err:
        parse_kv_spec(text)
    assert needle in str(err.value)
    with pytest.raises(ThreefoldError):
        CacheConfig(kv_cache_dtype=text)


def test_group_must_divide_head_dim():
    with pytest.raises(ThreefoldError, match="must divide head_dim=48"):
        make_codec("int4:group=32", 2, 48, torch.float32)


def test_prefix_hash_seed_includes_the_codec():
    seeds = {seed_hash("model", spec) for spec in ["auto", "int8", "fp8_e4m3", "int4:group=32", "int4:group=16"]}
    assert len(seeds) == 5
    assert seed_hash("model") == seed_hash("model", "auto")


# ---- naive references: one row at a time, written from the formulas ------------------------
def _ref_int8(row):
    s = row.abs().max() / 127
    q = torch.round(row / s).clamp(-127, 127) if s > 0 else torch.zeros_like(row)
    return q.to(torch.int8), s, q * s


def _ref_fp8(row, fp8):
    fmax = torch.finfo(fp8).max
    s = row.abs().max() / fmax
    q = (row / s).clamp(-fmax, fmax).to(fp8) if s > 0 else torch.zeros_like(row).to(fp8)
    return q.view(torch.uint8), s, q.float() * s


def _ref_int4(row, group):
    codes, recon, scales = [], [], []
    for g in row.split(group):
        lo, s = g.min(), (g.max() - g.min()) / 15
        q = torch.round((g - lo) / s).clamp(0, 15) if s > 0 else torch.zeros_like(g)
        codes.append(q.to(torch.uint8))
        recon.append(q * s + lo)
        scales.append(s)
    return torch.cat(codes), torch.stack(scales), torch.cat(recon)


def _rows(num_tokens=37, kvh=3, d=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, kvh, d, generator=gen) * torch.rand(num_tokens, kvh, 1, generator=gen) * 4
    x[0, 0] = 0.0         # an all-zero row: zero scale, exact
    x[1, 1] = 0.5         # a constant row: int4 groups of zero range
    x[2, 2, 5] = 300.0    # an outlier
    return x


def test_spec_lists_keep_parameters_and_mix_layers_with_their_spec():
    text = "auto, gear:rank=1,outliers=0,mix:kivi4@0-2,7;kivi2@3-6,8-29,mix:auto@0;fp8@1-27,kivi2"
    assert split_spec_list(text) == ["auto", "gear:rank=1,outliers=0", "mix:kivi4@0-2,7;kivi2@3-6,8-29",
                                     "mix:auto@0;fp8@1-27", "kivi2"]


@pytest.mark.parametrize("spec", CODEC_SPECS)
def test_round_trip_matches_the_reference(spec):
    codec = make_codec(spec, 3, 64, torch.float32)
    storage = codec.allocate(num_blocks=5, block_size=8, device=torch.device("cpu"))
    k, v = _rows(seed=1), _rows(seed=2)
    slots = torch.randperm(40)[:37] + 0  # any slots of the 40
    codec.write(storage, slots, k, v)
    table = torch.arange(5).unsqueeze(0)
    k_read, v_read = codec.read(storage, table)  # [1, kvh, 40, d]
    for side, x, read in ((0, k, k_read), (1, v, v_read)):
        got = read[0].transpose(0, 1)[slots]  # [T, kvh, d]
        codes = storage.codes[side].view(-1, 3, storage.codes.shape[-1])[slots]
        for t in range(x.shape[0]):
            for h in range(3):
                _check_row(codec, x[t, h], codes[t, h], got[t, h])


def _check_row(codec, row, codes, got):
    eps = 1e-6 * row.abs().max() + 1e-30
    if codec.name == "int8":
        ref_codes, s, recon = _ref_int8(row)
        bound = s / 2 + eps
    elif codec.name.startswith("fp8"):
        ref_codes, s, recon = _ref_fp8(row, codec.fp8)
        mantissa = 3 if codec.name == "fp8_e4m3" else 2
        smallest_normal = torch.finfo(codec.fp8).smallest_normal
        # Relative half-ulp for normals, half the subnormal spacing below them, both times s.
        bound = row.abs() * 2.0 ** -(mantissa + 1) + s * smallest_normal * 2.0 ** -(mantissa + 1) + eps
    else:
        ref_codes, s, recon = _ref_int4(row, codec.group)
        codes = unpack_int4(codes)
        bound = s.repeat_interleave(codec.group) / 2 + eps
    assert torch.equal(codes, ref_codes)
    torch.testing.assert_close(got, recon, atol=1e-6 * row.abs().max() + 1e-30, rtol=1e-6)
    assert ((got - row).abs() <= bound).all()


@pytest.mark.parametrize("spec", ["auto", *CODEC_SPECS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_per_block_counts_everything_stored(spec, dtype):
    codec = make_codec(spec, 3, 64, dtype)
    storage = codec.allocate(num_blocks=4, block_size=16, device=torch.device("cpu"))
    tensors = [storage] if isinstance(storage, torch.Tensor) else [t for t in vars(storage).values() if t is not None]
    assert sum(t.nbytes for t in tensors) == 4 * codec.bytes_per_block(16)


def test_compression_ratios_at_head_dim_64():
    auto = make_codec("auto", 3, 64, torch.bfloat16).bytes_per_block(16)
    assert auto / make_codec("int8", 3, 64, torch.bfloat16).bytes_per_block(16) == pytest.approx(2 * 64 / 68)
    assert auto / make_codec("int4", 3, 64, torch.bfloat16).bytes_per_block(16) == pytest.approx(2 * 64 / 48)


@pytest.mark.parametrize("spec", CODEC_SPECS)
def test_read_of_the_null_block_is_finite(spec):
    codec = make_codec(spec, 2, 64, torch.bfloat16)
    storage = codec.allocate(num_blocks=2, block_size=4, device=torch.device("cpu"))
    k, v = codec.read(storage, torch.zeros(2, 3, dtype=torch.long))
    assert k.shape == (2, 2, 12, 64) and k.dtype == torch.bfloat16
    assert torch.isfinite(k).all() and torch.isfinite(v).all()


# ---- plumbing ------------------------------------------------------------------------------
def test_llm_rejects_a_bad_spec_before_loading_the_model():
    from threefold.engine.llm import LLM

    with pytest.raises(ThreefoldError, match="choices: auto, fp8"):
        LLM(model="no-such-model-is-loaded", kv_cache_dtype="kivi9")


def test_cli_takes_kv_cache_dtype():
    from threefold.cli import build_parser, engine_args_from

    ns = build_parser().parse_args(["generate", "--kv-cache-dtype", "int4:group=16"])
    assert engine_args_from(ns).kv_cache_dtype == "int4:group=16"
    ns = build_parser().parse_args(["bench", "offline", "--kv-cache-dtype", "int8", "--kv-cache-memory", "64MiB"])
    assert (ns.kv_cache_dtype, ns.kv_cache_memory) == ("int8", 64 << 20)


def test_metrics_export_the_cache_config():
    from threefold.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.set_cache_config({"kv_cache_dtype": "int4:group=32", "block_size": 16, "num_blocks": 10,
                              "bytes_per_token": 8640.0, "capacity_tokens": 160, "kv_cache_memory": 1 << 20})
    text = metrics.render().decode()
    assert 'vllm:cache_config_info{block_size="16",' in text and 'kv_cache_dtype="int4:group=32"' in text
    assert 'threefold:kv_cache_bytes_per_token{kv_cache_dtype="int4:group=32",model_name="m"} 8640.0' in text
    assert 'threefold:kv_cache_capacity_tokens{kv_cache_dtype="int4:group=32",model_name="m"} 160.0' in text


def test_capacity_rows_follow_bytes():
    from types import SimpleNamespace

    from threefold.kv.capacity import capacity_rows

    config = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    rows = {r["kv_cache_dtype"]: r for r in capacity_rows(config, 256 << 20)}
    assert rows["auto"]["bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert rows["int8"]["bytes_per_token"] == 2 * 30 * 3 * (64 + 4)
    assert rows["int4:group=32"]["bytes_per_token"] == 2 * 30 * 3 * (32 + 2 * 2 * 4)
    int4 = rows["int4:group=32"]
    assert int4["capacity_tokens"] == (256 << 20) // (16 * int4["bytes_per_token"]) * 16
