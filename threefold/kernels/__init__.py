"""Native CPU kernels, compiled on first use with torch's C++ extension builder.

Every `*.cpp` in this folder is one translation unit of the same module. A file names
the functions it exports in a comment line,

    // threefold-exports: linear_small argmax_rows

and defines each of them at file scope; the loader binds them (the declarations are
read from the definitions). Files compile separately, so each keeps its helpers in an
anonymous namespace without clashing with the others'; shared inline helpers live in
kernel_common.h.

A build is made for a named target (`TARGETS`): "native" (-march=native, the engine's
build: `cpu_kernels()`), "x86-64-v3" (AVX2, FMA, F16C) and "x86-64-v2" (SSE4.2), each
its own module and cache directory under $THREEFOLD_HOME/kernels, keyed by torch
version, sources and flags (and, for native, the CPU's flags). The portable builds let
the tests run every kernel path the CPU can execute, whatever -march=native picks.
`cpu_kernels()` returns None where the native build cannot be made (no compiler, an
unsupported platform, or THREEFOLD_ATTENTION=torch); callers then take their plain
PyTorch path, which computes the same thing. A build takes about a minute on 2 cores.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import re
import sys
from pathlib import Path
from types import ModuleType

import torch

from threefold.cpu import apply_run_as, run_as_class
from threefold.env import Env

logger = logging.getLogger(__name__)

FEW_ROWS_MAX = 16
"""The most rows of x for which `linear_small` beats torch's F.linear fp32 (MKL): measured on
SmolLM2-135M's 30 layers, cold, AVX2 (AMD EPYC, 1 thread, CPU time): fp32 1.17x at 1 row,
1.07x at 16, 0.87x at 32; mixed (fp32 x, bf16 w) 1.79x at 1, 1.25x at 16, 0.88x at 32.
benchmarks/kernels_micro.py measures it."""

_DIR = Path(__file__).parent
_EXPORTS = re.compile(r"^//\s*threefold-exports:(.*)$", re.MULTILINE)

TARGETS = {
    "native": ["-march=native"],
    "x86-64-v3": ["-march=x86-64-v3", "-mtune=generic"],
    "x86-64-v2": ["-march=x86-64-v2", "-mtune=generic"],
}
"""Build targets and their -march flags."""
_TARGET_CPU_FLAGS = {  # /proc/cpuinfo flags each x86-64 level needs (psABI; abm = lzcnt)
    "x86-64-v2": {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"},
    "x86-64-v3": {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3",
                  "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"},
}
_CFLAGS = ["-O3", "-ffast-math", "-fopenmp"]
"""-fopenmp: at::parallel_for is an OpenMP pragma in ATen's headers (without it, one thread);
the extension's libgomp.so.1 resolves to the copy torch has already loaded. -ffast-math lets
the dot products reassociate (vectorize) and exp use the vector math library."""
_NATIVE_X86_CFLAGS = ["-mprefer-vector-width=512"]  # gcc defaults to 256-bit vectors on Intel


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def available_targets() -> list[str]:
    """The build targets this CPU can run that exercise different vector paths, native first."""
    if sys.platform != "linux":
        return []
    if platform.machine() != "x86_64":
        return ["native"]
    flags = _cpu_flags()
    # Without AVX-512, native already is the AVX2 (v3) build: a separate v3 build would test the
    # same vector paths again and cost CI a minute of compiling.
    portable = ("x86-64-v3", "x86-64-v2") if "avx512f" in flags else ("x86-64-v2",)
    return ["native"] + [t for t in portable if _TARGET_CPU_FLAGS[t] <= flags]


def _sources() -> list[Path]:
    return sorted(_DIR.glob("*.cpp"))


def _declarations(path: Path, text: str) -> tuple[list[str], list[str]]:
    """The names a source exports and a declaration for each, read off its definition
    (`<return type> name(<params>) {` at the start of a line)."""
    names = [n for line in _EXPORTS.findall(text) for n in line.split()]
    declarations = []
    for name in names:
        found = re.search(rf"^([A-Za-z_][\w:<>, ]*?)\s+{name}\s*\(([^()]*)\)\s*\{{", text, re.MULTILINE)
        if found is None:
            raise RuntimeError(f"{path.name} exports {name} but defines no `type {name}(...) {{` at file scope")
        declarations.append(f"{found.group(1)} {name}({found.group(2)});")
    return names, declarations


def _bindings(sources: list[Path]) -> str:
    """The module's one pybind11 file: a declaration and an m.def per exported function."""
    lines, defs = ["#include <torch/extension.h>"], []
    for path in sources:
        names, declarations = _declarations(path, path.read_text())
        lines += declarations
        defs += [f'  m.def("{n}", torch::wrap_pybind_function({n}), "{n}");' for n in names]
    return "\n".join([*lines, "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {", *defs, "}", ""])


def _flags(target: str) -> list[str]:
    native_x86 = target == "native" and platform.machine() == "x86_64"
    return _CFLAGS + TARGETS[target] + (_NATIVE_X86_CFLAGS if native_x86 else [])


def _inputs(sources: list[Path]) -> list[Path]:
    """Every file a build compiles: the sources and the headers they include, in a fixed order."""
    return [*sources, *sorted(_DIR.glob("*.h"))]


def _build_dir(target: str, sources: list[Path], flags: list[str]) -> Path:
    digest = hashlib.sha256(" ".join(flags).encode())
    for path in _inputs(sources):
        digest.update(path.name.encode() + path.read_bytes())
    if target == "native":  # -march=native means this CPU
        digest.update(" ".join(sorted(_cpu_flags())).encode() or platform.processor().encode())
    return Env.read().home / "kernels" / f"{target}-torch{torch.__version__.split('+')[0]}-{digest.hexdigest()[:12]}"


