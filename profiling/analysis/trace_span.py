"""When a Chrome trace's events begin and end in absolute time, which host recorded it, and how
many ranges of one name it holds: one streamed pass (`chunks.iter_chunks`), memory flat whatever
the trace's size.

Kineto writes `ts` in microseconds after `baseTimeNanoseconds`, and a recording's whole-window
span (`PyTorch Profiler (0)`, category `Trace`) from the profiler's start to its stop, so a
trace's first and last events are its recording window on the recording host's wall clock (as
torch maps its clock to it: docs/analysis.md#how-clocks-are-aligned). Kineto's header names the
host (`host_name`) before the events.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from profiling.analysis.chunks import Chunk, are_structs, iter_chunks
from profiling.analysis.clocks import EPOCH_US_FLOOR
from profiling.analysis.events import HEAD_BYTES, TraceFormat, open_binary, sniff

_HOST = re.compile(rb'"host_name"\s*:\s*"([^"\\]*)"')
_ANNOTATION = "user_annotation"
_RANGE_PHASES = ("X", "B")


class NoAbsoluteTime(ValueError):
    """The trace's timestamps are not tied to wall-clock time (no `baseTimeNanoseconds`, and `ts`
    is not unix microseconds), so its window cannot be placed."""


class TraceSpan(BaseModel):
    """One trace's recording window and what else one pass over it tells."""

    first_ns: int
    """Unix nanoseconds of its earliest event (the recording's start)."""
    last_ns: int
    """Unix nanoseconds of its latest event's end (the recording's stop)."""
    host: str | None = None
    """The host Kineto's header names (None: the header names none)."""
    ranges: int = 0
    """CPU annotation ranges whose name starts with the prefix asked for (0 when none was)."""


class Extent:
    """The earliest start and latest end (in the trace's `ts`, microseconds) of the events fed to
    it, metadata events aside."""

    def __init__(self) -> None:
        self.lo: float | None = None
        self.hi: float | None = None

    def see(self, chunk: Chunk) -> None:
        """Take in one chunk of events."""
        if are_structs(chunk):
            times = [(e.ts, e.dur) for e in chunk if e.ph != "M" and isinstance(e.ts, int | float)]
        else:
            times = [
                (e["ts"], e.get("dur")) for e in chunk if e.get("ph") != "M" and isinstance(e.get("ts"), int | float)
            ]
        if not times:
            return
        lo = min(ts for ts, _ in times)
        hi = max(ts + (dur if isinstance(dur, int | float) else 0) for ts, dur in times)
        self.lo = lo if self.lo is None else min(self.lo, lo)
        self.hi = hi if self.hi is None else max(self.hi, hi)

    def unix_ns(self, fmt: TraceFormat, path: Path) -> tuple[int, int]:
        """(first, last) in unix nanoseconds; NoAbsoluteTime when the trace cannot say."""
        if self.lo is None or self.hi is None:
            raise NoAbsoluteTime(f"{path.name} holds no timed event")
        if fmt.base_ns is None and self.lo < EPOCH_US_FLOOR:
            raise NoAbsoluteTime(
                f"{path.name} has no baseTimeNanoseconds and its ts is not unix time: its window cannot be placed"
            )
        base = fmt.base_ns or 0
        return base + round(self.lo * 1000), base + round(self.hi * 1000)


def count_ranges(chunk: Chunk, prefix: str) -> int:
    """CPU annotation ranges in `chunk` whose name starts with `prefix` (the GPU twin of a range,
    `gpu_user_annotation`, is not counted)."""
    if are_structs(chunk):
        return sum(
            1
            for e in chunk
            if e.cat == _ANNOTATION and e.ph in _RANGE_PHASES and isinstance(e.name, str) and e.name.startswith(prefix)
        )
    return sum(
        1
        for e in chunk
        if e.get("cat") == _ANNOTATION and e.get("ph") in _RANGE_PHASES and str(e.get("name", "")).startswith(prefix)
    )


def read_span(path: Path, prefix: str | None = None, on_progress: Callable[[int], None] | None = None) -> TraceSpan:
    """The trace's window, host and (with `prefix`) count of ranges named so. Raises NotATrace,
    NoAbsoluteTime, or the reader's error for a trace that is cut off or not valid JSON."""
    fmt = sniff(path)
    with open_binary(path) as f:
        head = f.read(HEAD_BYTES)
    host = _HOST.search(head, 0, max(head.find(b'"traceEvents"'), 0))
    extent, ranges = Extent(), 0
    for chunk in iter_chunks(path, fmt, on_progress):
        extent.see(chunk)
        if prefix is not None:
            ranges += count_ranges(chunk, prefix)
    first, last = extent.unix_ns(fmt, path)
    return TraceSpan(first_ns=first, last_ns=last, host=host.group(1).decode() if host else None, ranges=ranges)


def clock_text(ns: int) -> str:
    """A unix time as the local wall clock, to the millisecond."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns // 10**9)) + f".{ns % 10**9 // 10**6:03d}"


def span_text(start_ns: int, stop_ns: int) -> str:
    """`<start> to <stop>` (the stop's date left out when it is the start's)."""
    a, b = clock_text(start_ns), clock_text(stop_ns)
    return f"{a} to {b[11:] if a[:10] == b[:10] else b}"
