"""`verify`: prove that a trace directory holds what the contract says (docs/analysis.md#verify).

For each step it checks the manifest (settled, failures explained), the files its ok entries list
(present; Chrome traces parse), the forward-step markers in every trace (the step's weight
version, or a continuous window's versions in order, each after the `weight_update` that
introduced it), their count against the manifest's `forward_steps`, the forward passes run on the
step's weights outside its window, and clock alignment. Each entry's traces are read by its
`trace_dialect`: an engine whose own profiler records names its forward ranges its own way, and
may write the weight version into the file's name instead of the range's, or nowhere (a recording
assigned to its step by its place in time, `WindowMatch`: checked against the step's trainer
window and against the trace's own event times). Traces are streamed in
bounded chunks (`chunks.iter_chunks`, the merge's reader): memory stays flat however large they
are.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import ijson
from pydantic import BaseModel

from profiling.analysis.chunks import are_structs, iter_chunks
from profiling.analysis.events import NotATrace, is_trace_name, sniff
from profiling.analysis.trace_span import Extent, NoAbsoluteTime, clock_text, span_text
from profiling.manifest import ManifestEntry, StepManifest, TraceDialect
from profiling.markers import (
    FORWARD_STEP,
    FORWARD_STEP_SHAPE,
    format_forward_step,
    format_weight_update,
    parse_forward_step,
    parse_weight_update,
)
from profiling.store import CorruptRecord, TraceStore

Check = Literal["manifest", "files", "versions", "marker_count", "outside_window", "clock"]
STEP_WIDE = "-"
"""The entry column of a finding about the step as a whole."""

_ANNOTATION = "user_annotation"
"""The category of a `record_function` range on the CPU (its CUDA twin, `gpu_user_annotation`,
repeats the name on the GPU's timeline and is not counted)."""
_RANGE_PHASES = ("X", "B")
WINDOW_TOLERANCE_S = 0.001
"""How far a recording's own first and last events may lie from its entry's `started_at` and
`stopped_at` (which the ingest took from those events, rounded to unix seconds as floats)."""


class Finding(BaseModel):
    """One violation or note: where (step, entry), which check, and what is wrong."""

    step: int
    entry: str
    """`rollout/<replica_id>`, `trainer/rank_<r>`, or `-` for the step as a whole."""
    check: Check
    message: str
    """The problem and, where it helps, the fix."""


class VerifyReport(BaseModel):
    """The outcome of `verify`: the steps checked, what violates the contract, and what could not
    be checked or was explained (notes do not fail verification)."""

    steps: list[int]
    violations: list[Finding]
    notes: list[Finding]

    @property
    def ok(self) -> bool:
        return not self.violations


@dataclass
class _Marker:
    ts: float
    index: int
    step: int
    version: int


@dataclass
class _TraceScan:
    """What one Chrome trace holds that the checks need."""

    name: str
    forward: list[_Marker] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)
    """Forward-step range names that do not carry `step=` and `weight_version=`."""
    updates: dict[int, float] = field(default_factory=dict)
    """Weight version -> start of the first weight-update range that loaded it."""
    annotations: set[str] = field(default_factory=set)
    """Names of every other user-annotation range (the clock markers among them)."""
    unversioned_forwards: int = 0
    """Forward ranges of a dialect whose ranges carry no version (`version_in: file_name`)."""
    file_version: int | None = None
    """The weight version the file's name carries (None: the dialect puts none there)."""
    span_ns: tuple[int, int] | None = None
    """A `window` dialect's trace: unix nanoseconds of its first and last event (None: not read,
    or its events have no absolute time)."""


class _Findings:
    def __init__(self, step: int) -> None:
        self.step = step
        self.violations: list[Finding] = []
        self.notes: list[Finding] = []

    def violation(self, entry: str, check: Check, message: str) -> None:
        self.violations.append(Finding(step=self.step, entry=entry, check=check, message=message))

    def note(self, entry: str, check: Check, message: str) -> None:
        self.notes.append(Finding(step=self.step, entry=entry, check=check, message=message))


def trace_bytes(store: TraceStore, steps: list[int]) -> int:
    """On-disk bytes of the Chrome traces the steps' manifests list (for a progress bar); files
    or manifests that cannot be read count 0 (the verification reports them)."""
    total = 0
    for k in steps:
        try:
            m = store.read_manifest(k)
        except CorruptRecord:
            continue
        for e in m.entries if m else []:
            for rel in e.files:
                path = store.step_dir(k) / rel
                if is_trace_name(rel) and path.is_file():
                    total += path.stat().st_size
    return total


