"""Synthetic steps for the analysis tests: Kineto-shaped Chrome traces whose clocks are off from
wall clock by known amounts, with the manifest records the session would write for them.

A process's trace clock reads `wall - clock_error_ns`; its clock markers are bracketed
symmetrically by the wall-clock readings, so a correct alignment recovers `clock_error_ns`
exactly and puts every event back at its true wall-clock time.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field

from profiling.config import ProfileOptions
from profiling.manifest import (
    ClockSample,
    ClockSync,
    ManifestEntry,
    SessionRecord,
    SyncCost,
)
from profiling.store import TraceStore

T0_NS = 1_795_000_000_000_000_000
"""Wall-clock origin of the synthetic steps (unix ns, 2026)."""
BASE_NS = 1_790_857_026_000_000_000
"""The traces' baseTimeNanoseconds (a Kineto-style floor)."""
MARKER_DUR_US = 10.0
BRACKET_NS = 20_000
"""Each clock marker is bracketed by wall readings this far before its start and after its end."""


@dataclass
class Ev:
    """A complete event at a true wall-clock time (ns after T0_NS)."""

    name: str
    at_ns: int
    dur_us: float
    cat: str = "cpu_op"
    tid: int | None = None


@dataclass
class Proc:
    """One process of a synthetic step."""

    role: str
    name: str
    """replica id, or the rank as a string."""
    os_pid: int
    clock_error_ns: int = 0
    events: list[Ev] = field(default_factory=list)
    with_clock: bool = True
    window: tuple[int, int] = (0, 100_000_000)
    """(start, stop) ns after T0_NS: the entry's started_at/stopped_at and the clock markers."""
    file: str = "trace.pt.trace.json.gz"
    extra_files: dict[str, bytes] = field(default_factory=dict)
    weight_version: int = 0

    def entry(self) -> ManifestEntry:
        if self.role == "rollout":
            return ManifestEntry(role="rollout", replica_id=self.name, node_id="node-abcdef0123456789")
        return ManifestEntry(role="trainer", rank=int(self.name))


def trace_ts(p: Proc, at_ns: int) -> float:
    """The trace's `ts` (µs after BASE_NS) of true wall time T0_NS + at_ns."""
    return (T0_NS + at_ns - p.clock_error_ns - BASE_NS) / 1000


def marker_events(p: Proc) -> tuple[list[dict], ClockSync | None]:
    if not p.with_clock:
        return [], None
    events, samples = [], {}
    for at, at_ns in (("start", p.window[0]), ("stop", p.window[1] - 100_000)):
        name = f"clock_sync {at} pid={p.os_pid}"
        events.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": name,
                "pid": p.os_pid,
                "tid": p.os_pid,
                "ts": trace_ts(p, at_ns),
                "dur": MARKER_DUR_US,
            }
        )
        samples[at] = ClockSample(
            marker=name,
            wall_before_ns=T0_NS + at_ns - BRACKET_NS,
            wall_after_ns=T0_NS + at_ns + int(MARKER_DUR_US * 1000) + BRACKET_NS,
        )
    return events, ClockSync(**samples)


