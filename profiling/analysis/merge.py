"""Merge a step's traces into one Perfetto-loadable Chrome trace: `step_<k>/merged.trace.json.gz`.

Every process (trainer rank, rollout replica) becomes its own labelled group of tracks, its
timestamps mapped to wall clock (`clocks`), pids remapped so inputs never collide, and a
"control calls" process carries the trainer's stop / update_weights / start and the controller's
profiling window.

Streaming, in two passes per input: the first parses the input event by event (ijson), remaps
pids and flow ids, notes the clock markers, and spools each event as one line `<ts>\\t<json>`
to a temporary file (under $TMPDIR); once every input's offset, and so the common time origin,
is known, the second pass copies the spooled lines into the gzip output, adding the offset to
`ts` without parsing the JSON again. Memory stays at one event plus small per-process tables
whatever the input sizes; the spools need temporary disk about the size of the inputs' JSON.
"""

from __future__ import annotations

import fcntl
import gzip
import json
import math
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import ijson

from profiling.analysis.clocks import ClockProbe
from profiling.analysis.events import Event, iter_events
from profiling.analysis.sources import (
    TraceInput,
    control_calls,
    find_inputs,
    group_name,
    group_order,
    load_manifest,
)
from profiling.manifest import (
    ManifestEntry,
    MergeRecord,
    ProcessAlignment,
    StepManifest,
)
from profiling.store import MANIFEST_FILE, MERGED_TRACE, TraceStore, atomic_write_text

CONTROL_PID = 1
WINDOW_TID = 0
"""Thread id of each process's "profiling window" track (Kineto never uses 0 for a thread)."""
GROUP_PID_STRIDE = 1000
COMPRESSLEVEL = 3
"""gzip level of the output: level 3 is within ~10% of level 9's size here, at several times
its speed."""
_PROCESS_META = {"process_name", "process_labels", "process_sort_index"}
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, check_circular=False).encode

Progress = Callable[[int], None]
"""Called with on-disk input bytes read since the last call."""


class MergeError(RuntimeError):
    """The step cannot be merged; the message names the cause and the fix."""


@dataclass
class _Spooled:
    """One input after the first pass."""

    inp: TraceInput
    spool: Path
    alignment: ProcessAlignment
    pids: dict[Any, int] = field(default_factory=dict)
    """The input's pids -> output pids."""
    labels: dict[int, str] = field(default_factory=dict)
    """Output pid -> the input's own label for it (Kineto: CPU, GPU 0, ...)."""
    events: int = 0
    min_wall_ns: int | None = None


def merge_step(
    store: TraceStore,
    step: int,
    *,
    only_if_stale: bool = False,
    on_progress: Progress | None = None,
    spool_dir: Path | None = None,
) -> MergeRecord | None:
    """Merge step `step` into `step_<k>/merged.trace.json.gz`, record the outcome in
    `merge.json` (and so in the manifest), and return the record.

    Serialised across processes by a lock file; the output is written to a temporary file and
    renamed, so readers and racing mergers never see half a trace. `only_if_stale`: return None
    without merging when the last merge was made from the same records (its digest matches).
    A failed merge is recorded with its error and raised as MergeError.
    """
    step_dir = store.step_dir(step)
    load_manifest(store, step)  # StepNotFound before any lock file is made
    with open(step_dir / ".merge.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        digest = store.records_digest(step)
        if only_if_stale:
            last = store.read_merge(step)
            # A failed merge is not retried on the same records (the next change retries it).
            if (
                last is not None
                and last.digest == digest
                and (last.status == "error" or (step_dir / MERGED_TRACE).is_file())
            ):
                return None
        manifest = load_manifest(store, step)
        t0 = time.perf_counter()
        try:
            record = merge_manifest(step_dir, manifest, on_progress=on_progress, spool_dir=spool_dir)
        except Exception as e:  # noqa: BLE001 - every failure is recorded in the manifest
            record = MergeRecord(
                status="error",
                digest=digest,
                finished_at=time.time(),
                duration_s=time.perf_counter() - t0,
                error=f"{type(e).__name__}: {e}",
            )
        else:
            record.digest = digest
        store.write_merge(step, record)
    _record_in_manifest(store, step, record)
    if record.status == "error":
        raise MergeError(f"merging step {step} failed: {record.error}")
    return record


def _record_in_manifest(store: TraceStore, step: int, record: MergeRecord) -> None:
    """Show the merge in manifest.json: re-derived from the records where they exist, else (a
    step copied without its records) patched in place."""
    if store.read_session(step) is not None or store.read_entries(step):
        store.refresh_manifest(step)
        return
    manifest = store.read_manifest(step)
    if manifest is not None:
        manifest.merge = record
        atomic_write_text(store.step_dir(step) / MANIFEST_FILE, manifest.model_dump_json(indent=2))


def merge_manifest(
    step_dir: Path,
    manifest: StepManifest,
    *,
    on_progress: Progress | None = None,
    spool_dir: Path | None = None,
) -> MergeRecord:
    """Merge the traces `manifest` lists into `step_dir/merged.trace.json.gz` (atomically)."""
    t0 = time.perf_counter()
    inputs, skipped = find_inputs(step_dir, manifest)
    out = step_dir / MERGED_TRACE
    tmp = step_dir / f".{MERGED_TRACE}.{os.getpid()}.tmp"
    check_merge_room(inputs, step_dir, Path(spool_dir or tempfile.gettempdir()))
    spools = Path(tempfile.mkdtemp(prefix="merge-", dir=spool_dir))
    try:
        spooled: list[_Spooled] = []
        next_pid: dict[int, int] = {}
        for i, inp in enumerate(inputs):
            try:
                spooled.append(_spool(i, inp, spools / f"{i}.spool", next_pid, on_progress))
            except (ijson.JSONError, EOFError, zlib.error, OSError, ValueError) as e:
                skipped.append(f"{inp.rel}: unreadable trace ({type(e).__name__}: {e})")
        with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=COMPRESSLEVEL) as f:
            events = _Timeline(manifest, spooled, skipped).write(f)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        shutil.rmtree(spools, ignore_errors=True)
    return MergeRecord(
        status="ok",
        path=MERGED_TRACE,
        digest="",
        finished_at=time.time(),
        duration_s=time.perf_counter() - t0,
        bytes_in=sum(s.inp.size for s in spooled),
        bytes_out=out.stat().st_size,
        events=events,
        processes=[s.alignment for s in spooled],
        skipped=skipped,
    )


