"""Giving freed memory back to the operating system after a trace export.

A recording's events take hundreds of MB of native memory. glibc keeps freed memory mapped in
its arenas, so without a trim a process keeps the high-water mark of its exports (measured, in a
loop profiling and exporting 120 recordings: a flat 574 MB RSS without the trim, 517 MB with it).
Elsewhere this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def release_freed_memory() -> None:
    """Return free heap pages to the OS (glibc's malloc_trim), where the C library has it."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