def kineto_trace(p: Proc) -> tuple[dict, ClockSync | None]:
    """A trace shaped like Kineto's export (header, M events, string-pid side tracks)."""
    first = trace_ts(p, p.window[0])
    meta = [
        {
            "ph": "M",
            "name": "process_name",
            "ts": first,
            "pid": p.os_pid,
            "tid": 0,
            "args": {"name": "python"},
        },
        {
            "ph": "M",
            "name": "process_labels",
            "ts": first,
            "pid": p.os_pid,
            "tid": 0,
            "args": {"labels": "CPU"},
        },
        {
            "ph": "M",
            "name": "process_sort_index",
            "ts": first,
            "pid": p.os_pid,
            "tid": 0,
            "args": {"sort_index": p.os_pid},
        },
        {
            "ph": "M",
            "name": "thread_name",
            "ts": first,
            "pid": p.os_pid,
            "tid": p.os_pid,
            "args": {"name": f"thread {p.os_pid} (python)"},
        },
        {
            "ph": "X",
            "cat": "Trace",
            "name": "PyTorch Profiler (0)",
            "pid": "Spans",
            "tid": "PyTorch Profiler",
            "ts": first,
            "dur": (p.window[1] - p.window[0]) / 1000,
        },
        {
            "ph": "i",
            "s": "g",
            "name": "Iteration Start: PyTorch Profiler",
            "pid": "Traces",
            "tid": "Trace PyTorch Profiler",
            "ts": first,
        },
    ]
    markers, clock = marker_events(p)
    body = [
        {
            "ph": "X",
            "cat": e.cat,
            "name": e.name,
            "pid": p.os_pid,
            "tid": e.tid or p.os_pid,
            "ts": trace_ts(p, e.at_ns),
            "dur": e.dur_us,
            "args": {"External id": i},
        }
        for i, e in enumerate(p.events)
    ]
    # Flow events with small ids, as Kineto writes them: they must not link across processes.
    flows = [
        {
            "ph": "s",
            "id": 1,
            "pid": p.os_pid,
            "tid": p.os_pid,
            "ts": first,
            "cat": "fwdbwd",
            "name": "fwdbwd",
        },
        {
            "ph": "f",
            "id": 1,
            "pid": p.os_pid,
            "tid": p.os_pid,
            "ts": first + 1,
            "cat": "fwdbwd",
            "name": "fwdbwd",
            "bp": "e",
        },
    ]
    trace = {
        "schemaVersion": 1,
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": BASE_NS,
        "traceEvents": meta + markers + body + flows,
    }
    return trace, clock


def write_step(
    store: TraceStore,
    step: int,
    procs: list[Proc],
    *,
    sync_at_ns: int | None = None,
    sync: tuple[float, float, float] = (0.010, 0.020, 0.005),
    stopped: bool = True,
) -> None:
    """Write step `step` under `store`: session record, each process's trace and entry, manifest.
    `sync_at_ns`: when the trainer's sync began (ns after T0_NS); its (stop, update, start) seconds."""
    options = ProfileOptions()
    end = max(p.window[1] for p in procs)
    store.write_session(
        step,
        SessionRecord(
            step=step,
            steps=[step],
            tool="torch",
            options=options,
            started_at=(T0_NS + min(p.window[0] for p in procs)) / 1e9,
            stopped_at=(T0_NS + end) / 1e9 if stopped else None,
            replicas=[p.name for p in procs if p.role == "rollout"],
        ),
    )
    for p in procs:
        entry = p.entry()
        out_dir = store.entry_dir(step, entry)
        out_dir.mkdir(parents=True, exist_ok=True)
        trace, clock = kineto_trace(p)
        path = out_dir / p.file
        data = json.dumps(trace, indent=1).encode()
        path.write_bytes(gzip.compress(data) if p.file.endswith(".gz") else data)
        files = [p.file, *p.extra_files]
        for name, content in p.extra_files.items():
            (out_dir / name).write_bytes(content)
        entry = entry.model_copy(
            update={
                "pid": p.os_pid,
                "files": [store.relative(step, out_dir / f) for f in files],
                "bytes": sum((out_dir / f).stat().st_size for f in files),
                "weight_version": p.weight_version,
                "weight_versions": [p.weight_version],
                "started_at": (T0_NS + p.window[0]) / 1e9,
                "stopped_at": (T0_NS + p.window[1]) / 1e9,
                "forward_steps": sum(e.name.startswith("forward_step#") for e in p.events),
                "finalize_s": 0.05,
                "export_s": 0.2,
                "clock": clock,
            }
        )
        if p.role == "trainer" and sync_at_ns is not None:
            entry.sync = SyncCost(
                stop_s=sync[0], update_s=sync[1], start_s=sync[2], began_at=(T0_NS + sync_at_ns) / 1e9
            )
        store.write_entry(step, entry)
    store.refresh_manifest(step)


def forward(
    i: int, step: int, version: int, at_ns: int, dur_us: float, ops: list[tuple[str, float]] = ()
) -> list[Ev]:
    """A forward_step range and ops nested in it, back to back from its start."""
    evs = [Ev(f"forward_step#{i} step={step} weight_version={version}", at_ns, dur_us, cat="user_annotation")]
    t = at_ns + 1_000
    for name, d in ops:
        evs.append(Ev(name, t, d))
        t += int(d * 1000) + 1_000
    return evs