GZIP_RATIO = 12
"""How much larger a gzipped Chrome trace is as JSON lines (a generous estimate: 5 to 10 seen)."""


def check_merge_room(inputs: list[TraceInput], step_dir: Path, spool_dir: Path) -> None:
    """OSError naming both directories, their free space and the need, when the spools (about
    the inputs' JSON) or the output (about the inputs' size) would not fit: the merge is then
    not attempted, and its record says the merged timeline was not written."""
    json_bytes = sum(i.size * (GZIP_RATIO if i.path.name.endswith(".gz") else 1) for i in inputs)
    out_bytes = sum(i.size for i in inputs)
    needs = {spool_dir: json_bytes, step_dir: out_bytes}
    if spool_dir.exists() and step_dir.exists() and os.stat(spool_dir).st_dev == os.stat(step_dir).st_dev:
        needs = {step_dir: json_bytes + out_bytes}
    for where, need in needs.items():
        free = shutil.disk_usage(where).free
        if free < need:
            role = "the spools" if where == spool_dir else "the merged timeline"
            raise OSError(
                f"not merged: {where.name or where} has {free / 2**20:.0f} MiB free and {role} need about "
                f"{need / 2**20:.0f} MiB; the step's traces are intact, only merged.trace.json.gz is not "
                "written: free disk space (or point TMPDIR elsewhere) and run `python -m profiling merge`"
            )


def _spool(
    index: int, inp: TraceInput, spool: Path, next_pid: dict[int, int], on_progress: Progress | None
) -> _Spooled:
    """First pass over one input: remap pids and ids, note clock markers, and spool each event
    as a line `<ts>\t<event json without ts>`."""
    probe = ClockProbe(inp.entry)
    out = _Spooled(inp, spool, ProcessAlignment(key=inp.entry.key, file=inp.rel, source="epoch"))

    def output_pid(pid: Any) -> int:
        if pid not in out.pids:
            if isinstance(pid, str) and inp.entry.pid in out.pids:
                # Kineto's side tracks have string pids ("Spans", "Traces", ""): keep them in
                # the process's own group instead of a group each.
                out.pids[pid] = out.pids[inp.entry.pid]
                return out.pids[pid]
            n = next_pid.get(inp.group, 0)
            next_pid[inp.group] = n + 1
            new = out.pids[pid] = GROUP_PID_STRIDE * (inp.group + 1) + n
            # The input's process_labels event (Kineto: "CPU", "GPU 0") overrides this default.
            out.labels[new] = "CPU" if pid == inp.entry.pid else f"process {pid or '?'}"
        return out.pids[pid]

    if inp.entry.pid is not None:
        output_pid(inp.entry.pid)  # the process's own pid first: it is the group's main track

    wanted = probe.wanted
    min_ts = math.inf
    try:
        with open(spool, "w", encoding="utf-8") as sp:
            # The hot loop (one pass per event): plain locals, one write per event.
            for ev in iter_events(inp.path, inp.fmt, on_progress):
                ts = ev.pop("ts", None)
                timed = isinstance(ts, (int, float))
                if ev.get("ph") == "M":
                    if ev.get("name") in _PROCESS_META:
                        if ev["name"] == "process_labels":
                            out.labels[output_pid(ev.get("pid"))] = str(
                                (ev.get("args") or {}).get("labels", "")
                            )
                        continue  # replaced by this merge's own names
                elif timed:
                    if ts < min_ts:
                        min_ts = ts
                    if ev.get("name") in wanted:
                        probe.note(ev["name"], ts, ev.get("dur"))
                if "pid" in ev:
                    ev["pid"] = output_pid(ev["pid"])
                if ev.get("s") == "g":
                    ev["s"] = "p"  # an input's global instant belongs to its own process here
                if "id" in ev:
                    ev["id"] = _scoped_id(index, ev["id"])
                if "bind_id" in ev:
                    ev["bind_id"] = _scoped_id(index, ev["bind_id"])
                sp.write(f"{ts!r}\t{_dumps(ev)}\n" if timed else f"-\t{_dumps(ev)}\n")
                out.events += 1
    except BaseException:
        spool.unlink(missing_ok=True)
        raise
    probe.min_ts = None if min_ts == math.inf else min_ts
    out.alignment = probe.alignment(inp.rel, inp.fmt.base_ns)
    if probe.min_ts is not None:
        # in integers: unix nanoseconds as floats are off by up to ~256 ns
        out.min_wall_ns = round(probe.min_ts * 1000) + (inp.fmt.base_ns or 0) + out.alignment.offset_ns
    return out


