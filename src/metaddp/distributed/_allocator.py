"""Freed CPU memory kept for the next step, not returned to the operating system.

glibc's ``malloc`` serves a large block (from 128 KiB, rising with use to at most 32 MiB) by
mapping fresh pages, and unmaps them when the block is freed. A stacked meta-step on the
CPU allocates many such blocks (a Conv-4 step over 8 tasks: activations of 128 MiB), so
every step pays to fault in and zero its memory again. Measured on one CPU thread
(``benchmarks/deterministic_cost.py``): a deterministic Conv-4 meta-step took 5.4 s with
glibc's defaults and 3.5 s with freed blocks kept; the default mode's, 2.9 s and 2.4 s.

:func:`keep_freed_memory` raises the mapping threshold and the trim threshold, so that
blocks come from and return to the process's heap, as PyTorch's CUDA caching allocator
keeps GPU memory. The process's resident size then stays at its peak. ``metaddp.init`` and
the command line call it; ``METADDP_KEEP_FREED_MEMORY=0`` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os
import platform

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 2**30  # blocks up to 1 GiB come from the heap
_TRIM_THRESHOLD = 2**31 - 1  # the largest value mallopt takes: the heap is not trimmed
ENV = "METADDP_KEEP_FREED_MEMORY"

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Keep freed CPU memory in the process for reuse (glibc on Linux); ``True`` if set.

    Idempotent. Does nothing elsewhere, or where the environment sets
    ``METADDP_KEEP_FREED_MEMORY=0``.
    """
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get(ENV, "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )
    return _done
