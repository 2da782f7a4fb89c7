"""The compressed-KV attention kernel (threefold/kernels/kv_attention.cpp) and its Python face.

`kv_kernels()` returns a module with `kv_decode_attention`: the engine's kernel module when
its loader builds every kernels/*.cpp, else kv_attention.cpp built on its own (same flags,
cached under $THREEFOLD_HOME); None where nothing can be built (the torch path then runs).
"""

from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path
from types import ModuleType

import torch

from threefold.kv.codec import KVLayout

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parents[1] / "kernels" / "kv_attention.cpp"
_KINDS = {"int8": 0, "fp8": 1, "int4": 2}
_EMPTY = torch.empty(0)


@functools.cache
def kv_kernels() -> ModuleType | None:
    from threefold import kernels

    module = kernels.cpu_kernels()
    if module is None or hasattr(module, "kv_decode_attention"):
        return module
    return _build_alone()


def _build_alone() -> ModuleType | None:
    import hashlib

    from torch.utils import cpp_extension

    from threefold.env import Env
    from threefold.kernels import _ensure_ninja_on_path

    source = _SOURCE.read_text()
    flags = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
    digest = hashlib.sha256((source + " ".join(flags) + platform.processor()).encode()).hexdigest()[:12]
    build_dir = Env.read().home / "kernels" / f"kv-torch{torch.__version__.split('+')[0]}-{digest}"
    build_dir.mkdir(parents=True, exist_ok=True)
    _ensure_ninja_on_path()
    try:
        return cpp_extension.load_inline(name="threefold_kv_kernels", cpp_sources=source,
                                         functions=["kv_decode_attention"], extra_cflags=flags,
                                         extra_ldflags=["-fopenmp"], build_directory=str(build_dir))
    except Exception as exc:  # no compiler: the torch path still works
        logger.warning("KV kernels unavailable (%s); using the plain PyTorch path", type(exc).__name__)
        return None


def decode_attention(module: ModuleType, out: torch.Tensor, q: torch.Tensor, layout: KVLayout,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int) -> None:
    """out, q [B, H, d]; attends each row over its `seq_lens` keys in place (any codec).
    `module`: the engine's kernels (cpu_kernels()); compressed layouts go to kv_kernels()."""
    if layout.kind == "dense":
        module.paged_decode_attention(out, q, layout.k, layout.v, block_table, seq_lens, scale, window)
        return
    empty = _EMPTY
    kv_kernels().kv_decode_attention(out, q, layout.k, layout.v, layout.k_scales, layout.v_scales,
                               empty if layout.k_zeros is None else layout.k_zeros,
                               empty if layout.v_zeros is None else layout.v_zeros,
                               empty if layout.lut is None else layout.lut,
                               block_table, seq_lens, scale, window, _KINDS[layout.kind])