def _scoped_id(index: int, value: Any) -> Any:
    """Flow and async ids are global in a trace: give input `index` ids of its own."""
    if isinstance(value, int) and 0 <= value < 2**40:
        return (index + 1) << 40 | value
    return f"{index}:{value}"


@dataclass
class _Slice:
    """A span (or, with dur None, an instant) on the timeline, in wall-clock seconds."""

    pid: int
    tid: int
    name: str
    at: float
    dur: float | None = None
    args: dict[str, Any] = field(default_factory=dict)


class _Timeline:
    """The second pass: names, control-call markers, and every spooled event, shifted."""

    def __init__(self, manifest: StepManifest, spooled: list[_Spooled], skipped: list[str]):
        self.manifest = manifest
        self.spooled = spooled
        self.skipped = skipped
        self.entries = group_order(manifest.entries)
        self.main_pid = {i: self._main_pid(i) for i in range(len(self.entries))}
        self.slices = list(self._control_slices()) + list(self._window_slices())
        anchors: list[float] = [s.min_wall_ns for s in spooled if s.min_wall_ns is not None]
        anchors += [s.at * 1e9 for s in self.slices]
        # One common origin, at or before everything: merged timestamps are never negative.
        self.base_ns = int(math.floor(min(anchors) / 1000)) * 1000 if anchors else 0
        self._first = True

    def _main_pid(self, group: int) -> int:
        """The pid that carries the group's window track: its CPU process, else its first."""
        pids = [
            (p, s.labels.get(p, ""))
            for s in self.spooled
            if s.inp.group == group
            for p in sorted(set(s.pids.values()))
        ]
        cpu = [p for p, label in pids if label == "CPU"]
        return (cpu or [p for p, _ in pids] or [GROUP_PID_STRIDE * (group + 1)])[0]

    def _control_slices(self) -> Iterator[_Slice]:
        m = self.manifest
        for call in control_calls(m):
            yield _Slice(CONTROL_PID, 1, call.name, call.start, call.dur_s, {"caller": call.caller})
        if m.started_at is not None:
            dur = None if m.stopped_at is None else m.stopped_at - m.started_at
            args = {"steps": m.steps, "status": m.status, "auto_stopped": m.auto_stopped}
            yield _Slice(CONTROL_PID, 2, f"controller: profiling step {m.step}", m.started_at, dur, args)

    def _window_slices(self) -> Iterator[_Slice]:
        for group, e in enumerate(self.entries):
            if e.started_at is None:
                continue
            dur = None if e.stopped_at is None else e.stopped_at - e.started_at
            args = {
                "weight_versions": e.weight_versions,
                "forward_steps": e.forward_steps,
                "late_start": e.late_start,
                "auto_stopped": e.auto_stopped,
                "status": e.status,
                "error": e.error,
            }
            yield _Slice(
                self.main_pid[group],
                WINDOW_TID,
                f"profiling window step {self.manifest.step}",
                e.started_at,
                dur,
                args,
            )

    # -- writing -----------------------------------------------------------------------------
    def write(self, f: IO[str]) -> int:
        """Write the whole trace; returns the number of events written."""
        header = {
            "displayTimeUnit": "ms",
            "baseTimeNanoseconds": self.base_ns,
            "rolloutProfiler": self._metadata(),
        }
        f.write(_dumps(header)[:-1] + ',"traceEvents":[\n')
        n = 0
        for ev in self._metadata_events():
            self._emit(f, _dumps(ev))
            n += 1
        for s in self.slices:
            self._emit(f, _dumps(self._slice_event(s)))
            n += 1
        for sp in self.spooled:
            n += self._copy(f, sp)
        f.write("\n]}\n")
        return n

    def _emit(self, f: IO[str], text: str) -> None:
        f.write(text if self._first else ",\n" + text)
        self._first = False

    def _copy(self, f: IO[str], sp: _Spooled) -> int:
        """Second pass over one input: its spooled lines, `ts` shifted to the common origin."""
        shift_us = ((sp.inp.fmt.base_ns or 0) + sp.alignment.offset_ns - self.base_ns) / 1000
        n = 0
        batch: list[str] = []
        with open(sp.spool, encoding="utf-8") as lines:
            for line in lines:
                ts, _, body = line.partition("\t")
                if ts == "-":
                    batch.append(body[:-1])
                elif body[1] == "}":  # an event with nothing but a timestamp
                    batch.append(f'{{"ts":{float(ts) + shift_us:.3f}}}')
                else:
                    batch.append(f'{{"ts":{float(ts) + shift_us:.3f},{body[1:-1]}')
                if len(batch) == 4096:
                    n += self._emit_all(f, batch)
                    batch = []
        n += self._emit_all(f, batch)
        sp.spool.unlink()
        return n

    def _emit_all(self, f: IO[str], texts: list[str]) -> int:
        if texts:
            self._emit(f, ",\n".join(texts))
        return len(texts)

    def _slice_event(self, s: _Slice) -> Event:
        ts = round((s.at * 1e9 - self.base_ns) / 1000, 3)
        ev: Event = {
            "name": s.name,
            "cat": "rollout_profiler",
            "pid": s.pid,
            "tid": s.tid,
            "ts": ts,
            "args": s.args,
        }
        if s.dur is None:
            ev.update(ph="i", s="t")
        else:
            ev.update(ph="X", dur=round(s.dur * 1e6, 3))
        return ev

    def _metadata_events(self) -> Iterator[Event]:
        yield from _process_meta(CONTROL_PID, "control calls (trainer sync, controller)", "control", 0)
        yield _thread_name(CONTROL_PID, 1, "trainer: stop / update_weights / start")
        yield _thread_name(CONTROL_PID, 2, "controller: profiling window")
        for group, e in enumerate(self.entries):
            inputs = [s for s in self.spooled if s.inp.group == group]
            name = group_name(e)
            if not inputs:
                why = e.error or "no readable trace file"
                yield from _process_meta(
                    self.main_pid[group], f"{name} [no trace: {why}]", _labels(e, None), self.main_pid[group]
                )
            for sp in inputs:
                for pid in sorted(set(sp.pids.values())):
                    label = sp.labels.get(pid, "")
                    full = name + ("" if label in ("", "CPU") else f" · {label}")
                    if len(inputs) > 1:
                        full += f" · {Path(sp.inp.rel).name}"
                    yield from _process_meta(pid, full, _labels(e, sp.alignment), pid)
            yield _thread_name(self.main_pid[group], WINDOW_TID, "profiling window")

    def _metadata(self) -> dict[str, Any]:
        m = self.manifest
        notes = [
            f"{s.alignment.key} {s.alignment.file}: no clock sample found in the trace; "
            + (
                "ts + baseTimeNanoseconds taken as wall clock (not measured)"
                if s.alignment.source == "baseTimeNanoseconds"
                else f"aligned by {s.alignment.source} (not measured)"
            )
            for s in self.spooled
            if s.alignment.source != "clock_sync"
        ]
        return {
            "step": m.step,
            "steps": m.steps,
            "status": m.status,
            "tool": m.tool,
            "alignment": [s.alignment.model_dump() for s in self.spooled],
            "clock_notes": notes,
            "skipped": self.skipped,
        }


def _process_meta(pid: int, name: str, labels: str, sort_index: int) -> Iterator[Event]:
    yield {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}
    yield {"ph": "M", "name": "process_labels", "pid": pid, "tid": 0, "args": {"labels": labels}}
    yield {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": sort_index}}


def _thread_name(pid: int, tid: int, name: str) -> Event:
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def _labels(e: ManifestEntry, alignment: ProcessAlignment | None) -> str:
    facts = [f"role={e.role}"]
    facts += [f"replica={e.replica_id}"] if e.role == "rollout" else [f"rank={e.rank or 0}"]
    if e.node_id:
        facts.append(f"node={e.node_id}")
    if e.pid:
        facts.append(f"os_pid={e.pid}")
    if e.weight_versions:
        facts.append("weights=" + "/".join(f"v{v}" for v in e.weight_versions))
    if alignment is not None:
        facts.append(f"clock={alignment.source}")
    return ", ".join(facts)
