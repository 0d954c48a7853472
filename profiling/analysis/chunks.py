"""Fast, bounded-memory reading of large Chrome traces: events in chunks, and clock markers by
byte search.

Kineto (and so torch, and every backend and engine that records with it) writes one event after another at a
fixed indentation: `traceEvents` is `[\\n  {...},\\n  {...}...]`. JSON strings cannot hold a raw
newline, so `,<newline><indent>{` only ever appears between tokens; a cut there that splits an
event's own nesting leaves an unbalanced piece that fails to parse. So the events are read in
blocks, each cut at its last such separator and decoded at once with msgspec into `TraceEvent`
structs (`args` kept as raw bytes, never parsed), at several times the speed of an event-by-event
parser. Files laid out otherwise (compact JSON) fall back to `events.iter_events` (ijson): right,
only slower. A chunk holding a field `TraceEvent` does not declare is decoded as plain dicts, so
nothing in an input is ever dropped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import msgspec
from typing_extensions import TypeIs

from profiling.analysis.events import PROGRESS_EVERY, Event, TraceFormat, decompressed, iter_events

BLOCK_BYTES = 1 << 20
"""Bytes decoded at once. The chunk's events (structs, raw args) take a few times this; larger
blocks were slower as well as larger here (1 MiB: 119 MB/s and 52 MiB peak RSS merging 525 MB;
8 MiB: 104 MB/s and 177 MiB), the working set falling out of the CPU caches."""
SEARCH_BLOCK_BYTES = 4 << 20
"""Bytes searched at once for clock markers (no objects are made: larger is cheaper)."""
UNSET: Any = msgspec.UNSET


class TraceEvent(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """One Chrome trace event, with every field the Trace Event Format defines that Kineto and
    Perfetto write; `args` and other nested values stay raw JSON."""

    # Kineto's order first: msgspec matches keys fastest in declaration order.
    ph: Any = UNSET
    cat: Any = UNSET
    name: Any = UNSET
    pid: Any = UNSET
    tid: Any = UNSET
    ts: Any = UNSET
    dur: Any = UNSET
    args: msgspec.Raw | msgspec.UnsetType = UNSET
    id: Any = UNSET
    bp: Any = UNSET
    s: Any = UNSET
    bind_id: Any = UNSET
    tts: Any = UNSET
    tdur: Any = UNSET
    id2: msgspec.Raw | msgspec.UnsetType = UNSET
    scope: Any = UNSET
    cname: Any = UNSET
    flow_in: Any = UNSET
    flow_out: Any = UNSET
    sf: Any = UNSET
    stack: msgspec.Raw | msgspec.UnsetType = UNSET


Chunk = list[TraceEvent] | list[Event]
"""A chunk's events: structs, or plain dicts where a struct could not hold one of them."""


def are_structs(chunk: Chunk) -> TypeIs[list[TraceEvent]]:
    """Whether the chunk was decoded as `TraceEvent`s (else: dicts)."""
    return bool(chunk) and isinstance(chunk[0], TraceEvent)


_as_structs = msgspec.json.Decoder(list[TraceEvent])
_as_dicts = msgspec.json.Decoder(list[Any])
_events_open = re.compile(rb'"traceEvents"\s*:\s*\[')


def iter_chunks(path: Path, fmt: TraceFormat, on_progress: Callable[[int], None] | None = None) -> Iterator[Chunk]:
    """Every event of the trace, in file order, in chunks. `on_progress(n)`: on-disk bytes read
    since its last call. Raises ValueError (or the decompressor's error) for a trace that is cut
    off or is not valid JSON."""
    with open(path, "rb") as raw, decompressed(path, raw) as f:
        head = f.read(BLOCK_BYTES)
        start, sep = _layout(head, fmt)
        if sep is None:
            yield from _batched(iter_events(path, fmt, on_progress))
            return
        reported = 0

        def progress() -> None:
            nonlocal reported
            if on_progress is not None:
                pos = raw.tell()
                on_progress(pos - reported)
                reported = pos

        rest = head[start:]
        while True:
            block = f.read(BLOCK_BYTES)
            if not block:
                break
            cut = block.rfind(sep)
            if cut < 0:
                rest += block
                continue
            # one copy of the block (memoryview slices are not copied before the join)
            yield _decode(b"".join((b"[", rest, memoryview(block)[:cut], b"]")))
            rest = block[cut + 1 :]
            progress()
        yield from _last(rest)
        if on_progress is not None:
            on_progress(path.stat().st_size - reported)


