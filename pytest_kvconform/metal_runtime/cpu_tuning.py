"""Opt-in glibc allocator tuning for MLX on Linux CPU (glibc ``mallopt(3)``; see docs/metal-runtime.md).

MLX's CPU allocator does not cache large buffers, so every op on a big temporary pays fresh
page faults (16k faults for 64 MiB). Raising glibc's mmap and trim thresholds keeps freed memory
in the heap and removes them. It is process-wide, so nothing calls it implicitly; the
benchmarks call it for the paged and the dense paths alike.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_cpu_allocator(mmap_threshold: int = 1 << 30, trim_threshold: int = 2**31 - 1) -> bool:
    """Set glibc's mmap/trim thresholds (like ``MALLOC_MMAP_THRESHOLD_``); True if both applied."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok_mmap = mallopt(_M_MMAP_THRESHOLD, min(mmap_threshold, 2**31 - 1)) == 1
    ok_trim = mallopt(_M_TRIM_THRESHOLD, min(trim_threshold, 2**31 - 1)) == 1
    return ok_mmap and ok_trim
