"""What CPU this is: its model, its instruction-set class, and what torch sees.

Every benchmark result records `cpu_info()`, and the engine's dtype choice reads
`cpu_class()`: bf16 arithmetic is native only with AVX512_BF16 or AMX; on an
AVX2-only CPU oneDNN emulates it at about 0.4x fp32 (measured, BENCHMARKS.md).

    class     what it has                                   seen as
    amx       AVX-512 + AVX512_BF16 + AMX tiles              Intel Xeon (Sapphire Rapids+)
    avx512    AVX-512 (with or without AVX512_BF16), no AMX  AMD EPYC Zen 4/5, older Xeons
    avx2      AVX2 + FMA (+ F16C), no AVX-512                AMD EPYC guests, desktops
    other     anything else (ARM, old x86)
"""

from __future__ import annotations

import functools
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CPU_CLASSES = ("amx", "avx512", "avx2", "other")


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


def cpu_class() -> str:
    return classify(_proc_cpuinfo()[1])


def has_native_bf16() -> bool:
    flags = _proc_cpuinfo()[1]
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_info() -> CpuInfo:
    model, flags = _proc_cpuinfo()
    simd = tuple(sorted(f for f in flags if f in ("avx2", "fma", "f16c") or f.startswith(("avx512", "amx"))))
    return CpuInfo(model, classify(flags), has_native_bf16(), torch.backends.cpu.get_cpu_capability(),
                   torch.get_num_threads(), simd)
