"""A step as trace tools load it: `step_<k>/ranks/`, every trace of the step as one rank.

Holistic Trace Analysis (`TraceAnalysis(trace_dir=...)`) lists one directory without descending
and takes every `*.json` / `*.gz` in it for a trace, keyed by the first `"rank": <n>` it finds
(its `distributedInfo.rank`); TensorBoard's profiler plugin takes a directory holding
`*.pt.trace.json[.gz]` files for a run and each file's name before `.pt.trace.json` for a worker.
A step's traces sit one directory per process, beside the step's own records and merged timeline,
and every engine profiler that writes `distributedInfo` writes its own process group's rank
(an engine's single-GPU workers all say rank 0), so neither tool can load a step as written.

`build_tool_view` writes the directory both tools load: one file per trace, named
`rank<r>-<process>[-<n>].pt.trace.json[.gz]`, whose `distributedInfo` says `rank` r and
`world_size` (the step's number of traces). Ranks are the timeline's order (trainer ranks first,
then replicas by id; a process's files in manifest order). A trace that already says exactly that
is linked (a relative symlink, no copy); any other is rewritten: its header's `distributedInfo` is
replaced (or added), the events copied as they are, gzip level 1 (a stream, one event's memory).
Last, `view.record` (not a name either tool reads) records the view and the step's records
digest: a view whose digest is current is not rebuilt by `only_if_stale`, as the background merge
asks (`background_merge`: every settled step gets its view without a command).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Literal

from isal import igzip
from pydantic import ValidationError

from profiling.analysis.events import HEAD_BYTES, open_binary
from profiling.analysis.sources import TraceInput, find_inputs, load_manifest
from profiling.config import StrictModel
from profiling.store import TraceStore, atomic_write_text

VIEW_DIR = "ranks"
VIEW_RECORD = "view.record"
"""The view's record (a ToolView, JSON) in `ranks/`, written last: neither HTA (`*.json`, `*.gz`)
nor the plugin (`*.pt.trace.json[.gz]`) takes it for a trace."""
VIEW_LOCK = ".view.lock"
"""Serialises the step's view builders (the background merge of the app and of the trainer, the
command): each checks the digest after taking it, and two renames never race."""
GZIP_LEVEL = 1
"""A rewrite recompresses the whole trace: ISA-L's level 1, many times faster than torch's zlib 9."""
_CHUNK = 1 << 20
_DIST_KEY = b'"distributedInfo"'
_HTA_RANK = re.compile(rb'"rank":[^\S\n]+(\d+)')
"""How HTA finds a file's rank: the first line matching `"rank":\\s+(\\d+)` (so `"rank":0`,
without a space, is no rank to it)."""


class ViewError(OSError):
    """The view was not written; the message names the cause and the fix. The step's traces are
    intact (the view only reads them). An OSError, as the writes that fail are."""


class ViewFile(StrictModel):
    """One trace in the view."""

    rank: int
    name: str
    """The file's name in the view directory."""
    source: str
    """The trace it shows, relative to the step directory (as the manifest lists it)."""
    process: str
    """`trainer/rank_<r>` or `rollout/<replica_id>`."""
    how: Literal["link", "rewritten"]
    """`link`: a symlink to the trace, which already said this rank and world size; `rewritten`:
    a copy whose `distributedInfo` was replaced or added."""


class ToolView(StrictModel):
    """What `build_tool_view` wrote (also its `view.record`)."""

    step: int
    directory: str
    digest: str
    """The step's records digest (`TraceStore.records_digest`) the view was built from."""
    world_size: int
    files: list[ViewFile]
    skipped: list[str]
    """`'<file>: <why>'` for each file of the step's entries that is not a trace."""
    rewritten_bytes: int
    """Bytes read from the traces that were rewritten (on disk)."""
    duration_s: float


