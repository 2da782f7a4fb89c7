"""dtype="auto" per CPU class, explicit dtypes, the startup line, and bf16 weights with fp32 compute.

The policy is a pure function of the CPU (a `CpuInfo`), the checkpoint's dtype and
whether the kernel build streams bf16 weights into fp32 math; the loader tests fake
the CPU class by handing the loader another `CpuInfo`. The bf16-weights numerics are
checked against transformers in fp32 on the same bf16-rounded weights: an exact
oracle, since both sides then multiply identical values in fp32.
"""

from __future__ import annotations

import logging

import pytest
import torch

import threefold.model.loader as loader
from threefold.cpu import CpuInfo
from threefold.engine.llm import LLM
from threefold.engine.llm_engine import EngineArgs, LLMEngine
from threefold.errors import ThreefoldError
from threefold.kernels import has_few_row_linear
from threefold.model.llama import Linear
from threefold.model.loader import load_model
from threefold.model.precision import resolve_precision
from threefold.sample.params import SamplingParams

from model_fixtures import greedy, smollm2_gguf_path
from prompts import PROMPTS

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16


def fake_cpu(cpu_class: str, native_bf16: bool) -> CpuInfo:
    return CpuInfo(f"Test CPU ({cpu_class})", cpu_class, native_bf16, cpu_class.upper(), 2, ())


AMX, AVX512_BF16 = fake_cpu("amx", True), fake_cpu("avx512", True)
AVX512, AVX2, OTHER = fake_cpu("avx512", False), fake_cpu("avx2", False), fake_cpu("other", False)


def choice(requested: str, checkpoint: torch.dtype, cpu: CpuInfo, mixed_kernel: bool = True,
           device: str = "cpu") -> tuple[torch.dtype, torch.dtype]:
    p = resolve_precision(requested, checkpoint, device, cpu, mixed_kernel)
    return p.compute, p.weights


@pytest.mark.parametrize("cpu", [AMX, AVX512_BF16])
def test_auto_computes_in_bf16_where_the_cpu_has_native_bf16(cpu):
    assert choice("auto", BF16, cpu) == (BF16, BF16)  # quantized GGUF, bf16 checkpoints
    assert choice("auto", FP16, cpu) == (BF16, BF16)
    assert choice("auto", FP32, cpu) == (FP32, FP32)  # an fp32 checkpoint keeps fp32
    assert "native bf16" in resolve_precision("auto", BF16, "cpu", cpu, True).reason


@pytest.mark.parametrize("cpu", [AVX512, AVX2, OTHER])
def test_auto_computes_in_fp32_elsewhere(cpu):
    assert choice("auto", BF16, cpu, mixed_kernel=True) == (FP32, BF16)  # bf16 storage, fp32 math
    assert choice("auto", FP16, cpu, mixed_kernel=True) == (FP32, BF16)
    assert choice("auto", BF16, cpu, mixed_kernel=False) == (FP32, FP32)  # no kernel: no use for bf16
    assert choice("auto", FP32, cpu, mixed_kernel=True) == (FP32, FP32)  # never round an fp32 checkpoint
    precision = resolve_precision("auto", BF16, "cpu", cpu, True)
    assert precision.name == "bf16-weights" and precision.slow is None
    assert "no native bf16" in precision.reason and cpu.cpu_class in precision.where


@pytest.mark.parametrize("cpu", [AMX, AVX512, AVX2])
def test_an_explicit_dtype_always_wins(cpu):
    assert choice("float32", BF16, cpu) == (FP32, FP32)
    assert choice("bfloat16", FP32, cpu) == (BF16, BF16)
    assert choice("bf16-weights", FP32, cpu) == (FP32, BF16)


def test_explicit_bf16_warns_only_without_native_bf16():
    slow = resolve_precision("bfloat16", BF16, "cpu", AVX2, True).slow
    assert slow is not None and "no native bf16" in slow and "dtype='auto'" in slow
    assert resolve_precision("bfloat16", BF16, "cpu", AMX, True).slow is None
    assert resolve_precision("float32", BF16, "cpu", AVX2, True).slow is None
    # bf16 weights the kernel build cannot stream only cost memory: say so.
    assert "float32" in resolve_precision("bf16-weights", BF16, "cpu", AVX2, False).slow