def _layout(head: bytes, fmt: TraceFormat) -> tuple[int, bytes | None]:
    """Where the first event starts in `head`, and the separator between events (None: a
    layout this module does not split)."""
    if fmt.events_prefix == "item":
        at = head.find(b"[") + 1
    else:
        m = _events_open.search(head)
        if m is None:
            return 0, None
        at = m.end()
    brace = head.find(b"{", at)
    indent = head[at:brace]
    if brace < 0 or b"\n" not in indent or indent.strip():
        return 0, None
    return brace, b"," + indent[indent.rfind(b"\n") :] + b"{"


def _decode(text: bytes) -> Chunk:
    """The events of `text`, a JSON array."""
    try:
        return _as_structs.decode(text)
    except msgspec.ValidationError:
        # a field TraceEvent does not declare (or a value of another shape): keep it as it is
        return [e for e in _as_dicts.decode(text) if isinstance(e, dict)]
    except msgspec.DecodeError as e:
        raise ValueError(f"invalid JSON in the trace's events ({e})") from None


def _last(buf: bytes) -> Iterator[Chunk]:
    """The events left after the last separator: the final event, then `]` and the rest of the
    object (Kineto writes more keys after `traceEvents`)."""
    end = _end_of_array(buf)
    if end is None:
        raise ValueError("the trace is cut off: its traceEvents array never closes")
    if buf[:end].strip():
        yield _decode(b"[" + buf[:end] + b"]")


def _end_of_array(buf: bytes) -> int | None:
    """Offset of the `]` closing the events array in `buf` (which starts at an event): after
    the first `}` at which the text before it parses as events."""
    for m in re.finditer(rb"\}\s*\]", buf):
        try:
            _as_dicts.decode(b"[" + buf[: m.start() + 1] + b"]")
        except msgspec.DecodeError:
            continue
        return m.start() + 1
    return 0 if buf.lstrip().startswith(b"]") else None


def _batched(events: Iterator[Event]) -> Iterator[list[Event]]:
    batch: list[Event] = []
    for ev in events:
        batch.append(ev)
        if len(batch) == PROGRESS_EVERY:
            yield batch
            batch = []
    if batch:
        yield batch


def find_markers(path: Path, names: frozenset[str]) -> dict[str, Event] | None:
    """The first event named each of `names`, found by byte search without parsing the trace
    (None: an event could not be read where a name was found; parse the trace instead)."""
    found: dict[str, Event] = {}
    quoted = {name: msgspec.json.encode(name) for name in names}
    with open(path, "rb") as raw:
        for buf, final in _windows(path, raw):
            for name in names - found.keys():
                at = _find_name(buf, quoted[name])
                if at < 0:
                    continue
                event = _event_around(buf, at)
                if event is None and not final:
                    continue  # cut off by the window's end: whole in the next window
                if event is None or event.get("name") != name:
                    return None
                found[name] = event
            if len(found) == len(names):
                break
    return found


_OVERLAP = 256 * 1024
"""Bytes each window repeats of the one before: a marker event is far smaller."""


def _windows(path: Path, raw: IO[bytes]) -> Iterator[tuple[bytes, bool]]:
    """The file's (decompressed) bytes to search, in overlapping blocks: (block, is-the-last)."""
    with decompressed(path, raw) as f:
        buf = b""
        while block := f.read(SEARCH_BLOCK_BYTES):
            buf = buf[-_OVERLAP:] + block
            yield buf, False
        yield buf, True


def _find_name(buf: bytes, quoted: bytes) -> int:
    """Position of the value in `"name": <quoted>` in buf (any spacing around the colon), or -1."""
    start = 0
    while (at := buf.find(quoted, start)) >= 0:
        before = buf[max(0, at - 32) : at].rstrip()
        if before.endswith(b":") and before[:-1].rstrip().endswith(b'"name"'):
            return at
        start = at + 1
    return -1


def _event_around(buf: bytes, at: int) -> Event | None:
    """The event holding the `name` found at `at`: from the last `{` before it to the first `}`
    after it at which that text parses (None: none within buf)."""
    begin = buf.rfind(b"{", max(0, at - _OVERLAP // 2), at)
    if begin < 0:
        return None
    end = at
    for _ in range(64):
        end = buf.find(b"}", end) + 1
        if end <= 0:
            return None
        try:
            event = msgspec.json.decode(buf[begin:end])
        except msgspec.DecodeError:
            continue
        return event if isinstance(event, dict) else None
    return None
