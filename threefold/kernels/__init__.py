"""Native CPU kernels, compiled on first use with torch's C++ extension builder.

`cpu_kernels()` returns the built module, or None where it cannot be built
(no compiler, an unsupported platform, or THREEFOLD_ATTENTION=torch); callers
then take their plain-PyTorch path, which computes the same thing. The build
(about a minute on 2 cores) happens once per machine and torch version and is
cached under $THREEFOLD_HOME/kernels; -march=native is safe because the cache
key includes the CPU's flags.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

import torch

from threefold.env import Env

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
_FUNCTIONS = ["paged_decode_attention", "add_rms_norm", "rotary_embedding", "silu_and_mul", "set_amx", "linear_small", "argmax_rows"]
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
"""-fopenmp: at::parallel_for is an OpenMP pragma in ATen's headers (without it, one thread);
the extension's libgomp.so.1 resolves to the copy torch has already loaded. -ffast-math lets
the dot products reassociate (vectorize) and exp use the vector math library."""
_X86_CFLAGS = ["-mprefer-vector-width=512"]  # gcc defaults to 256-bit vectors on Intel


def _cpu_tag() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        flags = platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def _ensure_ninja_on_path() -> None:
    """torch's builder runs `ninja`; the PyPI ninja package puts it next to our python."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.insert(0, ninja.BIN_DIR)
    except ImportError:
        pass
    os.environ["PATH"] = os.pathsep.join([*dirs, os.environ.get("PATH", "")])


@functools.cache
def cpu_kernels() -> ModuleType | None:
    env = Env.read()
    if env.attention_backend == "torch" or sys.platform != "linux":
        return None
    from torch.utils import cpp_extension

    build_dir = env.home / "kernels" / f"torch{torch.__version__.split('+')[0]}-{_cpu_tag()}"
    build_dir.mkdir(parents=True, exist_ok=True)
    _ensure_ninja_on_path()
    logger.info("loading CPU kernels (the first build on a machine takes about a minute) from %s", build_dir)
    try:
        return cpp_extension.load_inline(
            name="threefold_cpu_kernels", cpp_sources=_SOURCE.read_text(), functions=_FUNCTIONS,
            extra_cflags=_CFLAGS + (_X86_CFLAGS if platform.machine() == "x86_64" else []), extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
    except Exception as exc:  # no compiler, no ninja, ...: the torch path still works
        logger.warning("CPU kernels unavailable (%s: %s); using the plain PyTorch attention path",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None


@functools.cache
def has_few_row_linear(kernels: ModuleType | None) -> bool:
    """Whether `kernels.linear_small` runs on this build (it needs AVX-512): a probe on a tiny
    input, once per module. Without it, keeping plain bf16 weights beside the packed ones, or
    routing few-row calls to it, would buy nothing."""
    if kernels is None:
        return False
    x, w = torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(16, 32, dtype=torch.bfloat16)
    return bool(kernels.linear_small(torch.empty(1, 16, dtype=torch.bfloat16), x, w, None))
