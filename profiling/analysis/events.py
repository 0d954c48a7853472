"""Streaming access to Chrome trace files (`.json` / `.json.gz`, object or array form).

Events are parsed one at a time with ijson, so reading a trace costs memory for one event, not
for the file. `sniff` decides from a file's head whether it is a Chrome trace at all.
"""

from __future__ import annotations

import io
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import ijson
from isal import igzip

TRACE_SUFFIXES = (".json", ".json.gz")
CAPTURE_NOTE_SUFFIX = "nsys_capture.json"
"""How the name of an nsys capture note ends (the nsys backend's, SGLang's adapter's): JSON
beside the traces, but no trace: nsys writes its report elsewhere."""


def is_trace_name(name: str) -> bool:
    """Whether a file is read as a Chrome trace, by its name: `.json` or `.json.gz`, but not a
    capture note."""
    return name.endswith(TRACE_SUFFIXES) and not name.endswith(CAPTURE_NOTE_SUFFIX)

HEAD_BYTES = 256 * 1024
"""How much of a file `sniff` reads: Kineto writes its header (and `baseTimeNanoseconds`)
before `traceEvents`, well within this."""
PROGRESS_EVERY = 20_000
_BASE_TIME = re.compile(rb'"baseTimeNanoseconds"\s*:\s*(\d+)')
_TRACE_EVENTS = b'"traceEvents"'

Event = dict[str, Any]


class NotATrace(ValueError):
    """The file is not a Chrome trace this module can read; the message says why."""


@dataclass(frozen=True)
class TraceFormat:
    """Where a trace's events are and what its header says."""

    events_prefix: str
    """ijson prefix of the events: `traceEvents.item` (object form) or `item` (array form)."""
    base_ns: int | None
    """`baseTimeNanoseconds`: absolute time of `ts == 0` (None: the header has none)."""


def open_binary(path: Path) -> io.BufferedIOBase:
    """The file's decompressed bytes (gzip by suffix, gunzipped by ISA-L: several times zlib's
    speed)."""
    return igzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def decompressed(path: Path, raw: IO[bytes]) -> IO[bytes]:
    """`raw`, the open file `path`, as its decompressed bytes (like `open_binary`, for readers
    that report progress from `raw.tell()`)."""
    return igzip.GzipFile(fileobj=raw, mode="rb") if path.name.endswith(".gz") else raw  # type: ignore[return-value]


def sniff(path: Path) -> TraceFormat:
    """The trace's format, or NotATrace naming why this file is not one."""
    if not is_trace_name(path.name):
        raise NotATrace("not a .json or .json.gz file, or an nsys capture note")
    try:
        with open_binary(path) as f:
            head = f.read(HEAD_BYTES)
    except (OSError, EOFError, zlib.error) as e:
        raise NotATrace(f"unreadable ({e})") from e
    body = head.lstrip()
    if body.startswith(b"["):
        return TraceFormat("item", None)
    if not body.startswith(b"{"):
        raise NotATrace("not a JSON object or array")
    at = body.find(_TRACE_EVENTS)
    if at < 0:
        raise NotATrace(f"no traceEvents in its first {HEAD_BYTES // 1024} KiB: not a Chrome trace")
    base = _BASE_TIME.search(body, 0, at)
    return TraceFormat("traceEvents.item", int(base.group(1)) if base else None)


def iter_events(
    path: Path, fmt: TraceFormat, on_progress: Callable[[int], None] | None = None
) -> Iterator[Event]:
    """Every event of the trace, in file order. `on_progress(n)` is called with the number of
    on-disk bytes read since its last call (for progress bars)."""
    with open(path, "rb") as raw:
        stream = decompressed(path, raw)
        reported = 0
        for i, ev in enumerate(ijson.items(stream, fmt.events_prefix, use_float=True), 1):
            if isinstance(ev, dict):
                yield ev
            if on_progress is not None and i % PROGRESS_EVERY == 0:
                pos = raw.tell()
                on_progress(pos - reported)
                reported = pos
        if on_progress is not None:
            on_progress(path.stat().st_size - reported)
