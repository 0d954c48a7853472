"""Per-step summaries from the trace events: per process, and across replicas.

Per process: time in forward ranges (the entry's `trace_dialect`: the engine steps of a replica,
the mini-batches of the trainer), ops ranked by self time, time in weight updates, and profiler
overhead. Across replicas: how far apart they started and stopped, and the slowest one. The RL
step breakdown (`breakdown.py`) comes from the manifest's records.

Each trace is read once, streaming; only three numbers per complete event (start, duration, name
id) are kept, per thread, to compute self times (a range's duration less its direct children's).
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import ijson
import numpy as np
from pydantic import BaseModel, Field

from profiling.analysis.breakdown import StepBreakdown, step_breakdown
from profiling.analysis.clocks import ClockProbe, reference_s, wall_ns
from profiling.analysis.events import iter_events
from profiling.analysis.sources import (
    ControlCall,
    TraceInput,
    control_calls,
    find_inputs,
    group_order,
    load_manifest,
)
from profiling.manifest import (
    ManifestEntry,
    ProcessAlignment,
    Role,
    StepManifest,
    SyncCost,
)
from profiling.markers import WEIGHT_UPDATE
from profiling.store import TraceStore

CLOCK_PREFIX = "clock_sync"
ANNOTATION_CATS = {"user_annotation", "gpu_user_annotation", "python_function", "Trace"}
"""Ranges that are labels, not ops: nested like ops (so they do not inflate their parents' self
time) but left out of the op ranking."""


class OpTime(BaseModel):
    """One op name's self time summed over a process (or a role)."""

    name: str
    self_ms: float
    count: int


class Phase(BaseModel):
    """A span on the timeline picture, in wall-clock time."""

    kind: Literal["forward", "weight_update"]
    start: float
    """Unix seconds."""
    dur_s: float


class Overhead(BaseModel):
    """What profiling itself cost this process."""

    finalize_ms: float | None = None
    """The profiler's stop (finalize), on the model thread."""
    export_ms: float | None = None
    """Writing the trace, in the background."""
    kineto_ms: float = 0.0
    """Kineto's own overhead events in the trace (e.g. CUPTI buffer handling)."""
    clock_sync_ms: float = 0.0
    """The clock markers this project records at start and stop."""


class ProcessSummary(BaseModel):
    """One process (trainer rank or rollout replica) in one step."""

    key: str
    role: Role
    replica_id: str | None = None
    rank: int | None = None
    node_id: str | None = None
    status: Literal["ok", "error"] = "ok"
    error: str | None = None
    weight_versions: list[int] = Field(default_factory=list)
    started_at: float | None = None
    stopped_at: float | None = None
    trace_files: int = 0
    events: int = 0
    forward_steps: int = 0
    kept: str | None = None
    """The entry's note when the trace holds fewer forward steps than the window ran (a cap, a cut):
    "kept 200 of 3,412 forward steps: …" (`ManifestEntry.kept`)."""
    forward_ms: float = 0.0
    pipeline_wait_ms: float = 0.0
    """Within the forward ranges (a trainer's mini-batches): time in point-to-point sends and
    receives, where a pipeline stage waits on its neighbour (`PIPELINE_P2P`)."""
    forward_mean_ms: float | None = None
    forward_max_ms: float | None = None
    weight_updates: int = 0
    weight_update_ms: float = 0.0
    overhead: Overhead = Field(default_factory=Overhead)
    ops: list[OpTime] = Field(default_factory=list, description="Every op, by self time, largest first.")
    alignment: list[ProcessAlignment] = Field(default_factory=list)
    phases: list[Phase] = Field(default_factory=list, exclude=True)
    """Forward steps and weight updates for the timeline picture (not in JSON output)."""


class Skew(BaseModel):
    """How the replicas differ within the step."""

    replicas: int = 0
    start_spread_ms: float | None = None
    """Latest minus earliest replica start (on the app's reference clock, where measured)."""
    stop_spread_ms: float | None = None
    first_to_start: str | None = None
    last_to_start: str | None = None
    first_to_stop: str | None = None
    last_to_stop: str | None = None
    slowest_replica: str | None = None
    """The replica with the longest mean forward step."""
    slowest_forward_mean_ms: float | None = None
    fastest_forward_mean_ms: float | None = None


class StepSummary(BaseModel):
    """`python -m profiling summarize DIR --step k --json`."""

    step: int
    steps: list[int]
    status: str
    tool: str
    started_at: float | None = None
    stopped_at: float | None = None
    sync: SyncCost | None = None
    control: list[ControlCall] = Field(default_factory=list)
    processes: list[ProcessSummary] = Field(default_factory=list)
    skew: Skew = Field(default_factory=Skew)
    breakdown: StepBreakdown = Field(default_factory=StepBreakdown)
    """The RL step breakdown: states, requests and tokens per replica, the trainer ranks,
    imbalance, slowest requests, weight versions served, staleness."""
    skipped: list[str] = Field(default_factory=list)

    def by_role(self, role: Role) -> list[ProcessSummary]:
        return [p for p in self.processes if p.role == role]