def verify_steps(store: TraceStore, steps: list[int], on_progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Verify each of `steps` under `store` (they must have a directory: the caller checks).
    `on_progress(n)`: called with the trace bytes read since its last call."""
    violations: list[Finding] = []
    notes: list[Finding] = []
    for k in steps:
        found = verify_step(store, k, on_progress)
        violations += found.violations
        notes += found.notes
    return VerifyReport(steps=steps, violations=violations, notes=notes)


def verify_step(store: TraceStore, step: int, on_progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Verify one step: its manifest, then every entry the manifest lists."""
    out = _Findings(step)
    manifest = _check_manifest(store, step, out)
    if manifest is not None:
        discrete = manifest.steps == [step]
        for entry in manifest.entries:
            if entry.status == "ok":
                _check_entry(store.step_dir(step), manifest, entry, discrete, out, on_progress)
    return VerifyReport(steps=[step], violations=out.violations, notes=out.notes)


def _check_manifest(store: TraceStore, step: int, out: _Findings) -> StepManifest | None:
    """The manifest, if it is settled enough to check its entries (else None, findings made)."""
    name = f"step_{step}/manifest.json"
    try:
        m = store.read_manifest(step)
    except CorruptRecord as e:
        out.violation(STEP_WIDE, "manifest", str(e))
        return None
    if m is None:
        out.violation(
            STEP_WIDE,
            "manifest",
            f"{name} is missing: the step was never recorded to the end; re-run the step",
        )
        return None
    if m.step != step or step not in m.steps:
        out.violation(
            STEP_WIDE,
            "manifest",
            f"{name} describes step {m.step} (window {m.steps}), not step {step}: it was copied or "
            "moved from another step directory",
        )
        return None
    if m.status in ("recording", "exporting"):
        out.violation(
            STEP_WIDE,
            "manifest",
            f"still {m.status}: wait for the step to be stopped and its traces exported, then verify "
            "again (or re-run the step if its producers are gone)",
        )
        return None
    if not m.entries:
        out.violation(STEP_WIDE, "manifest", "no process recorded this step: the manifest lists no entries")
    for entry in m.entries:
        if entry.status == "ok":
            continue
        if entry.error:
            out.note(entry.key, "manifest", f"failed, explained: {entry.error}")
        else:
            out.violation(
                entry.key,
                "manifest",
                "incomplete: the entry failed without saying why (no error text); see the producer's log",
            )
    return m


def _check_entry(
    step_dir: Path,
    manifest: StepManifest,
    entry: ManifestEntry,
    discrete: bool,
    out: _Findings,
    on_progress: Callable[[int], None] | None,
) -> None:
    key = entry.key
    if not entry.files:
        out.violation(key, "files", "the entry is ok but lists no trace files")
    scans: list[_TraceScan] = []
    complete = True  # every Chrome trace listed was read to its end
    for rel in entry.files:
        path = step_dir / rel
        if not path.exists():
            out.violation(key, "files", f"{rel} is listed in the manifest but missing: re-record the step")
            complete = complete and not is_trace_name(rel)
            continue
        if not is_trace_name(rel):
            continue  # nsys reports, NPU directories: present is all that can be checked
        try:
            scans.append(_scan(path, entry.trace_dialect, on_progress))
        except (NotATrace, ijson.JSONError, OSError, EOFError, zlib.error, ValueError) as e:
            complete = False
            out.violation(
                key,
                "files",
                f"{rel} does not parse as a Chrome trace ({e}): its export was cut off or the file "
                "was damaged; re-record the step",
            )
    has_chrome = any(is_trace_name(rel) for rel in entry.files)
    _check_versions(manifest, entry, discrete, scans, out)
    if entry.trace_dialect.version_in == "window":
        _check_window(manifest, entry, scans if complete else [], out)
    if discrete:
        _check_outside(manifest.step, entry, out)
    # Counts and markers of a trace read only in part would only repeat the files violation.
    _check_clock(entry, scans if complete else [], out)
    if complete:
        _check_marker_count(entry, has_chrome, scans, out)


def _scan(path: Path, dialect: TraceDialect, on_progress: Callable[[int], None] | None) -> _TraceScan:
    scan = _TraceScan(path.name, file_version=dialect.file_version_of(path.name))
    fmt = sniff(path)
    extent = Extent() if dialect.version_in == "window" else None
    for chunk in iter_chunks(path, fmt, on_progress):
        if extent is not None:
            extent.see(chunk)
        if are_structs(chunk):
            ranges = [(e.name, e.ts) for e in chunk if e.cat == _ANNOTATION and e.ph in _RANGE_PHASES]
        else:
            ranges = [
                (e.get("name"), e.get("ts"))
                for e in chunk
                if e.get("cat") == _ANNOTATION and e.get("ph") in _RANGE_PHASES
            ]
        for name, ts in ranges:
            _add_range(scan, dialect, str(name), float(ts) if isinstance(ts, int | float) else 0.0)
    scan.forward.sort(key=lambda m: m.ts)
    if extent is not None:
        with contextlib.suppress(NoAbsoluteTime):  # the window check reports a trace it cannot place
            scan.span_ns = extent.unix_ns(fmt, path)
    return scan


def _add_range(scan: _TraceScan, dialect: TraceDialect, name: str, ts: float) -> None:
    if name.startswith(dialect.forward_range):
        if dialect.version_in != "marker":
            scan.unversioned_forwards += 1
        elif m := parse_forward_step(name):
            scan.forward.append(_Marker(ts, m.index, m.step, m.weight_version))
        else:
            scan.malformed.append(name)
    elif (v := parse_weight_update(name)) is not None:
        scan.updates[v] = min(ts, scan.updates.get(v, ts))
    else:
        scan.annotations.add(name)


def _check_versions(
    manifest: StepManifest, entry: ManifestEntry, discrete: bool, scans: list[_TraceScan], out: _Findings
) -> None:
    key, k = entry.key, manifest.step
    for scan in scans:
        if scan.malformed:
            out.violation(
                key,
                "versions",
                f"{len(scan.malformed)} forward-step range(s) carry no step and weight version, e.g. "
                f"{scan.malformed[0]!r}: expected '{FORWARD_STEP_SHAPE}'",
            )
    if discrete:
        expected = k - 1
        if entry.weight_version is not None and entry.weight_version != expected:
            out.violation(
                key,
                "versions",
                f"the manifest says the recording started on weights v{entry.weight_version}; step {k} "
                f"holds work on weights v{expected} only",
            )
        wrong = [m for s in scans for m in s.forward if m.version != expected or m.step != k]
        for scan in _file_recordings(scans, entry.trace_dialect):
            if scan.file_version != expected:
                out.violation(
                    key,
                    "versions",
                    f"{scan.name} is a recording on weights v{scan.file_version} (its file name says so), "
                    f"but step {k} holds work on weights v{expected} only",
                )
        if wrong:
            first = wrong[0]
            out.violation(
                key,
                "versions",
                f"{len(wrong)} forward step(s) not on step {k} / weights v{expected}, e.g. "
                f"{format_forward_step(first.index, first.step, first.version)}: the window "
                "recorded passes of another version (was the stop made with pause before the weight update?)",
            )
        return
    first_step, last_step = manifest.steps[0], manifest.steps[-1]
    allowed = range(first_step - 1, last_step)
    for scan in scans:
        problem = _continuous_problem(scan, k, allowed, entry.late_start)
        if problem:
            out.violation(key, "versions", problem)
    for scan in _file_recordings(scans, entry.trace_dialect):
        if (v := scan.file_version) not in allowed:
            out.violation(
                key,
                "versions",
                f"{scan.name} is a recording on weights v{v} (its file name says so), outside the window's versions "
                f"v{allowed.start}..v{allowed.stop - 1}",
            )


def _continuous_problem(scan: _TraceScan, label: int, allowed: range, late_start: bool) -> str | None:
    """What is wrong with one trace of a continuous window (None: nothing): versions in order,
    within the window, each (after the window's first) after the `weight_update` that loaded it."""
    previous: int | None = None
    for m in scan.forward:
        where = f"{FORWARD_STEP}{m.index} (weight_version={m.version})"
        if m.step != label:
            return f"{where} is labelled step={m.step}; the window is labelled by its first step, {label}"
        if m.version not in allowed:
            return (
                f"{where} is outside the window's versions v{allowed.start}..v{allowed.stop - 1}: the window "
                "recorded passes of another version"
            )
        if previous is not None and m.version < previous:
            return f"{where} comes after a pass on v{previous}: versions must not go back within a window"
        introduced = m.version != allowed.start and not (previous is None and late_start)
        if introduced and m.version != previous:
            loaded = scan.updates.get(m.version)
            if loaded is None or loaded > m.ts:
                return (
                    f"{where} runs before any '{format_weight_update(m.version)}' range in the same trace: "
                    "the weights it names were not loaded inside the window"
                )
        previous = m.version
    return None


def _check_marker_count(entry: ManifestEntry, has_chrome: bool, scans: list[_TraceScan], out: _Findings) -> None:
    key = entry.key
    expected = (
        entry.forward_steps_kept if entry.truncated and entry.forward_steps_kept is not None else entry.forward_steps
    )
    counted = "forward_steps_kept" if entry.truncated else "forward_steps"
    if not has_chrome:
        if entry.forward_steps > 0:
            out.note(
                key,
                "versions",
                f"{entry.forward_steps} forward steps carry no weight version: the trace is not a Chrome "
                "trace (nsys, NPU), so its markers are not checked",
            )
        return
    dialect = entry.trace_dialect
    if dialect.version_in == "window":
        # One trace per engine worker; every worker marks the same engine steps.
        for scan in scans:
            if scan.unversioned_forwards != expected:
                out.violation(
                    key,
                    "marker_count",
                    f"{scan.unversioned_forwards} forward ranges ('{dialect.forward_range}...') in {scan.name}, the "
                    f"manifest says {counted}={expected}: the count and the trace disagree (a trace from another "
                    "recording?)",
                )
        return
    if any(s.forward for s in scans):
        # One trace per process; with tensor parallelism every rank marks the same iterations.
        for scan in scans:
            if len(scan.forward) != expected:
                out.violation(
                    key,
                    "marker_count",
                    f"{len(scan.forward)} forward-step markers in {scan.name}, the manifest says "
                    f"{counted}={expected}: the count and the trace disagree (a trace from another "
                    "recording, or a cut trace)",
                )
        return
    if recordings := _file_recordings(scans, dialect):
        found = sum(s.unversioned_forwards for s in recordings)
        if found != expected:
            out.violation(
                key,
                "marker_count",
                f"{found} forward ranges ('{dialect.forward_range}...') in the traces, the manifest says "
                f"{counted}={expected}: the count and the traces disagree",
            )
    elif expected > 0:
        missing = (
            f"the trace has no '{FORWARD_STEP_SHAPE}' range"
            if dialect.version_in == "marker"
            else "no trace file's name carries its weight version"
        )
        out.violation(
            key,
            "versions",
            f"forward steps carry no weight version: {counted}={expected} but {missing}; the engine does not "
            "mark its passes",
        )


def _file_recordings(scans: list[_TraceScan], dialect: TraceDialect) -> list[_TraceScan]:
    """The traces of a dialect that names the version in the file, one per recording (per weight
    version): a recording's ranks run the same forwards, so its first rank's trace stands for them."""
    firsts: dict[str, _TraceScan] = {}
    for scan in sorted(scans, key=lambda s: s.name):
        if scan.file_version is not None:
            firsts.setdefault(dialect.recording_of(scan.name), scan)
    return list(firsts.values())


def _check_outside(step: int, entry: ManifestEntry, out: _Findings) -> None:
    if entry.role != "rollout" or entry.sync_held_s is None:
        return  # only a stop with pause promises no pass on the step's weights outside it
    n = entry.forward_steps_outside
    if n is None:
        out.note(entry.key, "outside_window", f"forward passes on weights v{step - 1} outside the window: not counted")
    elif n > 0 and entry.auto_stopped is not None:
        # A capped window stops recording while its step stays active: what ran after the cap
        # is unrecorded because the cap asked for it.
        out.note(
            entry.key,
            "outside_window",
            f"{n} forward pass(es) on weights v{step - 1} ran after the window was capped ({entry.auto_stopped}), "
            "unrecorded as the cap asks",
        )
    elif n > 0:
        out.violation(
            entry.key,
            "outside_window",
            f"{n} forward pass(es) on weights v{step - 1} ran outside the window although the stop paused "
            "the replica: they are in no trace (the hold did not cover stop -> update -> start)",
        )


def _check_window(manifest: StepManifest, entry: ManifestEntry, scans: list[_TraceScan], out: _Findings) -> None:
    """A recording whose traces carry no weight version was assigned to its step by time: its
    stop must lie inside the step's trainer window (from the manifest's trainer entries), and its
    traces' own events must span what the entry says (else a file was swapped in)."""
    key, k = entry.key, manifest.step
    match = entry.window_match
    rebuild = "rebuild the steps from verl's save_path: python -m profiling verl <save_path>"
    if match is None:
        out.violation(
            key,
            "versions",
            f"its traces carry no weight version (trace_dialect window) and the entry has no window_match: "
            f"nothing assigns its forward passes to step {k}; {rebuild}",
        )
        return
    trainer = [
        e for e in manifest.entries if e.role == "trainer" and e.status == "ok" and e.started_at and e.stopped_at
    ]
    stop = entry.stopped_at
    if not trainer or stop is None:
        out.violation(
            key,
            "versions",
            f"its place in time cannot be checked: step {k} has no trainer entry with a window"
            if not trainer
            else "its place in time cannot be checked: the entry has no stopped_at",
        )
    else:
        opened = min(e.started_at or 0.0 for e in trainer)
        closed = max(e.stopped_at or 0.0 for e in trainer)
        window = span_text(round(opened * 1e9), round(closed * 1e9))
        stopped = clock_text(round(stop * 1e9))
        if not opened <= stop <= closed:
            off = opened - stop if stop < opened else stop - closed
            out.violation(
                key,
                "versions",
                f"the recording stopped at {stopped}, {off:.3f} s outside step {k}'s trainer window ({window}, "
                f"from the step's trainer entries): it is not step {k}'s generation (moved from another step's "
                f"directory?); {rebuild}",
            )
        else:
            out.note(
                key,
                "versions",
                f"{entry.forward_steps} forward passes ('{entry.trace_dialect.forward_range}...' ranges) carry no "
                f"weight version: assigned to step {k} (weights v{k - 1}) by time: the recording stopped at "
                f"{stopped}, inside step {k}'s trainer window ({window}; trainer steps "
                f"{', '.join(map(str, match.trainer_steps))}), "
                f"{min(stop - opened, closed - stop):.3f} s from its nearer edge; {match.clocks}",
            )
    if not scans:
        return
    unplaced = [s.name for s in scans if s.span_ns is None]
    if unplaced:
        out.violation(key, "files", f"{unplaced[0]}'s events have no absolute time: the recording cannot be placed")
        return
    first = min(s.span_ns[0] for s in scans if s.span_ns) / 1e9
    last = max(s.span_ns[1] for s in scans if s.span_ns) / 1e9
    began, ended = entry.started_at, entry.stopped_at
    if began is None or ended is None or max(abs(first - began), abs(last - ended)) > WINDOW_TOLERANCE_S:
        claimed = "no window" if began is None or ended is None else span_text(round(began * 1e9), round(ended * 1e9))
        out.violation(
            key,
            "files",
            f"the traces' events run from {span_text(round(first * 1e9), round(last * 1e9))}, but the entry says "
            f"{claimed}: a trace is not the recording the entry describes (swapped in from another step?); {rebuild}",
        )


def _check_clock(entry: ManifestEntry, scans: list[_TraceScan], out: _Findings) -> None:
    key = entry.key
    if not entry.files:
        return
    if entry.clock_offset is None and entry.clock_unmeasured:
        out.note(key, "clock", f"clock offset {entry.clock_unmeasured}")
    elif entry.clock_offset is None:
        out.violation(
            key,
            "clock",
            "no clock alignment: clock_offset (the process's clock against the app's, with its error "
            "bound) was not measured; the merged timeline cannot place this trace",
        )
    elif entry.clock_offset.bound_ns < 0:
        out.violation(
            key, "clock", f"no clock alignment: clock_offset has a negative bound ({entry.clock_offset.bound_ns} ns)"
        )
    if not scans:
        return
    names = set().union(*(s.annotations for s in scans))
    in_trace = sorted(n for n in names if n.startswith("clock_sync "))
    clock = entry.clock
    if clock is None:
        if in_trace:
            out.violation(
                key,
                "clock",
                f"no clock alignment: the trace has clock markers ({in_trace[0]!r}) but the entry has no "
                "clock samples to map them to wall-clock time",
            )
        elif not entry.clock_unmeasured:  # that note says so already
            out.note(key, "clock", "the trace has no clock markers: the merge places it by its own timestamps")
        return
    for at, sample in (("start", clock.start), ("stop", clock.stop)):
        if sample is None:
            out.violation(key, "clock", f"no clock alignment: the entry has no clock sample at {at}")
        elif sample.marker not in names:
            out.violation(
                key,
                "clock",
                f"no clock alignment: the {at} clock marker {sample.marker!r} is not in the trace",
            )