def _ensure_ninja_on_path() -> None:
    """torch's builder runs `ninja`; the PyPI ninja package puts it next to our python."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.insert(0, ninja.BIN_DIR)
    except ImportError:
        pass
    os.environ["PATH"] = os.pathsep.join([*dirs, os.environ.get("PATH", "")])


@contextlib.contextmanager
def _building(build_dir: Path):
    """Hold the build folder for one process at a time, with a lock the kernel releases when its holder
    dies. torch's own `lock` file (a FileBaton: waiters poll until it is deleted) outlives a build that
    was killed (a Ctrl-C during the first build, a timeout), and then every later load waits on it
    forever; under this lock no other threefold process is building here, so such a file is stale."""
    with open(build_dir / ".threefold-build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing a stale kernel build lock left by an interrupted build: %s", stale)
            stale.unlink(missing_ok=True)
        yield


@functools.cache
def build_kernels(target: str = "native") -> ModuleType:
    """Builds (or loads the cached build of) the kernels for `target`, one of TARGETS.
    Raises where it cannot be built; the module's `build_isa()` says which paths it holds."""
    if target not in TARGETS:
        raise ValueError(f"unknown kernel build target {target!r}; choose one of {sorted(TARGETS)}")
    from torch.utils import cpp_extension

    sources, flags = _sources(), _flags(target)
    build_dir = _build_dir(target, sources, flags)
    build_dir.mkdir(parents=True, exist_ok=True)
    _ensure_ninja_on_path()
    logger.info("loading CPU kernels for %s (the first build takes about a minute) from %s", target, build_dir)
    with _building(build_dir):
        staged = _staged(build_dir, sources)
        bindings = build_dir / "bindings.cpp"
        _write_if_changed(bindings, _bindings(sources))
        return cpp_extension.load(
            name="threefold_kernels_" + target.replace("-", "_"), sources=[str(bindings), *map(str, staged)],
            extra_cflags=flags, extra_include_paths=[str(staged[0].parent)], extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir), verbose=False)


def _staged(build_dir: Path, sources: list[Path]) -> list[Path]:
    """Copies of the sources and headers inside the build folder, which is keyed by their content. ninja
    names files by absolute path, so compiling each checkout's own files rebuilt the same kernels in
    every checkout (2-3 minutes each); compiled from these copies, every checkout shares one build."""
    staging = build_dir / "src"
    staging.mkdir(exist_ok=True)
    for path in _inputs(sources):
        _write_if_changed(staging / path.name, path.read_text())
    return [staging / path.name for path in sources]


def _write_if_changed(path: Path, text: str) -> None:
    """Rewritten only on change: an unchanged file keeps its time, so ninja keeps its objects."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


RUN_AS_TARGET = {"avx2": "x86-64-v3"}
"""The build the engine loads on a CPU that runs as a lesser class ($THREEFOLD_CPU_CLASS)."""


def engine_target() -> str:
    """The build the engine runs: native, or that of the class this CPU runs as."""
    return RUN_AS_TARGET.get(run_as_class() or "", "native")


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The engine's build (native, or the build of the class the CPU runs as), or None where
    it cannot be made: callers use torch."""
    apply_run_as()  # torch's own kernels take the class ours are built for
    if Env.read().attention_backend == "torch" or sys.platform != "linux":
        return None
    try:
        return build_kernels(engine_target())
    except Exception as exc:  # noqa: BLE001 — no compiler, no ninja, ...: the torch path still works
        logger.warning("CPU kernels unavailable (%s: %s); using the plain PyTorch attention path",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None


@functools.cache
def few_rows_max(kernels: ModuleType | None) -> int:
    """The row limit for `linear_small` on this build: FEW_ROWS_MAX where it tiles rows (the
    AVX2 path); 2 on AVX-512/AMX builds, where oneDNN's bf16 GEMM wins from a few rows up
    (AMX on the Xeon, BENCHMARKS.md; on the avx512 EPYC, SmolLM2's matrices in bf16: the kernel
    0.77x oneDNN's time at 1-2 rows, 1.03x at 4, 1.25x at 8)."""
    if kernels is None:
        return 0
    return 2 if kernels.build_isa() in ("avx512", "amx") else FEW_ROWS_MAX


def has_int8_linear(kernels: ModuleType | None) -> bool:
    """Whether `kernels.linear_small_int8` (int8 weights, per-row fp32 scales) runs on this
    build: a probe on a tiny input, as `has_few_row_linear`."""
    if kernels is None or not hasattr(kernels, "linear_small_int8"):
        return False
    x, w = torch.zeros(1, 32), torch.zeros(16, 32, dtype=torch.int8)
    return bool(kernels.linear_small_int8(torch.empty(1, 16), x, w, torch.ones(16), None))


def has_few_row_linear(kernels: ModuleType | None, x_dtype: torch.dtype = torch.bfloat16,
                       w_dtype: torch.dtype | None = None) -> bool:
    """Whether `kernels.linear_small` runs on this build for x of `x_dtype` and weights of
    `w_dtype` (default: x's): a probe on a tiny input, once per module and dtype pair. The
    output (and bias) is fp32 unless both are bf16. Without it, keeping plain weights beside
    packed ones, or routing few-row calls to it, would buy nothing."""
    if kernels is None:
        return False
    w_dtype = w_dtype or x_dtype
    out_dtype = torch.bfloat16 if x_dtype == w_dtype == torch.bfloat16 else torch.float32
    x, w = torch.zeros(1, 32, dtype=x_dtype), torch.zeros(16, 32, dtype=w_dtype)
    return bool(kernels.linear_small(torch.empty(1, 16, dtype=out_dtype), x, w, None))
