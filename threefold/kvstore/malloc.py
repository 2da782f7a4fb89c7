"""Keep glibc's malloc from returning heap memory to the kernel at every free, once the store runs.

The store allocates a payload (one block's bytes, 360 KiB for SmolLM2) for every block written through
and frees it when the writer has written it (or L2 evicts it): hundreds of MiB a minute on a busy
engine, freed from the writer thread into the heap the engine's tensors come from. With glibc's
defaults (a trim threshold that follows the mmap threshold), the heap is trimmed and grown again over
and over, and the model's own allocations pay for it: page faults and lock waits that no thread's CPU
time shows. On a 2-core AMD EPYC (avx512 class), a saturating no-reuse stream with the disk tier cost
+4.04% of throughput with the defaults and +1.60% with these settings (BENCHMARKS.md, KV tiers,
2026-12-05); the engine alone ran the same with either. The cost is memory that stays mapped after a
burst: at most M_TRIM_THRESHOLD bytes of free heap (a server keeps its L2 full anyway).

Process-wide, so set once, only where the store runs, and never over a user's own settings
(MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_, MALLOC_MMAP_THRESHOLD_, or glibc.malloc tunables in GLIBC_TUNABLES).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # malloc.h
TRIM_THRESHOLD = 1 << 30
"""Free bytes at the heap's top before glibc gives them back: above the writer queue and a burst's tensors."""
TOP_PAD = 64 << 20
"""Bytes the heap grows by beyond a request: fewer, larger extensions."""
MMAP_THRESHOLD = 32 << 20
"""Requests at least this large get a mapping of their own (glibc's ceiling): smaller ones, a payload among
them, come from the heap and reuse its free chunks, instead of a fresh mapping to fault in and unmap."""



@functools.cache
def keep_heap_mapped() -> bool:
    """Apply the settings once per process; whether they are in force (False off glibc, or where the user
    chose their own)."""
    if any(name in os.environ for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_")) \
            or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        logger.debug("malloc: the environment sets its own; left as it is")
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: libc's, wherever it lies
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:  # not glibc (musl, macOS): nothing to tune
        return False
    tuned = all([mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD), mallopt(M_TOP_PAD, TOP_PAD),
                 mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)])
    logger.debug("malloc: trim threshold %d, top pad %d: %s", TRIM_THRESHOLD, TOP_PAD, tuned)
    return tuned
