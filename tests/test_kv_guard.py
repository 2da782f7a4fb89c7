"""Per-layer codec mixes and the quality guard (issue 10, item 4).

Mixes: the spec grammar, and an engine over a mix against a plain-torch oracle that applies
each layer's codec as the algorithm says. Guard: the greedy on hand-built KL tables, then a
real calibration on a tiny model where one layer's attention is switched off (its o_proj is
zero), with a test codec that drops V: only the live layer is damaged, and the guard must keep
exactly that layer at high precision.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from window_rules import oracle_quantized_len

from threefold.config import CacheConfig
from threefold.errors import ThreefoldError
from threefold.kv.codec import DenseCodec
from threefold.kv.guard import choose_levels, parse_guard
from threefold.kv.mix import mix_text, parse_mix
from threefold.kv.registry import CODECS, make_codec
from threefold.kv.spec import SCHEMAS, parse_kv_spec
from threefold.kv.window import window_dtype
from threefold.sample.params import SamplingParams

from model_fixtures import make_tiny_checkpoint

KIVI = "kivi2:group=16,residual=16"


# ---- the grammar ---------------------------------------------------------------------------
def test_mix_text_is_canonical():
    specs = parse_mix("mix: int8@3-4 ; kivi2@0-2,5", 6)
    assert [str(s) for s in specs] == ["kivi2:group=32,residual=128"] * 3 + ["int8"] * 2 + [
        "kivi2:group=32,residual=128"]
    assert mix_text(specs) == "mix:kivi2:group=32,residual=128@0-2,5;int8@3-4"
    assert mix_text([parse_kv_spec("fp8")] * 4) == "fp8_e4m3"  # one codec everywhere: the plain spec


@pytest.mark.parametrize("dtype, budget, needle", [
    ("guard:unknown", 0.01, "unknown kv_cache_dtype 'unknown'; choices:"),
    ("guard:kivi2", None, "needs kv_quality_budget"),
    ("guard:kivi2", 0.0, "must be a positive KL"),
    ("guard:kivi2>kivi2", 0.01, "appears twice"),
    ("guard:", 0.01, "write guard:BASE"),
    ("int8", 0.01, "applies to guard: specs only"),
    ("mix:int8@0-1;kivi2@1", None, "layer 1 is named twice"),
    ("mix:int8@0-x", None, "is not a layer"),
    ("mix:int8", None, "has no SPEC@LAYERS"),
    ("mix:int8@0;int8@2", None, "missing [1]"),
])
def test_bad_specs_raise_naming_the_fix(dtype, budget, needle):
    with pytest.raises(ThreefoldError, match=".*".join(map(_escape, needle.split("*")))):
        CacheConfig(kv_cache_dtype=dtype, kv_quality_budget=budget)


def _escape(text: str) -> str:
    import re
    return re.escape(text)


def test_guard_ladder_text():
    assert str(parse_guard("guard:kivi2>int8")) == "guard:kivi2:group=32,residual=128>int8"
    assert parse_guard("guard:kivi2").rungs is None


# ---- the greedy ----------------------------------------------------------------------------
def _table(kl):
    calls = []

    def measure(layer, level):
        calls.append((layer, level))
        return kl[layer][level]
    return measure, calls


def test_choose_levels_spends_the_budget_where_it_saves_most_bytes():
    # rungs: 10, 20, 40 bytes. Layer 0 is bad on rung 0, fixed by rung 1; layer 1 needs rung 2.
    kl = [[0.5, 0.01, 0.0], [0.3, 0.2, 0.0], [0.02, 0.01, 0.0], [0.001, 0.0, 0.0]]
    measure, calls = _table(kl)
    levels, total = choose_levels(4, [10, 20, 40], measure, 0.05)
    assert levels == [1, 2, 0, 0] and total == pytest.approx(0.031)
    assert (3, 1) not in calls  # lazily: a harmless layer's next rung is never measured
    with pytest.raises(ThreefoldError, match="cannot be met"):
        choose_levels(2, [10, 20], _table([[0.5, 0.1], [0.2, 0.1]])[0], 0.05)


# ---- a mix in the engine, against a plain-torch oracle --------------------------------------
MIX = f"mix:{KIVI}@0-9;int8@10-19;auto@20-29"


def _oracle_attention(codecs, block_size):
    """Whole-sequence attention where layer l reads K/V as its codec stores them: int8 rows
    round-tripped; KIVI row p reads keys below nq(p + 1) (tests/window_rules.py) from whole
    quantized blocks and the rest exact (kv/codecs/kivi.py, worker/kivi_attention.py)."""
    def attend(layer, q, k, v):
        codec, n = codecs[layer], k.shape[0]
        if hasattr(codec, "residual"):
            k, v = (t.to(window_dtype(t.dtype)).to(t.dtype) for t in (k, v))  # the window's precision
            pad = -n % block_size
            blocks = (-1, block_size, *k.shape[1:])
            kq, vq = codec.dequantize(*codec.quantize(torch.cat([k, k[:pad]]).view(blocks),
                                                      torch.cat([v, v[:pad]]).view(blocks)))
            kq, vq = kq.flatten(0, 1)[:n], vq.flatten(0, 1)[:n]
            nq = torch.tensor([oracle_quantized_len(p, codec.residual, block_size) for p in range(1, n + 1)])
            quantized = torch.arange(n)[None, :] < nq[:, None]  # [row, key]
            keys = torch.where(quantized[..., None, None], kq[None], k[None])  # [row, key, kvh, d]
            values = torch.where(quantized[..., None, None], vq[None], v[None])
        else:
            k, v = codec.round_trip(k, v)
            keys, values = k[None].expand(n, -1, -1, -1), v[None].expand(n, -1, -1, -1)
        group = q.shape[1] // k.shape[1]
        scores = torch.einsum("phd,pjhd->phj", q, keys.repeat_interleave(group, 2)) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril()[:, None, :], float("-inf"))
        return torch.einsum("phj,pjhd->phd", torch.softmax(scores, -1), values.repeat_interleave(group, 2))
    return attend


def _kl(p, q):
    return float((p.exp() * (p - q)).sum(-1).mean())


def test_a_mix_reads_each_layer_through_its_codec(make_llm, smollm2_fp32):
    llm = make_llm(kv_cache_dtype=MIX, max_num_batched_tokens=16, enable_prefix_caching=False,
                   kv_cache_memory=32 << 20, max_model_len=256)
    core, config = llm.engine.core, smollm2_fp32.config
    codecs = core.runner.codecs
    kivi, int8, auto = (make_codec(s, config.num_kv_heads, config.head_dim, torch.float32)
                        for s in (KIVI, "int8", "auto"))
    assert core.cache_info["kv_cache_dtype"] == f"mix:{KIVI}@0-9;int8@10-19;auto@20-29"
    assert core.runner.bytes_per_block() == 10 * sum(c.bytes_per_block(16) for c in (kivi, int8, auto))
    # fp16 windows beside the fp32 model (kv/window.py: window_dtype)
    assert core.cache_info["window_bytes_per_seq"] == 10 * 2 * 16 * config.num_kv_heads * config.head_dim * 2
    assert core.cache_info["layer_codecs"][9:11] == [KIVI, "int8"]
    ids = smollm2_fp32.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)[:72]
    got = llm.score_distributions([ids])[0]  # chunks of 16: later chunks read earlier ones back
    with torch.inference_mode():
        hidden = smollm2_fp32.model(torch.tensor(ids), torch.arange(len(ids)), _oracle_attention(codecs, 16))
        want = F.log_softmax(smollm2_fp32.model.compute_logits(hidden[:-1]).float(), dim=-1)
    exact = make_llm(max_num_batched_tokens=16, enable_prefix_caching=False).score_distributions([ids])[0]
    # int8 rounding flips on fp32 summation-order noise and the flips compound over layers, so the
    # oracle is compared by KL: ~1% of what the mix adds against auto (a layer on the wrong codec: ~100%).
    assert _kl(want, got) < 0.1 * _kl(exact, got) and _kl(exact, got) > 1e-3
    # greedy generation with prefix caching: every block and window given back
    cached = make_llm(kv_cache_dtype=MIX, kv_cache_memory=32 << 20, max_model_len=256)
    outs = cached.generate(["The capital of France is", "The capital of France is a"],
                           SamplingParams(max_tokens=8, temperature=0))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    cached.engine.core.step()
    assert cached.engine.get_stats().kv_cache_usage == 0.0 and cached.engine.core.runner.windows.windows == {}


def test_a_different_mix_never_reuses_blocks(make_llm):
    hashes = []
    for spec in (MIX, f"mix:{KIVI}@0-9;auto@10-29"):
        llm = make_llm(kv_cache_dtype=spec, kv_cache_memory=32 << 20, max_model_len=256)
        llm.generate(["You are a helpful assistant. " * 6], SamplingParams(max_tokens=1, temperature=0))
        hashes.append(set(llm.engine.core.kv.pool.cached))
    assert hashes[0] and hashes[1] and hashes[0].isdisjoint(hashes[1])


# ---- the guard, on a tiny model with one dead layer -------------------------------------------
class DropValues(DenseCodec):
    """A test codec that keeps K and loses V (reads zeros): ruinous wherever attention matters."""

    def bytes_per_block(self, block_size: int) -> int:
        return super().bytes_per_block(block_size) // 8  # fewer than int8: every ladder rung is above it

    def write(self, storage, slot_mapping, k, v) -> None:
        super().write(storage, slot_mapping, k, torch.zeros_like(v))

    def round_trip(self, k, v):
        return k, torch.zeros_like(v)


@pytest.fixture
def drop_values(monkeypatch):
    monkeypatch.setitem(CODECS, "dropv", DropValues)
    monkeypatch.setitem(SCHEMAS, "dropv", {})


@pytest.fixture(scope="module")
def tiny_dead_layer(tmp_path_factory):
    """The tiny llama (2 layers) with layer 1's attention switched off: o_proj = 0."""
    from threefold.model.loader import load_model
    loaded = load_model(str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")), dtype="float32")
    o_proj = loaded.model.layers[1].self_attn.o_proj
    with torch.no_grad():
        o_proj.weight.zero_()
    if o_proj.packed is not None:  # the forward reads the prepacked copy (fp32 is packed too): pack the zeros
        assert o_proj.pack()
    return loaded


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "calibration.txt"
    path.write_text("The cat sat on the mat and looked at the garden, where the rain had stopped. " * 8)
    return str(path)


def test_the_guard_keeps_the_damaged_layer_and_compresses_the_harmless_one(
        drop_values, tiny_dead_layer, calibration_file, monkeypatch, tmp_path):
    from threefold.engine.llm import LLM
    from threefold.engine.llm_engine import EngineArgs, LLMEngine

    monkeypatch.setattr("threefold.engine.kv_guard._result_path", lambda *a: tmp_path / "result.json")
    args = EngineArgs(dtype="float32", kv_cache_dtype="guard:dropv", kv_quality_budget=0.01,
                      kv_guard_calibration=calibration_file, kv_cache_memory=16 << 20)
    engine = LLMEngine(tiny_dead_layer, args)
    guard = engine.guard
    # default ladder: dropv, then int8 and auto (kivi4's group 32 cannot divide head_dim 16: skipped)
    assert guard.layer_specs[0] in ("int8", "auto") and guard.layer_specs[1] == "dropv"
    assert guard.mix == f"mix:{guard.layer_specs[0]}@0;dropv@1"
    assert abs(guard.layer_kl[1]) < 1e-6 and guard.measured_kl <= 0.01
    assert engine.core.cache_info["kv_cache_dtype"] == guard.mix
    dense = DenseCodec(parse_kv_spec("auto"), 2, 16, torch.float32).bytes_per_block(16)
    first = make_codec(guard.layer_specs[0], 2, 16, torch.float32).bytes_per_block(16)
    assert engine.core.runner.bytes_per_block() == first + dense // 8
    out = LLM.from_engine(engine).generate(["The cat"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    # a restart reads the same choice back instead of calibrating again
    monkeypatch.setattr("threefold.engine.kv_guard.calibrate", lambda *a: pytest.fail("calibrated twice"))
    assert LLMEngine(tiny_dead_layer, args).guard.mix == guard.mix


def test_the_guard_measures_the_damage_per_layer(drop_values, tiny_dead_layer, calibration_file):
    from threefold.engine.kv_guard import calibrate, calibration_tokens

    tokens = calibration_tokens(tiny_dead_layer.tokenizer, calibration_file, 128)
    result = calibrate(tiny_dead_layer, parse_guard("guard:dropv>auto"), 0.01, tokens, 16)
    assert result.mix == "mix:auto@0;dropv@1" and result.measured_kl == result.layer_kl[0] == 0.0
    assert result.num_probes == 3  # dropv on layer 0 and on layer 1, auto on layer 0 (exact: not run)
    assert result.num_engine_runs == 2  # the auto reference and the chosen mix, through the cache
    with pytest.raises(ThreefoldError, match="kv_quality_budget cannot be met"):
        calibrate(tiny_dead_layer, parse_guard("guard:dropv>int8"), 1e-12, tokens, 16)
    with pytest.raises(ThreefoldError, match="order the ladder"):
        calibrate(tiny_dead_layer, parse_guard("guard:int8>dropv"), 0.01, tokens, 16)


def test_metrics_export_the_mix_and_the_guard():
    from threefold.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.set_cache_config({"kv_cache_dtype": "mix:int8@0;dropv@1", "block_size": 16, "bytes_per_token": 1.0,
                              "capacity_tokens": 10, "layer_codecs": ["int8", "dropv"],
                              "kv_guard": {"guard": "guard:dropv", "budget": 0.01, "predicted_kl": 0.002,
                                           "measured_kl": 0.003}})
    text = metrics.render().decode()
    assert 'threefold:kv_cache_layer_codec_info{codec="dropv",layer="1",model_name="m"} 1.0' in text
    assert 'threefold:kv_guard_kl{guard="guard:dropv",kind="measured",model_name="m"} 0.003' in text
    assert 'kv_cache_dtype="mix:int8@0;dropv@1"' in text and "layer_codecs" not in text


@pytest.mark.parametrize("spec", ["kivi2:group=16,residual=16", "int8"])
def test_the_layer_probe_agrees_with_the_engine_through_the_cache(tiny_dead_layer, calibration_file, spec):
    from threefold.engine.kv_guard import _Scorer, calibration_tokens
    from threefold.worker.layer_probe import LayerProbe

    tokens = calibration_tokens(tiny_dead_layer.tokenizer, calibration_file, 128)
    codec = make_codec(spec, 2, 16, torch.float32)
    probed = LayerProbe(tiny_dead_layer.model, tokens, 16).kl(0, codec)
    through_cache = _Scorer(tiny_dead_layer, tokens, 16).kl(mix_text([parse_kv_spec(spec), parse_kv_spec("auto")]))
    assert probed > 1e-5 and probed == pytest.approx(through_cache, rel=1e-2)
