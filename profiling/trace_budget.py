"""The trace budget, `max_trace_mb` (docs/profiling.md#trace-budget): how big one window's trace
may get, the estimate that stops a recording before it gets there, and the cut that brings an
exported Chrome trace back under it.

Sizes are of the trace's JSON as exported, before compression: that is what a viewer (Perfetto,
chrome://tracing) has to load, and what makes a huge trace unopenable.
"""

from __future__ import annotations

import io
import json
import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from profiling.analysis.events import HEAD_BYTES, Event, TraceFormat, is_trace_name, iter_events, open_binary, sniff
from profiling.config import ProfileOptions
from profiling.markers import FORWARD_STEP

MIB = 1 << 20
_SEP = b",\n"
_TRACE_EVENTS = b'"traceEvents"'


def budget_bytes(options: ProfileOptions) -> int | None:
    """The window's trace budget in bytes (None: no budget)."""
    return None if options.max_trace_mb is None else int(options.max_trace_mb * MIB)


class StepSizeEstimate:
    """Bytes of trace per forward step, learned from this process's exported traces.

    torch.profiler cannot say how big its trace is while it records, so the session multiplies
    the steps recorded so far by what a step cost in the last trace recorded with the same kind
    of options (the activities and record_shapes/with_stack/with_memory change a step's events
    many times over). Written by the export thread, read by the model thread: one dict
    assignment, atomic under the GIL."""

    def __init__(self) -> None:
        self._per_step: dict[str, float] = {}

    @staticmethod
    def _kind(options: ProfileOptions) -> str:
        return options.model_dump_json(include={"tool", "activities", "record_shapes", "with_stack", "with_memory"})

    def learn(self, options: ProfileOptions, trace_bytes: int, forward_steps: int) -> None:
        """Record what one exported trace cost per forward step (ignored without steps)."""
        if forward_steps > 0:
            self._per_step[self._kind(options)] = trace_bytes / forward_steps

    def next_step_overflows(self, options: ProfileOptions, steps_recorded: int) -> bool:
        """Whether recording one more forward step would take the trace past the budget (False
        with no budget, or nothing learned yet for these options)."""
        budget = budget_bytes(options)
        per_step = self._per_step.get(self._kind(options))
        return budget is not None and per_step is not None and (steps_recorded + 1) * per_step > budget


def json_bytes_over(paths: Iterable[Path], limit: int) -> bool:
    """Whether the Chrome trace files among `paths` hold more than `limit` bytes of JSON in all,
    decompressed as needed. Reading stops once the limit is passed, so the cost is bounded by it."""
    total = 0
    for path in paths:
        if not (path.is_file() and is_trace_name(path.name)):
            continue
        with open_binary(path) as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
                if total > limit:
                    return True
    return False


@dataclass(frozen=True)
class TraceCut:
    """What `cut_trace` kept and dropped."""

    forward_steps_kept: int
    forward_steps_found: int
    events_dropped: int
    bytes_written: int


