"""Merge a step's traces into one Perfetto-loadable Chrome trace: `step_<k>/merged.trace.json.gz`.

Every process (trainer rank, rollout replica) becomes its own labelled group of tracks, its
timestamps mapped to wall clock (`clocks`), pids remapped so inputs never collide, and a
"control calls" process carries the trainer's stop / update_weights / start and the controller's
profiling window.

One pass over each input's events, streamed in chunks (`chunks`: msgspec over blocks of a few
MB, `args` never parsed). Each input's clock offset is measured first from its clock markers,
found by byte search without parsing; the common time origin is placed a margin before every
instant known in advance, so each event's `ts` is shifted as it is copied. The output is gzip
written in parts (`gzip_parts`): an input found damaged part way is taken back whole and
reported, as if it had been skipped up front. Memory stays at a few blocks plus small
per-process tables whatever the input sizes; no temporary files.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ijson
import msgspec

from profiling.analysis.chunks import UNSET, TraceEvent, are_structs, find_markers, iter_chunks
from profiling.analysis.clocks import ClockProbe, reference_s
from profiling.analysis.events import Event
from profiling.analysis.gzip_parts import GzipParts
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
_PROCESS_META = {"process_name", "process_labels", "process_sort_index"}
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, check_circular=False).encode
_encode = msgspec.json.Encoder().encode

Progress = Callable[[int], None]
"""Called with on-disk input bytes read since the last call."""


class MergeError(RuntimeError):
    """The step cannot be merged; the message names the cause and the fix."""


def merge_step(
    store: TraceStore,
    step: int,
    *,
    only_if_stale: bool = False,
    on_progress: Progress | None = None,
) -> MergeRecord | None:
    """Merge step `step` into `step_<k>/merged.trace.json.gz`, record the outcome in
    `merge.json` (and so in the manifest), and return the record.

    Serialised across processes by a lock file; the output is written to a temporary file and
    renamed, so readers and racing mergers never see half a trace. The step is held
    (`TraceStore.writing`) until the manifest shows the merge, so retention keeps it meanwhile.
    `only_if_stale`: return None without merging when the last merge was made from the same
    records (its digest matches). A failed merge is recorded with its error and raised as
    MergeError.
    """
    step_dir = store.step_dir(step)
    load_manifest(store, step)  # StepNotFound before any lock file is made
    with store.writing(step):
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
                record = merge_manifest(step_dir, manifest, on_progress=on_progress)
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
) -> MergeRecord:
    """Merge the traces `manifest` lists into `step_dir/merged.trace.json.gz` (atomically)."""
    t0 = time.perf_counter()
    inputs, skipped = find_inputs(step_dir, manifest)
    out = step_dir / MERGED_TRACE
    tmp = step_dir / f".{MERGED_TRACE}.{os.getpid()}.tmp"
    check_merge_room(inputs, step_dir)
    try:
        planned: list[_Planned] = []
        for inp in inputs:
            try:
                planned.append(_plan(inp))
            except _UNREADABLE as e:
                skipped.append(f"{inp.rel}: unreadable trace ({type(e).__name__}: {e})")
        timeline = _Timeline(manifest, planned, skipped)
        with open(tmp, "wb") as f:
            gz = GzipParts(f)
            timeline.write(gz, on_progress)
            gz.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    merged = timeline.merged
    return MergeRecord(
        status="ok",
        path=MERGED_TRACE,
        digest="",
        finished_at=time.time(),
        duration_s=time.perf_counter() - t0,
        bytes_in=sum(m.inp.size for m in merged),
        bytes_out=out.stat().st_size,
        events=timeline.events,
        processes=[m.alignment for m in merged],
        skipped=skipped,
    )


def check_merge_room(inputs: list[TraceInput], step_dir: Path) -> None:
    """OSError naming the directory, its free space and the need, when the output (at most
    about the inputs' JSON, gzipped: their size) would not fit: the merge is then not
    attempted, and its record says the merged timeline was not written."""
    need = sum(i.size for i in inputs)
    free = shutil.disk_usage(step_dir).free
    if free < need:
        raise OSError(
            f"not merged: {step_dir.name} has {free / 2**20:.0f} MiB free and the merged timeline needs about "
            f"{need / 2**20:.0f} MiB; the step's traces are intact, only merged.trace.json.gz is not "
            "written: free disk space and run `python -m profiling merge`"
        )


_UNREADABLE = (ijson.JSONError, EOFError, zlib.error, OSError, ValueError)
"""What reading a damaged trace raises (a cut-off file, bad gzip, invalid JSON)."""


@dataclass
class _Planned:
    """One input, its clock alignment measured before its events are copied."""

    inp: TraceInput
    alignment: ProcessAlignment
    anchor_ns: int | None
    """A wall-clock instant at (or just before) the input's first events, when known."""


def _plan(inp: TraceInput) -> _Planned:
    """The input's alignment: its clock markers found by byte search (a full scan only for
    layouts that search cannot read, or a trace with no absolute time at all)."""
    probe = ClockProbe(inp.entry)
    found = find_markers(inp.path, probe.wanted) if probe.wanted else {}
    base_ns = inp.fmt.base_ns
    if found is None or (not found and base_ns is None):
        for chunk in iter_chunks(inp.path, inp.fmt):
            for ev in chunk:
                probe.see(ev if isinstance(ev, dict) else msgspec.structs.asdict(ev))
    else:
        for name, ev in found.items():
            if isinstance(ev.get("ts"), (int, float)):
                probe.note(name, ev["ts"], ev.get("dur"))
    alignment = probe.alignment(inp.rel, base_ns)
    first = min((ts for ts, _ in probe.found.values()), default=probe.min_ts)
    # in integers: unix nanoseconds as floats are off by up to ~256 ns
    anchor = None if first is None else round(first * 1000) + (base_ns or 0) + alignment.offset_ns
    return _Planned(inp, alignment, anchor)


@dataclass
class _Merged:
    """One input after its events were copied."""

    inp: TraceInput
    alignment: ProcessAlignment
    pids: dict[Any, int] = field(default_factory=dict)
    """The input's pids -> output pids."""
    labels: dict[int, str] = field(default_factory=dict)
    """Output pid -> the input's own label for it (Kineto: CPU, GPU 0, ...)."""
    events: int = 0


class _Copier:
    """Copies one input's events into the output: pids remapped (so inputs never collide),
    flow ids scoped, the process's own name events replaced, `ts` shifted to the common
    origin. The hot loop of the merge."""

    def __init__(self, index: int, planned: _Planned, next_pid: dict[int, int], shift_us: float):
        self.index = index
        self.inp = planned.inp
        self.next_pid = next_pid
        self.shift_us = shift_us
        self.out = _Merged(planned.inp, planned.alignment)
        if self.inp.entry.pid is not None:
            self.output_pid(self.inp.entry.pid)  # the process's own pid first: the group's main track

    def output_pid(self, pid: Any) -> int:
        out, inp = self.out, self.inp
        if pid not in out.pids:
            if isinstance(pid, str) and inp.entry.pid in out.pids:
                # Kineto's side tracks have string pids ("Spans", "Traces", ""): keep them in
                # the process's own group instead of a group each.
                out.pids[pid] = out.pids[inp.entry.pid]
                return out.pids[pid]
            n = self.next_pid.get(inp.group, 0)
            self.next_pid[inp.group] = n + 1
            new = out.pids[pid] = GROUP_PID_STRIDE * (inp.group + 1) + n
            # The input's process_labels event (Kineto: "CPU", "GPU 0") overrides this default.
            out.labels[new] = "CPU" if pid == inp.entry.pid else f"process {pid or '?'}"
        return out.pids[pid]

    def copy(self, gz: GzipParts, on_progress: Progress | None) -> _Merged:
        """Write every event as one part of `gz` (undone, and the error raised, if the input
        turns out to be unreadable part way)."""
        gz.begin()
        try:
            for chunk in iter_chunks(self.inp.path, self.inp.fmt, on_progress):
                kept: list[Any] = self._structs(chunk) if are_structs(chunk) else self._dicts(chunk)
                if kept:
                    text = _encode(kept)
                    gz.write(b",")
                    gz.write(memoryview(text)[1:-1])
                    self.out.events += len(kept)
        except BaseException:
            gz.rollback()
            raise
        gz.commit()
        return self.out

    def _structs(self, events: list[TraceEvent]) -> list[TraceEvent]:
        pids, shift, unset = self.out.pids, self.shift_us, UNSET
        scope = (self.index + 1) << _ID_BITS
        dropped = []
        for i, e in enumerate(events):
            if e.ph == "M" and e.name in _PROCESS_META:
                if e.name == "process_labels" and isinstance(e.args, msgspec.Raw):
                    self._label(e.pid, msgspec.json.decode(e.args))
                dropped.append(i)  # replaced by this merge's own names
                continue
            ts = e.ts
            if ts is not unset:
                e.ts = ts + shift
            pid = e.pid
            if pid is not unset:
                try:
                    e.pid = pids[pid]
                except KeyError:
                    e.pid = self.output_pid(pid)
            flow = e.id
            if flow is not unset:
                # inline: flows are a large share of GPU traces' events
                e.id = scope | flow if type(flow) is int and 0 <= flow < _ID_LIMIT else _scoped_id(self.index, flow)
            if e.bind_id is not unset:
                e.bind_id = _scoped_id(self.index, e.bind_id)
            if e.s == "g":
                e.s = "p"  # an input's global instant belongs to its own process here
        for i in reversed(dropped):
            del events[i]
        return events

    def _dicts(self, events: list[Event]) -> list[Event]:
        kept = []
        for e in events:
            if e.get("ph") == "M" and e.get("name") in _PROCESS_META:
                if e["name"] == "process_labels":
                    self._label(e.get("pid"), e.get("args"))
                continue
            if isinstance(e.get("ts"), (int, float)):
                e["ts"] += self.shift_us
            if "pid" in e:
                e["pid"] = self.output_pid(e["pid"])
            for key in ("id", "bind_id"):
                if key in e:
                    e[key] = _scoped_id(self.index, e[key])
            if e.get("s") == "g":
                e["s"] = "p"
            kept.append(e)
        return kept

    def _label(self, pid: Any, args: Any) -> None:
        self.out.labels[self.output_pid(pid)] = str((args if isinstance(args, dict) else {}).get("labels", ""))


_ID_BITS = 40
_ID_LIMIT = 1 << _ID_BITS


def _scoped_id(index: int, value: Any) -> Any:
    """Flow and async ids are global in a trace: give input `index` ids of its own."""
    if isinstance(value, int) and 0 <= value < _ID_LIMIT:
        return (index + 1) << _ID_BITS | value
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


ORIGIN_MARGIN_NS = 60 * 10**9
"""The common time origin lies this far before the earliest instant known ahead of the copy
(control calls, windows, clock markers), so that no event's `ts` is negative: a trace's events
never start a minute before its own start marker."""


class _Timeline:
    """The output: names, control-call markers, and every input's events, shifted."""

    def __init__(self, manifest: StepManifest, planned: list[_Planned], skipped: list[str]):
        self.manifest = manifest
        self.planned = planned
        self.skipped = skipped
        self.entries = group_order(manifest.entries)
        self.merged: list[_Merged] = []
        self.events = 0
        self.control = list(self._control_slices())
        anchors = [p.anchor_ns for p in planned if p.anchor_ns is not None]
        anchors += [round(s.at * 1e9) for s in self.control]
        anchors += [round(reference_s(e, e.started_at) * 1e9) for e in self.entries if e.started_at is not None]
        # One common origin, before everything: merged timestamps are never negative.
        self.base_ns = (min(anchors) - ORIGIN_MARGIN_NS) // 1_000_000 * 1_000_000 if anchors else 0

    def write(self, gz: GzipParts, on_progress: Progress | None) -> None:
        """Write the whole trace: header and control process, each input (an unreadable one
        is skipped whole), then every process's names and the windows."""
        gz.begin()
        header = {"displayTimeUnit": "ms", "baseTimeNanoseconds": self.base_ns}
        gz.write(_dumps(header)[:-1].encode() + b',"traceEvents":[')
        gz.write(self._events(list(self._control_meta()) + [self._slice_event(s) for s in self.control], first=True))
        gz.commit()
        next_pid: dict[int, int] = {}
        for i, p in enumerate(self.planned):
            # whole nanoseconds: Kineto's ts have three decimals, and so then do their sums
            shift_us = round(((p.inp.fmt.base_ns or 0) + p.alignment.offset_ns - self.base_ns) / 1000, 3)
            try:
                self.merged.append(_Copier(i, p, next_pid, shift_us).copy(gz, on_progress))
            except _UNREADABLE as e:
                self.skipped.append(f"{p.inp.rel}: unreadable trace ({type(e).__name__}: {e})")
        gz.begin()
        main_pid = {g: self._main_pid(g) for g in range(len(self.entries))}
        tail = list(self._group_meta(main_pid)) + [self._slice_event(s) for s in self._window_slices(main_pid)]
        gz.write(self._events(tail, first=False))
        gz.write(b'],"rolloutProfiler":' + _dumps(self._metadata()).encode() + b"}\n")
        gz.commit()
        self.events += sum(m.events for m in self.merged)

    def _events(self, events: list[Event], first: bool) -> bytes:
        self.events += len(events)
        text = ",".join(map(_dumps, events)).encode()
        return text if first or not text else b"," + text

    def _main_pid(self, group: int) -> int:
        """The pid that carries the group's window track: its CPU process, else its first."""
        pids = [
            (p, m.labels.get(p, "")) for m in self.merged if m.inp.group == group for p in sorted(set(m.pids.values()))
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

    def _window_slices(self, main_pid: dict[int, int]) -> Iterator[_Slice]:
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
            name = f"profiling window step {self.manifest.step}"
            yield _Slice(main_pid[group], WINDOW_TID, name, reference_s(e, e.started_at), dur, args)

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

    def _control_meta(self) -> Iterator[Event]:
        yield from _process_meta(CONTROL_PID, "control calls (trainer sync, controller)", "control", 0)
        yield _thread_name(CONTROL_PID, 1, "trainer: stop / update_weights / start")
        yield _thread_name(CONTROL_PID, 2, "controller: profiling window")

    def _group_meta(self, main_pid: dict[int, int]) -> Iterator[Event]:
        for group, e in enumerate(self.entries):
            inputs = [m for m in self.merged if m.inp.group == group]
            name = group_name(e)
            if not inputs:
                why = e.error or "no readable trace file"
                yield from _process_meta(
                    main_pid[group], f"{name} [no trace: {why}]", _labels(e, None), main_pid[group]
                )
            for m in inputs:
                for pid in sorted(set(m.pids.values())):
                    label = m.labels.get(pid, "")
                    full = name + ("" if label in ("", "CPU") else f" · {label}")
                    if len(inputs) > 1:
                        full += f" · {Path(m.inp.rel).name}"
                    yield from _process_meta(pid, full, _labels(e, m.alignment), pid)
            yield _thread_name(main_pid[group], WINDOW_TID, "profiling window")

    def _metadata(self) -> dict[str, Any]:
        m = self.manifest
        notes = [
            f"{x.alignment.key} {x.alignment.file}: no clock sample found in the trace; "
            + (
                "ts + baseTimeNanoseconds taken as wall clock (not measured)"
                if x.alignment.source == "baseTimeNanoseconds"
                else f"aligned by {x.alignment.source} (not measured)"
            )
            for x in self.merged
            if x.alignment.source != "clock_sync"
        ]
        return {
            "step": m.step,
            "steps": m.steps,
            "status": m.status,
            "tool": m.tool,
            "alignment": [x.alignment.model_dump() for x in self.merged],
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
