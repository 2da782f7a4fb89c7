"""Which dtype a model computes in and stores its linear weights in, chosen per CPU.

    dtype          linear weights                   compute  dtype="auto" picks it
    bfloat16       bf16 (prepacked for oneDNN)      bf16     CPUs with a native bf16 dot product
                                                             (AVX512_BF16 or AMX), non-fp32 checkpoints
    bf16-weights   bf16 for the few-row kernel,     fp32     other CPUs, non-fp32 checkpoints, where the
                   + an fp32 copy of the same                few-row kernel widens bf16 to fp32 in
                   values for GEMMs (MKL)                    registers
    float32        fp32                             fp32     other CPUs otherwise; fp32 checkpoints

Without a native bf16 dot product oneDNN emulates bf16 at about 0.4x fp32 (AVX2
EPYC, BENCHMARKS.md), so there the arithmetic is fp32. Batch-1 decode streams
every weight once per token, so it is bound by the weights' bytes: bf16-weights
halves them for the few-row path. Batches of more rows reuse each weight and
want MKL's fp32 GEMM, so bf16-weights also keeps an fp32 copy, upcast from the
bf16 weight: both paths multiply identical values, and a request's greedy tokens
do not depend on which path its batch took (batch invariance).

Measured on a 2-vCPU AMD EPYC (avx2), shared: one pass over SmolLM2's 30 layers at one
row took 34 ms streaming bf16 weights against 49 ms for MKL's fp32 GEMV (1.46x; 2.96x at
two rows); batch-1 decode ran 1.10x float32 and offline throughput was level with it,
at 1.5x float32's weight memory (770 against 513 MiB for SmolLM2-135M).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from threefold.cpu import CpuInfo
from threefold.errors import ThreefoldError

BF16_WEIGHTS = "bf16-weights"
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", BF16_WEIGHTS)
"""float16 only on a GPU: fp16 matmul on a CPU runs ~1000x slower than bf16."""
_EXPLICIT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """The numerics a model runs with: what `resolve_precision` chose, and why."""

    compute: torch.dtype
    """Activations, norms, the KV cache, and every GEMM."""
    weights: torch.dtype
    """The storage of linear weights that the few-row path streams (bf16 under bf16-weights;
    else the compute dtype)."""
    reason: str
    """Why this choice, for the startup log."""
    where: str
    """What it was chosen for: the CPU's model and class, or the GPU device."""
    slow: str | None = None
    """Set when an explicit dtype will be slow on this CPU: why, and what to use instead."""

    @property
    def name(self) -> str:
        """The `dtype` value that selects this precision explicitly."""
        if self.mixed:
            return BF16_WEIGHTS
        return str(self.compute).removeprefix("torch.")

    @property
    def mixed(self) -> bool:
        """bf16 weight storage with fp32 compute."""
        return self.weights != self.compute

    def key(self) -> str:
        """What the prefix-cache seed must tell apart: bf16-weights rounds the weights to bf16
        and computes in fp32, which gives KV that neither float32 nor bfloat16 gives."""
        return f"compute={self.compute} weights={self.weights}"

    def describe(self) -> str:
        storage = "bf16 + an fp32 copy for GEMMs" if self.mixed else str(self.weights).removeprefix("torch.")
        return (f"dtype {self.name}: compute {str(self.compute).removeprefix('torch.')}, weights {storage}, "
                f"on {self.where}: {self.reason}")

    def log(self, logger: logging.Logger) -> None:
        """The startup line: INFO, or WARNING (with the advice) when this will be slow here."""
        if self.slow:
            logger.warning("%s. %s", self.describe(), self.slow)
        else:
            logger.info("%s", self.describe())


def _validate(requested: str, on_cpu: bool) -> None:
    if requested not in DTYPE_CHOICES:
        raise ThreefoldError(f"unsupported dtype {requested!r}; supported: {', '.join(DTYPE_CHOICES)}",
                             param="dtype")
    if requested == BF16_WEIGHTS and not on_cpu:
        raise ThreefoldError(f"dtype {BF16_WEIGHTS} is a CPU layout; on a GPU use bfloat16 or float32",
                             param="dtype")


def _on_gpu(requested: str, checkpoint: torch.dtype, device: str) -> Precision:
    dtype = _EXPLICIT.get(requested, checkpoint)
    return Precision(dtype, dtype, "requested" if requested != "auto" else "the checkpoint's dtype", device)


def _where(cpu: CpuInfo) -> str:
    return f"{cpu.model} [{cpu.cpu_class}]"


def _auto_on_cpu(checkpoint: torch.dtype, cpu: CpuInfo, mixed_kernel: bool) -> Precision:
    fp32, bf16, where = torch.float32, torch.bfloat16, _where(cpu)
    if cpu.native_bf16:
        if checkpoint == fp32:
            return Precision(fp32, fp32, "auto: the checkpoint is fp32", where)
        return Precision(bf16, bf16, "auto: the CPU has a native bf16 dot product", where)
    why = "auto: no native bf16 dot product on this CPU (bf16 would run at ~0.4x fp32)"
    if checkpoint == fp32:
        return Precision(fp32, fp32, f"{why}; the checkpoint is fp32", where)
    if mixed_kernel:
        return Precision(fp32, bf16, f"{why}; few-row linears stream bf16 weights, widened to fp32 in registers",
                         where)
    return Precision(fp32, fp32, f"{why}; this kernel build cannot stream bf16 weights into fp32 math", where)


def _explicit_on_cpu(requested: str, cpu: CpuInfo, mixed_kernel: bool) -> Precision:
    if requested == "float16":
        raise ThreefoldError(
            "dtype float16 is not supported on CPU (fp16 matmul is ~1000x slower there); use bfloat16 or float32",
            param="dtype")
    if requested == BF16_WEIGHTS:
        slow = None if mixed_kernel else (
            "This kernel build has no few-row linear over bf16 weights, so they only cost memory here; "
            "use dtype='float32'.")
        return Precision(torch.float32, torch.bfloat16, "requested", _where(cpu), slow)
    dtype = _EXPLICIT[requested]
    slow = None
    if dtype == torch.bfloat16 and not cpu.native_bf16:
        slow = (f"This CPU ({cpu.cpu_class}) has no native bf16 dot product: bf16 linears run at about 0.4x "
                f"fp32. Use dtype='auto' (fp32 compute{', bf16 weights' if mixed_kernel else ''}) or 'float32'.")
    return Precision(dtype, dtype, "requested", _where(cpu), slow)


def resolve_precision(requested: str, checkpoint: torch.dtype, device: str, cpu: CpuInfo,
                      mixed_kernel: bool) -> Precision:
    """The precision for `dtype=requested`. An explicit dtype always wins; "auto" decides from
    the CPU (`cpu`) and whether the kernel build runs the few-row linear over bf16 weights with
    fp32 activations (`mixed_kernel`). fp16 checkpoints compute in bf16 or fp32 on CPU (fp16
    matmul there is ~1000x slower)."""
    on_cpu = torch.device(device).type == "cpu"
    _validate(requested, on_cpu)
    if checkpoint not in (torch.float32, torch.bfloat16, torch.float16):
        raise ThreefoldError(f"checkpoint dtype {checkpoint} is not supported; pass dtype='bfloat16'",
                             param="dtype")
    if not on_cpu:
        return _on_gpu(requested, checkpoint, device)
    if requested == "auto":
        return _auto_on_cpu(checkpoint, cpu, mixed_kernel)
    return _explicit_on_cpu(requested, cpu, mixed_kernel)