def cut_trace(src: Path, dst: io.BufferedIOBase, max_trace_mb: float) -> TraceCut:
    """Write into `dst` the part of the Chrome trace `src` that fits in `max_trace_mb`: its header
    and metadata events, and every timed event that starts before the first forward step
    (a `FORWARD_STEP` range, `profiling.markers`) that does not fit. Without such a step boundary that fits, the cut
    falls at the latest event time that fits. The written trace says where and why it was cut: a
    top-level `truncated` object and a global instant event at the cut.

    Two streaming passes over `src` (one event in memory at a time, plus 16 bytes per timed event
    for the sizes); events are re-serialized one field per line without indentation, so what is
    kept is no larger than it was in `src`."""
    budget = int(max_trace_mb * MIB)
    fmt = sniff(src)
    header = _header(src)
    fixed = 0  # metadata and untimed events: always kept
    times, sizes = array("d"), array("q")
    starts: list[float] = []
    ends: list[float] = []
    pid: object = None
    for ev in iter_events(src, fmt):
        size = len(_dump(ev)) + len(_SEP)
        ts = ev.get("ts")
        if ev.get("ph") == "M" or not isinstance(ts, float | int):
            fixed += size
            continue
        times.append(ts)
        sizes.append(size)
        if pid is None or (not starts and _is_forward_step(ev)):
            pid = ev.get("pid")  # the marker's lane: the first forward step's process if any
        if _is_forward_step(ev):
            starts.append(ts)
            ends.append(ts + float(ev.get("dur", 0.0)))
    starts.sort()
    order = np.argsort(np.frombuffer(times, dtype=np.float64), kind="stable")
    sorted_ts = np.frombuffer(times, dtype=np.float64)[order]
    kept_bytes = np.cumsum(np.frombuffer(sizes, dtype=np.int64)[order])
    marker_room = 512  # the instant event and the `truncated` object, generously
    room = budget - len(_open(header, {})) - fixed - marker_room

    # Keeping m steps cuts at the next step's start (after the last one: at its end; past
    # that, nothing is cut: compacted, the whole trace may fit).
    boundaries = [*starts, max(ends), math.inf] if starts else [math.inf]
    before = np.searchsorted(sorted_ts, boundaries, side="left")  # timed events before each
    costs = np.where(before > 0, kept_bytes[np.maximum(before - 1, 0)], 0) if len(sorted_ts) else before
    fitting = int(np.searchsorted(costs, room, side="right"))
    if fitting:
        cut = boundaries[fitting - 1]
        kept = min(fitting - 1, len(starts))
    else:  # not even the events before the first step fit: keep what fits, in time order
        kept = 0
        n = int(np.searchsorted(kept_bytes, room, side="right"))
        cut = float(sorted_ts[n]) if n < len(sorted_ts) else math.inf
    dropped = len(sorted_ts) - int(np.searchsorted(sorted_ts, cut, side="left"))
    lost = f"forward steps {kept}..{len(starts) - 1} and " if kept < len(starts) else ""
    why = f"trace cut at max_trace_mb={max_trace_mb:g}: {lost}{dropped} events from here on dropped"
    note = {"max_trace_mb": max_trace_mb, "forward_steps_kept": kept, "events_dropped": dropped, "reason": why}
    marker = {"ph": "i", "s": "g", "name": why, "pid": pid, "tid": 0, "ts": cut}
    written = _write(src, fmt, dst, header, cut, (note, marker) if dropped else None)
    return TraceCut(kept, len(starts), dropped, written)


def _is_forward_step(ev: Event) -> bool:
    name = ev.get("name")
    return ev.get("ph") == "X" and isinstance(name, str) and name.startswith(FORWARD_STEP)


def _dump(obj: dict[str, object]) -> bytes:
    """`obj` as a JSON object, one top-level field per line as Kineto writes them: readers that
    scan traces line by line (`profiling.step_ranges`) read a cut trace like an uncut one."""
    fields = ",\n".join(f"{json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in obj.items())
    return f"{{\n{fields}\n}}".encode()


def _header(src: Path) -> dict[str, object]:
    """The trace object's keys before `traceEvents` (Kineto writes its metadata there: schema,
    device properties, baseTimeNanoseconds, distributed info). Keys after the events
    (`traceName`, the exporting process's temporary file) are not kept."""
    with open_binary(src) as f:
        head = f.read(HEAD_BYTES)
    at = head.find(_TRACE_EVENTS)
    header: dict[str, object] = json.loads(head[:at] + b'"traceEvents": []}')
    del header["traceEvents"]
    return header


def _open(header: dict[str, object], note: dict[str, object]) -> bytes:
    fields = {**header, "truncated": note} if note else header
    return _dump(fields)[:-1] + (b"," if fields else b"") + b'"traceEvents":[\n'


def _write(
    src: Path,
    fmt: TraceFormat,
    dst: io.BufferedIOBase,
    header: dict[str, object],
    cut: float,
    said: tuple[dict[str, object], Event] | None,
) -> int:
    """Write the events before `cut`; `said`: the `truncated` note and the marker event, when
    something was dropped."""
    note, marker = said or ({}, None)
    written = dst.write(_open(header, note))
    written += dst.write(_dump(marker) if marker else b"")
    first = marker is None
    for ev in iter_events(src, fmt):
        ts = ev.get("ts")
        if ev.get("ph") == "M" or not isinstance(ts, float | int) or ts < cut:
            written += dst.write((b"" if first else _SEP) + _dump(ev))
            first = False
    written += dst.write(b"\n]}\n")
    return written