def build_tool_view(store: TraceStore, step: int, *, only_if_stale: bool = False) -> ToolView | None:
    """(Re)write `step_<k>/ranks/` from the step's records; any earlier view is replaced whole,
    and a reader never sees a half-written one (built aside, then renamed into place). The step
    is held while the view is written (`TraceStore.writing`), so retention keeps it meanwhile.
    `only_if_stale`: return None without writing when the view was built from the same records
    (its record's digest matches) and every file of it is still there. StepNotFound for no such
    step; ViewError for any failure to write it."""
    began = time.monotonic()
    step_dir = store.step_dir(step)
    load_manifest(store, step)  # StepNotFound before any lock file is made
    try:
        with store.writing(step), open(step_dir / VIEW_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            digest = store.records_digest(step)
            if only_if_stale and _is_current(step_dir / VIEW_DIR, digest):
                return None
            inputs, skipped = find_inputs(step_dir, load_manifest(store, step))
            files, rewritten = _write_view(step_dir, inputs)
            view = ToolView(
                step=step,
                directory=str(step_dir / VIEW_DIR),
                digest=digest,
                world_size=len(inputs),
                files=files,
                skipped=skipped,
                rewritten_bytes=rewritten,
                duration_s=round(time.monotonic() - began, 3),
            )
            # Last: a view without its record (a build cut short here) is stale, so rebuilt.
            atomic_write_text(step_dir / VIEW_DIR / VIEW_RECORD, view.model_dump_json(indent=2))
    except Exception as e:  # every failure of the view is reported as one, naming the fix
        raise ViewError(
            f"step {step}'s ranks view not written ({type(e).__name__}: {e}); the step's traces are intact, "
            f"the view only reads them: fix that, then run `python -m profiling ranks {store.root} --step {step}`"
        ) from e
    return view


def _is_current(view: Path, digest: str) -> bool:
    """Whether the view at `view` was built from the records of `digest` and is all there (every
    file present, a link's trace too). A record that cannot be read is stale: it is rebuilt."""
    try:
        record = ToolView.model_validate_json((view / VIEW_RECORD).read_bytes())
    except (OSError, ValidationError):
        return False
    return record.digest == digest and all((view / f.name).exists() for f in record.files)


def _write_view(step_dir: Path, inputs: list[TraceInput]) -> tuple[list[ViewFile], int]:
    """Build `ranks/` aside and rename it into place; returns its files and the bytes rewritten.
    OSError, before anything is written, when the copies would not fit on the step's disk."""
    view = step_dir / VIEW_DIR
    names = _names(inputs)
    infos = [{"rank": rank, "world_size": len(inputs)} for rank in range(len(inputs))]
    links = [_says(inp.path, info) for inp, info in zip(inputs, infos, strict=True)]
    _check_room(step_dir, sum(inp.size for inp, link in zip(inputs, links, strict=True) if not link))
    building = step_dir / f".{VIEW_DIR}.{os.getpid()}.tmp"
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir()
    files, rewritten = [], 0
    try:
        for rank, (inp, name, info, link) in enumerate(zip(inputs, names, infos, links, strict=True)):
            if link:
                (building / name).symlink_to(os.path.relpath(inp.path, view))
                how: Literal["link", "rewritten"] = "link"
            else:
                _rewrite(inp.path, building / name, info)
                rewritten += inp.size
                how = "rewritten"
            files.append(ViewFile(rank=rank, name=name, source=inp.rel, process=_process(inp), how=how))
        old = step_dir / f".{VIEW_DIR}.{os.getpid()}.old"
        if view.is_symlink() or view.is_file():
            view.unlink()
        elif view.exists():
            view.rename(old)
        building.rename(view)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return files, rewritten


def _check_room(step_dir: Path, need: int) -> None:
    """OSError unless the rewritten copies (about their traces' size on disk) fit: a view must
    not fill the disk the next step's traces are exported to."""
    free = shutil.disk_usage(step_dir).free
    if free < need:
        raise OSError(
            f"{step_dir.name} has {free / 2**20:.1f} MiB free and the view needs about {need / 2**20:.1f} MiB "
            "for the traces it rewrites; free disk space"
        )


def _process(inp: TraceInput) -> str:
    e = inp.entry
    return f"trainer/rank_{e.rank or 0}" if e.role == "trainer" else f"rollout/{e.replica_id}"


def _names(inputs: list[TraceInput]) -> list[str]:
    """`rank<r>-trainer-rank_<n>` (`...-rank_<n>-tp<t>-pp<p>` with Megatron's coordinates) /
    `rank<r>-rollout-<id>`, `-<i>` for a process's i-th file
    (i >= 1). The plugin names a worker by what precedes `.pt.trace.json` (a `.<digits>` just
    before it would be read as a span), so a name has no other dot."""
    seen: dict[str, int] = {}
    names = []
    for rank, inp in enumerate(inputs):
        process = _process(inp).replace("/", "-").replace(".", "_")
        if (grid := inp.entry.parallel) is not None:  # Megatron's coordinates: rank_1-tp1-pp0
            process += "-" + grid.label.replace(" ", "-")
        n = seen.get(process, 0)
        seen[process] = n + 1
        suffix = ".pt.trace.json.gz" if inp.path.name.endswith(".gz") else ".pt.trace.json"
        names.append(f"rank{rank}-{process}" + (f"-{n}" if n else "") + suffix)
    return names


def _says(path: Path, info: dict[str, int]) -> bool:
    """Whether the trace's header already carries `info` as its `distributedInfo` (rank and
    world size) and HTA would read that rank from it."""
    with open_binary(path) as f:
        head = f.read(HEAD_BYTES)
    span = _dist_span(head)
    if span is None:
        return False
    found = json.loads(head[span[0] : span[1]])
    hta_rank = _HTA_RANK.search(head)
    return (
        isinstance(found, dict)
        and found.get("rank") == info["rank"]
        and found.get("world_size") == info["world_size"]
        and hta_rank is not None
        and int(hta_rank.group(1)) == info["rank"]
    )


def _dist_span(head: bytes) -> tuple[int, int] | None:
    """Where the value of the header's `distributedInfo` is in `head`: an object form trace's
    top-level key before `traceEvents` (Kineto writes its metadata there)."""
    at = head.find(_DIST_KEY)
    events = head.find(b'"traceEvents"')
    if at < 0 or (0 <= events < at):
        return None
    colon = head.index(b":", at + len(_DIST_KEY))
    text = head[colon + 1 :].decode("utf-8", errors="replace")
    lead = len(text) - len(text.lstrip())
    try:
        _, end = json.JSONDecoder().raw_decode(text, lead)
    except json.JSONDecodeError:
        return None  # cut by HEAD_BYTES or malformed: rewrite it
    start = colon + 1 + lead
    return start, start + len(text[lead:end].encode("utf-8"))


def _rewrite(src: Path, dst: Path, info: dict[str, int]) -> None:
    """Copy the trace to `dst` with `distributedInfo: info` in its header, streaming."""
    value = json.dumps(info).encode()  # `"rank": 3`, with the space HTA's pattern needs
    gz = dst.name.endswith(".gz")
    with (
        igzip.open(dst, "wb", compresslevel=GZIP_LEVEL) if gz else open(dst, "wb")  # created before src is read
    ) as out, open_binary(src) as f:
        head = f.read(HEAD_BYTES)
        body = head.lstrip()
        if body.startswith(b"["):  # array form: wrap it as the object form that can say its rank
            out.write(b'{"distributedInfo": ' + value + b', "traceEvents": ' + body)
            shutil.copyfileobj(f, out, _CHUNK)
            out.write(b"}")
            return
        span = _dist_span(head)
        if span is not None:
            out.write(head[: span[0]] + value + head[span[1] :])
        else:
            brace = head.index(b"{")
            out.write(head[: brace + 1] + b'\n  "distributedInfo": ' + value + b"," + head[brace + 1 :])
        shutil.copyfileobj(f, out, _CHUNK)