@dataclass
class _Ops:
    """Complete events of one process, per thread, as compact arrays."""

    names: dict[str, int] = field(default_factory=dict)
    hidden: set[int] = field(default_factory=set)
    threads: dict[tuple, tuple[array, array, array]] = field(default_factory=dict)

    def add(self, pid: object, tid: object, ts: float, dur: float, name: str, cat: str) -> None:
        nid = self.names.setdefault(name, len(self.names))
        if cat in ANNOTATION_CATS:
            self.hidden.add(nid)
        cols = self.threads.get((pid, tid))
        if cols is None:
            cols = self.threads[(pid, tid)] = (array("d"), array("d"), array("q"))
        cols[0].append(ts)
        cols[1].append(dur)
        cols[2].append(nid)

    def ranking(self) -> list[OpTime]:
        self_us = np.zeros(len(self.names))
        counts = np.zeros(len(self.names), dtype=np.int64)
        for ts, dur, nid in self.threads.values():
            own, ids = _self_times(np.frombuffer(ts), np.frombuffer(dur), np.frombuffer(nid, dtype=np.int64))
            self_us += np.bincount(ids, weights=own, minlength=len(self.names))
            counts += np.bincount(ids, minlength=len(self.names))
        by_id = {i: n for n, i in self.names.items()}
        ops = [
            OpTime(name=by_id[i], self_ms=round(float(self_us[i]) / 1000, 3), count=int(counts[i]))
            for i in range(len(self.names))
            if i not in self.hidden and counts[i]
        ]
        return sorted(ops, key=lambda o: -o.self_ms)


def _self_times(ts: np.ndarray, dur: np.ndarray, nid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Self time of each event of one thread: its duration less its direct children's (a child
    is clipped to its parent's end). Returns (self times, name ids) in start order."""
    order = np.lexsort((-dur, ts))  # by start; the longer first, so parents precede children
    starts, durs = ts[order].tolist(), dur[order].tolist()
    own = list(durs)
    ends: list[float] = []
    open_: list[int] = []
    for i, (t, d) in enumerate(zip(starts, durs, strict=True)):
        while ends and ends[-1] <= t:
            ends.pop()
            open_.pop()
        e = t + d
        if open_:
            own[open_[-1]] -= min(e, ends[-1]) - t
        ends.append(e)
        open_.append(i)
    return np.maximum(np.asarray(own), 0.0), nid[order]


PIPELINE_P2P = re.compile(r"(gloo|nccl):(send|recv)|c10d::(send|recv_|recv_any_source_)")
"""The events of point-to-point communication (megatron's pipeline p2p, gloo on CPU, NCCL on GPUs)."""


def covered_ms(spans: list[tuple[float, float]], within: list[tuple[float, float]]) -> float:
    """Milliseconds of the union of `spans` (start, duration in µs) inside the union of `within`."""

    def union(xs: list[tuple[float, float]]) -> list[tuple[float, float]]:
        out: list[tuple[float, float]] = []
        for start, dur in sorted(xs):
            end = start + dur
            if out and start <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], end))
            else:
                out.append((start, end))
        return out

    total, windows = 0.0, union(within)
    for a, b in union(spans):
        total += sum(max(0.0, min(b, wb) - max(a, wa)) for wa, wb in windows)
    return total / 1000