def test_gpu_keeps_the_checkpoint_dtype_and_bad_dtypes_are_clear():
    assert choice("auto", FP16, AVX2, device="cuda") == (FP16, FP16)
    assert choice("auto", BF16, AVX2, device="cuda") == (BF16, BF16)
    with pytest.raises(ThreefoldError, match=r"unsupported dtype 'int8'.*auto, float32, bfloat16") as err:
        resolve_precision("int8", FP32, "cpu", AVX2, True)
    assert err.value.param == "dtype"
    with pytest.raises(ThreefoldError, match="float16 is not supported on CPU"):
        resolve_precision("float16", FP16, "cpu", AMX, True)
    with pytest.raises(ThreefoldError, match="bf16-weights is a CPU layout"):
        resolve_precision("bf16-weights", BF16, "cuda", AMX, True)


def test_the_fingerprint_tells_the_numerics_apart():
    """Prefix-cache seeds: fp32 compute over bf16-rounded weights gives other KV values than
    plain fp32 or bf16, so each precision has its own fingerprint."""
    path = smollm2_gguf_path()
    keys = {resolve_precision(d, BF16, "cpu", AVX2, True).key() for d in ("float32", "bfloat16", "bf16-weights")}
    prints = {loader.fingerprint([path], resolve_precision(d, BF16, "cpu", AVX2, True))
              for d in ("float32", "bfloat16", "bf16-weights")}
    assert len(keys) == 3 and len(prints) == 3


@pytest.mark.parametrize("cpu,compute", [(AMX, BF16), (AVX2, FP32)])
def test_loader_and_engine_follow_the_cpu_class(monkeypatch, caplog, cpu, compute):
    """The real loader and engine on SmolLM2 (a Q4_1 GGUF) with the CPU class faked: auto
    computes in bf16 on AMX and in fp32 on AVX2, and the engine says so in one line."""
    monkeypatch.setattr(loader, "cpu_info", lambda: cpu)
    loaded = load_model("smollm2-135m", max_model_len=256)
    assert loaded.config.dtype == compute == loaded.precision.compute
    assert loaded.model.layers[0].mlp.down_proj.weight.dtype in (compute, torch.float32)
    with caplog.at_level(logging.INFO, logger="threefold.engine.llm_engine"):
        LLMEngine(loaded, EngineArgs(max_model_len=256, kv_cache_memory=16 << 20))
    lines = [r for r in caplog.records if r.getMessage().startswith("dtype ")]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert cpu.model in lines[0].getMessage() and f"compute {str(compute)[6:]}" in lines[0].getMessage()


def test_explicit_bf16_on_an_avx2_cpu_logs_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(loader, "cpu_info", lambda: AVX2)
    loaded = load_model("smollm2-135m", dtype="bfloat16", max_model_len=256)
    assert loaded.config.dtype == BF16  # the explicit dtype wins
    with caplog.at_level(logging.INFO, logger="threefold.engine.llm_engine"):
        LLMEngine(loaded, EngineArgs(dtype="bfloat16", max_model_len=256, kv_cache_memory=16 << 20))
    lines = [r for r in caplog.records if r.getMessage().startswith("dtype ")]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "0.4x fp32" in lines[0].getMessage() and "dtype='auto'" in lines[0].getMessage()


# ---- bf16 weights, fp32 compute: the numerics ---------------------------------------------

@pytest.fixture(scope="module")
def smollm2_bf16w():
    return load_model("smollm2-135m", dtype="bf16-weights", max_model_len=1024)


