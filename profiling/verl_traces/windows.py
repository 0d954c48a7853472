"""Time ranges of verl's traces, and the matching of each rollout recording to the step whose
trainer window holds its stop (docs/analysis.md#verl).

In verl (the fully-async trainer's `_fit_update_weights`, and the synchronous trainer's
`fit`), the rollout's profiling window of step k is started after the weight sync that
published version k-1 and stopped before the sync that publishes version k; the trainer's
window(s) of step k cover its steps producing version k, and the sync publishing version k runs
inside the last of them. So a recording belongs to the step k whose trainer window (every trainer
trace of step k, first event to last) contains the recording's stop. Its start may lie anywhere
before (in the previous step's trainer window, or between windows when that step was not
profiled), so it decides nothing.

The match reads the trainer's and the rollout's traces on their own hosts' wall clocks: verl runs
no clock exchange, so it assumes those clocks agree (one host: one clock), and says how far each
stop lies inside its window (the margin) so a reader can judge.
"""

from __future__ import annotations

from pydantic import BaseModel

from profiling.analysis.trace_span import TraceSpan, clock_text, span_text
from profiling.verl_traces.layout import Engine, RolloutTrace, TrainerTrace, step_of


class SpannedTrainer(BaseModel):
    """A trainer trace and its window."""

    trace: TrainerTrace
    span: TraceSpan


class SpannedRollout(BaseModel):
    """A rollout trace and its window; `span.ranges` counts its engine steps."""

    trace: RolloutTrace
    span: TraceSpan


class TrainerWindow(BaseModel):
    """Step k's trainer window: its trainer traces, every rank, first event to last."""

    step: int
    started_ns: int
    stopped_ns: int
    trainer_steps: list[int]
    """verl's steps (`step<S>`) whose files make the window."""
    traces: list[SpannedTrainer]

    @property
    def hosts(self) -> list[str]:
        return sorted({t.span.host for t in self.traces if t.span.host})


class Recording(BaseModel):
    """One replica's start/stop window: the files its engine's workers wrote for it (one per
    worker; they overlap in time)."""

    replica: int
    engine: Engine
    files: list[SpannedRollout]

    @property
    def started_ns(self) -> int:
        return min(f.span.first_ns for f in self.files)

    @property
    def stopped_ns(self) -> int:
        return max(f.span.last_ns for f in self.files)

    @property
    def hosts(self) -> list[str]:
        return sorted({f.span.host for f in self.files if f.span.host})

    @property
    def label(self) -> str:
        names = ", ".join(f.trace.rel for f in self.files)
        return f"replica {self.replica} ({names})"


class Assigned(BaseModel):
    """A recording placed in its step."""

    recording: Recording
    window: TrainerWindow
    margin_ns: int
    """The stop's distance to the nearer edge of the trainer window."""


class Unassigned(BaseModel):
    """A recording placed in no step, and why."""

    recording: Recording
    why: str


def trainer_windows(traces: list[SpannedTrainer], sync_every: int) -> dict[int, TrainerWindow]:
    """Step -> its trainer window, for the traces whose names carry verl's step (mapped to this
    project's step by `step_of` with `sync_every` = trigger_parameter_sync_step)."""
    by_step: dict[int, list[SpannedTrainer]] = {}
    for t in traces:
        if t.trace.step is not None:
            by_step.setdefault(step_of(t.trace.step, sync_every), []).append(t)
    return {
        k: TrainerWindow(
            step=k,
            started_ns=min(t.span.first_ns for t in ts),
            stopped_ns=max(t.span.last_ns for t in ts),
            trainer_steps=sorted({t.trace.step for t in ts if t.trace.step is not None}),
            traces=ts,
        )
        for k, ts in sorted(by_step.items())
    }


