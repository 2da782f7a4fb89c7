"""The one reader of environment variables (read when asked, never at import)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Env:
    home: Path
    """Where pulled models and caches live: $THREEFOLD_HOME, default ~/.cache/threefold."""
    num_threads: int | None
    """Torch intra-op threads: $THREEFOLD_NUM_THREADS, default torch's own choice."""
    attention_backend: str
    """$THREEFOLD_ATTENTION: "auto" (default: the compiled CPU kernel where it builds) or "torch"."""
    cpu_class: str | None = None
    """$THREEFOLD_CPU_CLASS: run as a lesser CPU class than this one ("avx2"): the dtype
    choice, the kernel build and the benchmark records take that class (see threefold/cpu.py)."""

    @classmethod
    def read(cls) -> Env:
        home = os.environ.get("THREEFOLD_HOME") or str(Path.home() / ".cache" / "threefold")
        threads = os.environ.get("THREEFOLD_NUM_THREADS")
        return cls(home=Path(home).expanduser(), num_threads=int(threads) if threads else None,
                   attention_backend=os.environ.get("THREEFOLD_ATTENTION", "auto"),
                   cpu_class=os.environ.get("THREEFOLD_CPU_CLASS") or None)