def test_bf16_weights_hold_identical_values_on_both_paths(smollm2_bf16w):
    """Each Linear's fp32 weight for GEMMs (plain, or prepacked for oneDNN, when the plain one
    is dropped) is exactly its bf16 stream weight widened: an identity batch through the GEMM
    path reads it back. The tied embedding is the LM head's rounded weight; norms stay fp32."""
    model = smollm2_bf16w.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 30 + 1
    for linear in linears:
        assert linear.stream_weight.dtype == BF16
        assert linear.weight.dtype == FP32 and (linear.packed is not None or linear.weight.device.type != "meta")
    for linear in [*(m for m in model.layers[0].modules() if isinstance(m, Linear)), model.lm_head]:
        with torch.inference_mode():  # more rows than the few-row kernel takes: the GEMM path
            gemm_weight = linear(torch.eye(linear.in_features)).t()
        assert torch.equal(gemm_weight, linear.stream_weight.float())
    assert model.embed_tokens.weight is model.lm_head.weight
    assert model.norm.weight.dtype == FP32


def test_few_row_and_gemm_paths_agree(smollm2_bf16w):
    """One row through the few-row kernel (bf16 weights widened in registers) vs the same row
    inside a 16-row GEMM over the fp32 copy: the same products, summed in another order."""
    linear = smollm2_bf16w.model.layers[3].mlp.gate_up_proj
    if linear.kernels is None:
        pytest.skip("this kernel build has no few-row linear over bf16 weights with fp32 activations")
    assert has_few_row_linear(linear.kernels, FP32, BF16)
    x = torch.randn(16, linear.in_features, generator=torch.Generator().manual_seed(0))
    batched = linear(x)  # [16, out]: F.linear on the fp32 copy
    for row in (0, 7):
        single = linear(x[row : row + 1])  # the kernel
        torch.testing.assert_close(single[0], batched[row], atol=1e-4, rtol=1e-5)


def _hf_fp32_with_bf16_linears():
    """transformers' fp32 model of the same GGUF, with the weights threefold stores in bf16
    (every projection, and the tied embedding / LM head) rounded to bf16 values."""
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" not in name:
                param.copy_(param.to(BF16).float())
    return hf


def test_bf16_weights_greedy_matches_transformers_on_the_same_values(smollm2_bf16w):
    """Our decode (prefill, then one token per step: the few-row path) vs transformers
    teacher-forced in fp32 on identical bf16-rounded weights: same argmax at every step,
    logprobs within fp32 op-order noise (see test_model_parity's LOGPROB_ATOL)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # small matmuls on a shared 2-core box (see test_model_parity)
    try:
        hf = _hf_fp32_with_bf16_linears()
        for prompt in ("The capital of France is", "def fibonacci(n):\n    "):
            prompt_ids = smollm2_bf16w.tokenizer.encode(prompt)
            our_ids, our_logprobs = greedy(smollm2_bf16w.model, prompt_ids, 16)
            with torch.inference_mode():
                logits = hf(torch.tensor([prompt_ids + our_ids])).logits[0, len(prompt_ids) - 1 : -1].float()
            logp = torch.log_softmax(logits, dim=-1)
            assert our_ids == logp.argmax(-1).tolist()
            theirs = logp.gather(1, torch.tensor(our_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(our_logprobs), theirs, atol=2e-3, rtol=0)
    finally:
        torch.set_num_threads(previous)


def test_bf16_weights_batch_invariance(smollm2_bf16w):
    """A request's greedy tokens do not depend on its batch: alone (the few-row path at every
    decode step) or among 16 (GEMMs over the fp32 copy), with small budgets that split
    prefills into chunks beside decodes."""
    greedy_params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def make(**args) -> LLM:
        args = {"dtype": "bf16-weights", "max_model_len": 1024, "kv_cache_memory": 64 << 20,
                "enable_prefix_caching": False, **args}
        return LLM.from_engine(LLMEngine(smollm2_bf16w, EngineArgs(**args)))

    alone = make()
    reference = [alone.generate([p], greedy_params)[0].outputs[0].token_ids for p in PROMPTS]
    for budget in (512, 7):
        outputs = make(max_num_batched_tokens=budget).generate(PROMPTS, greedy_params)
        assert [o.outputs[0].token_ids for o in outputs] == reference