def recordings(traces: list[SpannedRollout]) -> list[Recording]:
    """The rollout traces grouped into recordings: per replica, files whose windows overlap are
    one window's workers; windows that do not overlap are separate recordings."""
    out: list[Recording] = []
    by_replica: dict[int, list[SpannedRollout]] = {}
    for t in traces:
        by_replica.setdefault(t.trace.replica, []).append(t)
    for replica, ts in sorted(by_replica.items()):
        ts.sort(key=lambda t: t.span.first_ns)
        current: list[SpannedRollout] = []
        for t in ts:
            if current and (
                t.span.first_ns > max(c.span.last_ns for c in current) or t.trace.engine != current[0].trace.engine
            ):
                out.append(Recording(replica=replica, engine=current[0].trace.engine, files=current))
                current = []
            current.append(t)
        if current:
            out.append(Recording(replica=replica, engine=current[0].trace.engine, files=current))
    return out


def match(found: list[Recording], windows: dict[int, TrainerWindow]) -> tuple[list[Assigned], list[Unassigned]]:
    """Each recording assigned to the one step whose trainer window holds its stop, or not
    assigned, saying why (with the times): no window holds it, two do, or the replica has two
    recordings stopping in one window (which of them is the step's cannot be told by time)."""
    assigned: list[Assigned] = []
    unassigned: list[Unassigned] = []
    for rec in found:
        stop = rec.stopped_ns
        holding = [w for w in windows.values() if w.started_ns <= stop <= w.stopped_ns]
        if len(holding) == 1:
            w = holding[0]
            assigned.append(Assigned(recording=rec, window=w, margin_ns=min(stop - w.started_ns, w.stopped_ns - stop)))
        elif holding:
            steps = " and ".join(f"{w.step} ({span_text(w.started_ns, w.stopped_ns)})" for w in holding)
            unassigned.append(
                Unassigned(
                    recording=rec,
                    why=f"stopped at {clock_text(stop)}, inside the trainer windows of steps {steps}, which "
                    "overlap: which step's generation it holds cannot be told by time",
                )
            )
        else:
            unassigned.append(Unassigned(recording=rec, why=_outside(stop, windows)))
    crowded: dict[tuple[int, int], list[Assigned]] = {}
    for a in assigned:
        crowded.setdefault((a.recording.replica, a.window.step), []).append(a)
    kept: list[Assigned] = []
    for (replica, k), group in crowded.items():
        if len(group) == 1:
            kept += group
            continue
        for a in group:
            unassigned.append(
                Unassigned(
                    recording=a.recording,
                    why=f"one of {len(group)} recordings of replica {replica} stopping inside step {k}'s trainer "
                    f"window ({span_text(a.window.started_ns, a.window.stopped_ns)}): which of them is step {k}'s "
                    "generation cannot be told by time",
                )
            )
    kept.sort(key=lambda a: (a.window.step, a.recording.replica))
    return kept, unassigned


def _outside(stop: int, windows: dict[int, TrainerWindow]) -> str:
    if not windows:
        return f"stopped at {clock_text(stop)}; no trainer trace names a step: there is no trainer window"
    nearest = min(windows.values(), key=lambda w: min(abs(stop - w.started_ns), abs(stop - w.stopped_ns)))
    if stop < nearest.started_ns:
        where = f"{(nearest.started_ns - stop) / 1e9:.3f} s before it opened"
    else:
        where = f"{(stop - nearest.stopped_ns) / 1e9:.3f} s after it closed"
    return (
        f"stopped at {clock_text(stop)}, inside no step's trainer window; the nearest is step {nearest.step}'s "
        f"({span_text(nearest.started_ns, nearest.stopped_ns)}), {where}: its step was not profiled on the "
        "trainer, or the trainer's and the rollout's clocks disagree"
    )


def clocks_assumed(hosts: list[str]) -> str:
    """What placing traces by their own timestamps assumes of the hosts' clocks, in words."""
    if len(hosts) == 1:
        return f"every trace names one host ({hosts[0]}), so they share its wall clock"
    if hosts:
        return (
            f"the traces name hosts {', '.join(hosts)}, whose wall clocks are taken to agree (NTP): "
            "verl runs no clock exchange, so nothing measured it"
        )
    return (
        "the traces name no host; their clocks are taken to agree: verl runs no clock exchange, so nothing measured it"
    )
