"""What CPU this is: its model, its instruction-set class, and what torch sees.

Every benchmark result records `cpu_info()`, and the engine's dtype choice reads
`cpu_class()`: bf16 arithmetic is native only with AVX512_BF16 or AMX; on an
AVX2-only CPU oneDNN emulates it at about 0.4x fp32 (measured, BENCHMARKS.md).

    class     what it has                                   seen as
    amx       AVX-512 + AVX512_BF16 + AMX tiles              Intel Xeon (Sapphire Rapids+)
    avx512    AVX-512 (with or without AVX512_BF16), no AMX  AMD EPYC Zen 4/5, older Xeons
    avx2      AVX2 + FMA (+ F16C), no AVX-512                AMD EPYC guests, desktops
    other     anything else (ARM, old x86)

Running as a lesser class (`THREEFOLD_CPU_CLASS=avx2`) measures that class on a
faster CPU, as issue 9 allows: `cpu_info()` then reports the class (and only its flags, with
"run as" in the model name), the dtype choice follows it, `cpu_kernels()` loads the build of
that class (x86-64-v3 for avx2), and `apply_run_as()` caps torch's own kernels to it (RUN_AS_ENV:
ATen's dispatch, oneDNN and MKL; set into the environment, so peers started from this
process inherit them) and sends bf16 matmuls where an AVX2 CPU sends them (ATen, not
oneDNN). Set the variables before Python starts to be sure: a library already initialized
keeps its ISA, and `apply_run_as()` warns when torch's capability disagrees.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from threefold.env import Env
from threefold.errors import ThreefoldError

logger = logging.getLogger(__name__)

CPU_CLASSES = ("amx", "avx512", "avx2", "other")
RUN_AS_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
"""The environment that caps torch's kernels (ATen, oneDNN, MKL) to a class, per class one can run as."""
RUN_AS_HIDDEN = {"avx2": ("avx512", "amx")}
"""The flag prefixes a CPU running as each class no longer reports."""


@dataclass(frozen=True)
class CpuInfo:
    model: str
    """The model name /proc/cpuinfo gives (platform.processor() elsewhere)."""
    cpu_class: str
    """One of CPU_CLASSES."""
    native_bf16: bool
    """Whether the CPU has a native bf16 dot product (AVX512_BF16 or AMX-BF16)."""
    torch_capability: str
    """torch.backends.cpu.get_cpu_capability(): the kernels ATen dispatches to."""
    num_threads: int
    """torch's intra-op threads."""
    flags: tuple[str, ...]
    """The SIMD-relevant flags present (avx2, fma, f16c, avx512*, amx*)."""
    run_as: str | None = None
    """The class this CPU runs as ($THREEFOLD_CPU_CLASS), when that is below its own; None: its own."""

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return f"{self.model} [{self.cpu_class}; torch {self.torch_capability}; {self.num_threads} threads]"


@functools.cache
def _proc_cpuinfo() -> tuple[str, frozenset[str]]:
    model = platform.processor() or platform.machine()
    flags: frozenset[str] = frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return model, flags


def classify(flags: frozenset[str] | set[str]) -> str:
    """The CPU class of a set of /proc/cpuinfo flags."""
    if "amx_tile" in flags and "amx_bf16" in flags and "avx512f" in flags:
        return "amx"
    if "avx512f" in flags and "avx512bw" in flags:
        return "avx512"
    if "avx2" in flags and "fma" in flags:
        return "avx2"
    return "other"


def run_as_class() -> str | None:
    """$THREEFOLD_CPU_CLASS, checked: a class in RUN_AS_ENV no higher than this CPU's own."""
    wanted = Env.read().cpu_class
    if wanted is None:
        return None
    own = classify(_proc_cpuinfo()[1])
    if wanted not in RUN_AS_ENV:
        raise ThreefoldError(f"THREEFOLD_CPU_CLASS={wanted!r}: a CPU can run as one of {', '.join(RUN_AS_ENV)}",
                             param="THREEFOLD_CPU_CLASS")
    if own not in CPU_CLASSES[:CPU_CLASSES.index(wanted) + 1]:
        raise ThreefoldError(f"THREEFOLD_CPU_CLASS={wanted!r}, but this CPU is {own}: it can only run as a "
                             "lesser class", param="THREEFOLD_CPU_CLASS")
    return wanted if wanted != own else None


def _flags() -> frozenset[str]:
    flags, run_as = _proc_cpuinfo()[1], run_as_class()
    return flags if run_as is None else frozenset(f for f in flags if not f.startswith(RUN_AS_HIDDEN[run_as]))


def cpu_class() -> str:
    return classify(_flags())


def has_native_bf16() -> bool:
    flags = _flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def apply_run_as() -> str | None:
    """Caps torch's kernels to the class this CPU runs as ($THREEFOLD_CPU_CLASS; None: its own)
    through RUN_AS_ENV, where the environment does not set them already, and warns when torch
    has already fixed a higher capability. Returns the class."""
    cls = run_as_class()
    if cls is None:
        return None
    for key, value in RUN_AS_ENV[cls].items():
        os.environ.setdefault(key, value)
    # torch sends bf16 matmuls to oneDNN only where the hardware has AVX-512 BW/VL/DQ (or
    # AVX-NE-CONVERT), read from CPUID: on an AVX2 CPU they take ATen's own gemm. Do the same
    # (with default precision settings fp32 matmuls never take oneDNN, so nothing else moves).
    torch.backends.mkldnn.set_flags(False)
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.lower() != RUN_AS_ENV[cls]["ATEN_CPU_CAPABILITY"]:
        logger.warning("running as %s, but torch dispatches to %s kernels: start Python with %s", cls, capability,
                       " ".join(f"{k}={v}" for k, v in RUN_AS_ENV[cls].items()))
    return cls


def cpu_info() -> CpuInfo:
    model, flags, cls = _proc_cpuinfo()[0], _flags(), run_as_class()
    simd = tuple(sorted(f for f in flags if f in ("avx2", "fma", "f16c") or f.startswith(("avx512", "amx"))))
    return CpuInfo(model if cls is None else f"{model} (run as {cls})", classify(flags), has_native_bf16(),
                   torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), simd, cls)