class _ProcessReader:
    """Reads every trace file of one entry into a ProcessSummary."""

    def __init__(self, entry: ManifestEntry):
        self.entry = entry
        self.ops = _Ops()
        self.summary = ProcessSummary(
            key=entry.key,
            role=entry.role,
            replica_id=entry.replica_id,
            rank=entry.rank,
            node_id=entry.node_id,
            status=entry.status,
            error=entry.error,
            weight_versions=entry.weight_versions,
            kept=entry.kept,
            started_at=None if entry.started_at is None else reference_s(entry, entry.started_at),
            stopped_at=None if entry.stopped_at is None else reference_s(entry, entry.stopped_at),
            overhead=Overhead(
                finalize_ms=None if entry.finalize_s is None else round(entry.finalize_s * 1000, 3),
                export_ms=None if entry.export_s is None else round(entry.export_s * 1000, 3),
            ),
        )
        self.forward: list[float] = []

    def read(self, inp: TraceInput, on_progress: Callable[[int], None] | None) -> None:
        probe = ClockProbe(self.entry)
        spans: list[tuple[str, float, float]] = []
        p2p: list[tuple[float, float]] = []
        forward_range = self.entry.trace_dialect.forward_range
        s = self.summary
        for ev in iter_events(inp.path, inp.fmt, on_progress):
            probe.see(ev)
            s.events += 1
            if ev.get("ph") != "X":
                continue
            ts, dur = ev.get("ts"), ev.get("dur")
            if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)):
                continue
            name, cat = str(ev.get("name", "")), str(ev.get("cat") or "")
            if name.startswith(CLOCK_PREFIX):
                s.overhead.clock_sync_ms += dur / 1000
                continue
            if "overhead" in cat.lower():
                s.overhead.kineto_ms += dur / 1000
                continue
            if cat == "Trace":
                continue  # Kineto's whole-recording span
            if cat != "gpu_user_annotation":
                if name.startswith(forward_range):
                    spans.append(("forward", ts, dur))
                elif name.startswith(WEIGHT_UPDATE):
                    spans.append(("weight_update", ts, dur))
                elif PIPELINE_P2P.fullmatch(name):
                    p2p.append((ts, dur))
            self.ops.add(ev.get("pid"), ev.get("tid"), ts, dur, name, cat)
        if p2p:
            s.pipeline_wait_ms += covered_ms(p2p, [(ts, dur) for kind, ts, dur in spans if kind == "forward"])
        alignment = probe.alignment(inp.rel, inp.fmt.base_ns)
        s.alignment.append(alignment)
        s.trace_files += 1
        for kind, ts, dur in spans:
            s.phases.append(
                Phase(kind=kind, start=wall_ns(ts, inp.fmt.base_ns, alignment) / 1e9, dur_s=dur / 1e6)
            )
            if kind == "forward":
                self.forward.append(dur / 1000)
            else:
                s.weight_updates += 1
                s.weight_update_ms += dur / 1000

    def finish(self) -> ProcessSummary:
        s = self.summary
        s.forward_steps = len(self.forward)
        s.forward_ms = round(sum(self.forward), 3)
        if self.forward:
            s.forward_mean_ms = round(s.forward_ms / len(self.forward), 3)
            s.forward_max_ms = round(max(self.forward), 3)
        s.weight_update_ms = round(s.weight_update_ms, 3)
        s.pipeline_wait_ms = round(s.pipeline_wait_ms, 3)
        s.overhead.kineto_ms = round(s.overhead.kineto_ms, 3)
        s.overhead.clock_sync_ms = round(s.overhead.clock_sync_ms, 3)
        s.ops = self.ops.ranking()
        s.phases.sort(key=lambda p: p.start)
        return s


def summarize_step(
    store: TraceStore, step: int, on_progress: Callable[[int], None] | None = None
) -> StepSummary:
    """Summarize step `step` from its traces (StepNotFound if there is no such step)."""
    manifest = load_manifest(store, step)
    inputs, skipped = find_inputs(store.step_dir(step), manifest)
    return summarize_manifest(manifest, inputs, skipped, on_progress)


def summarize_manifest(
    manifest: StepManifest,
    inputs: list[TraceInput],
    skipped: list[str],
    on_progress: Callable[[int], None] | None = None,
) -> StepSummary:
    """The summary of `manifest`'s step from its trace `inputs`."""
    skipped = list(skipped)
    processes = []
    for entry in group_order(manifest.entries):
        files = [inp for inp in inputs if inp.entry is entry]
        while True:  # a file that breaks half way is dropped whole: read the others again
            reader = _ProcessReader(entry)
            try:
                for inp in files:
                    failing = inp
                    reader.read(inp, on_progress)
            except (ijson.JSONError, EOFError, OSError, ValueError) as e:
                skipped.append(f"{failing.rel}: unreadable trace ({type(e).__name__}: {e})")
                files.remove(failing)
                continue
            break
        processes.append(reader.finish())
    return StepSummary(
        step=manifest.step,
        steps=manifest.steps,
        status=manifest.status,
        tool=manifest.tool,
        started_at=manifest.started_at,
        stopped_at=manifest.stopped_at,
        sync=manifest.sync,
        control=control_calls(manifest),
        processes=processes,
        skew=_skew([p for p in processes if p.role == "rollout"]),
        breakdown=step_breakdown(
            group_order(manifest.entries),
            {p.key: p.forward_ms for p in processes},
            {p.key: p.pipeline_wait_ms for p in processes},
        ),
        skipped=skipped,
    )


def _skew(replicas: list[ProcessSummary]) -> Skew:
    skew = Skew(replicas=len(replicas))
    started = sorted((p.started_at, p.replica_id) for p in replicas if p.started_at is not None)
    stopped = sorted((p.stopped_at, p.replica_id) for p in replicas if p.stopped_at is not None)
    if started:
        skew.start_spread_ms = round((started[-1][0] - started[0][0]) * 1000, 3)
        skew.first_to_start, skew.last_to_start = started[0][1], started[-1][1]
    if stopped:
        skew.stop_spread_ms = round((stopped[-1][0] - stopped[0][0]) * 1000, 3)
        skew.first_to_stop, skew.last_to_stop = stopped[0][1], stopped[-1][1]
    timed = sorted((p.forward_mean_ms, p.replica_id) for p in replicas if p.forward_mean_ms is not None)
    if timed:
        skew.fastest_forward_mean_ms = timed[0][0]
        skew.slowest_forward_mean_ms, skew.slowest_replica = timed[-1]
    return skew
