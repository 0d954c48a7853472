"""`python -m profiling verl`: verl's own profiler output made into this project's steps
(docs/analysis.md#verl).

Two shapes of input:

* **verl alone** (no change to the run): its trainer traces (step<S> in the name) and its
  rollout engines' recordings (no step, no version) in `global_profiler.save_path`. Each step k
  gets `step_<k>/` with a trainer entry per rank (the files of verl steps (k-1)·T+1 .. k·T) and a
  rollout entry per replica whose recording stopped inside the step's trainer window
  (`windows.match`), weight version k-1 asserted by that match (`WindowMatch`).
* **verl through this project's plugin**: the app already wrote exact, version-keyed
  `step_<k>/` directories (its rollout entries carry this project's markers) into its
  save_path; verl's trainer traces sit in verl's save_path beside the ranks' clock records
  (`clocks.CLOCKS_FILE`). Each app step gets the trainer entries of its verl steps, with their
  measured `clock_offset`; rollout recordings by time are used only for steps the app did not
  write.

Traces are hard-linked into the steps (copied across filesystems); verl's files are never moved
or deleted. Every step built is then merged, its ranks view written and its report made, by the
same functions as the app's steps. A re-run replaces what an earlier run wrote (its
`verl_ingest.record` lists it) and nothing else; runs on one output are serialised by a lock
(verl's finish hook may run on several ranks at once).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import ijson
from pydantic import BaseModel

from profiling.analysis.events import NotATrace
from profiling.analysis.merge import MergeError, merge_step
from profiling.analysis.report import write_reports
from profiling.analysis.sources import load_manifest
from profiling.analysis.tool_view import ViewError, build_tool_view
from profiling.analysis.trace_span import NoAbsoluteTime, read_span
from profiling.manifest import (
    ManifestEntry,
    ManifestStatus,
    MergeRecord,
    TraceDialect,
    TrainerRecord,
    WindowMatch,
)
from profiling.store import ENTRY_FILE, SESSION_FILE, TraceStore, atomic_write_text
from profiling.verl_traces.clocks import TrainerClock, clock_for, read_trainer_clocks
from profiling.verl_traces.layout import FORWARD_RANGE, Artifact, VerlLayout, scan_layout, step_of
from profiling.verl_traces.windows import (
    Assigned,
    Recording,
    SpannedRollout,
    SpannedTrainer,
    TrainerWindow,
    Unassigned,
    clocks_assumed,
    match,
    recordings,
    span_text,
    trainer_windows,
)

INGEST_RECORD = "verl_ingest.record"
"""In each step built: what the ingest wrote there (not `*.json`: trace tools read those)."""
LOCK_FILE = ".verl_ingest.lock"
_UNREADABLE = (NotATrace, NoAbsoluteTime, ijson.JSONError, EOFError, zlib.error, OSError, ValueError)


class NoVerlTraces(ValueError):
    """The directory holds no trace of verl's profilers; the message says what it holds and the fix."""


class IngestRecord(BaseModel):
    """`step_<k>/verl_ingest.record`: what `python -m profiling verl` wrote into the step, so
    that a re-run replaces exactly that (in a step the app wrote, nothing of the app's)."""

    source: str
    """verl's save_path the traces came from."""
    trigger_parameter_sync_step: int
    trainer_steps: list[int]
    """verl's steps whose trainer traces the step holds."""
    entries: list[str]
    """The entries written (`trainer/rank_<r>`, `rollout/<replica_id>`)."""
    app_step: bool
    """The app wrote the step; only trainer entries were added to it."""
    built_at: float


class RolloutPlaced(BaseModel):
    """A rollout recording placed in a step."""

    replica_id: str
    files: list[str]
    stopped_at: float
    margin_s: float


class StepBuilt(BaseModel):
    """One step the ingest built or completed."""

    step: int
    app_step: bool
    """The app wrote it (the plugin's shape): trainer entries were added to it."""
    trainer_steps: list[int]
    status: ManifestStatus
    trainer_window: tuple[float, float] | None = None
    """Unix seconds, first to last event of the step's trainer traces."""
    files: dict[str, list[str]]
    """Entry -> the file names it took from verl's save_path."""
    kept: list[str] = []
    """The app's own entries left as they were (a trainer rank it had already recorded)."""
    rollout: list[RolloutPlaced] = []
    errors: list[str] = []
    """`<entry>: <why>` for each entry in error (the step is partial)."""
    not_merged: list[str] = []
    """Other tools' output whose name puts it in this step (nsys, NPU): `<path>: <why>`."""
    merge: MergeRecord | None = None
    failed: list[str] = []
    """What could not be made: the merge, the ranks view (each naming the fix)."""


class IngestReport(BaseModel):
    """What `ingest` did."""

    save_path: str
    out: str
    trigger_parameter_sync_step: int
    trainer_files: int
    rollout_files: int
    steps: list[StepBuilt]
    unassigned: list[str]
    """Rollout recordings placed in no step: `<replica (files)>: <why, with the times>`."""
    not_assigned: list[str]
    """Other tools' output placed in no step, and files not recognised: `<path>: <why>`."""
    unreadable: list[str]
    """Trace files that could not be read: `<path>: <why>`."""
    left: list[str]
    """Steps left untouched: `step_<k>: <why>`."""
    removed: list[str]
    """What an earlier run built from the same traces that is no step now (another
    trigger_parameter_sync_step): `step_<k>...: <what>`."""
    clock_problems: list[str]
    index: str | None = None

    @property
    def ok(self) -> bool:
        return not any(s.failed for s in self.steps)


def ingest(
    save_path: Path,
    out: Path | None = None,
    sync_every: int = 1,
    on_step: Callable[[str], None] | None = None,
) -> IngestReport:
    """Build `out/step_<k>/` (default: in `save_path`) from verl's profiler output in
    `save_path`, merge, view and report each step built; `sync_every` is verl's
    trigger_parameter_sync_step. Steps the app already wrote in `out` get the trainer entries.
    `on_step(message)` is told what is being done. NoVerlTraces when save_path holds none."""
    if sync_every < 1:
        raise ValueError(f"trigger_parameter_sync_step must be at least 1, got {sync_every}")
    save_path, out = save_path.resolve(), (out or save_path).resolve()
    layout = scan_layout(save_path, exclude=out)
    if layout.empty:
        raise NoVerlTraces(_nothing_found(save_path, layout))
    out.mkdir(parents=True, exist_ok=True)
    say = on_step or (lambda _: None)
    with open(out / LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _Ingest(layout, save_path, TraceStore(out), sync_every, say).run()


def _nothing_found(save_path: Path, layout: VerlLayout) -> str:
    held = ", ".join(a.rel for a in layout.other[:5]) or "nothing"
    more = f" and {len(layout.other) - 5} more" if len(layout.other) > 5 else ""
    return (
        f"no verl traces in {save_path} (it holds {held}{more}): expected verl's trainer traces "
        "(`<role>_train_step<S>_rank<r>_pid<pid>_<time>.json.gz`) or `agent_loop_rollout_replica_<r>/`; pass "
        "verl's global_profiler.save_path with global_profiler.tool: torch, after a profiled step has run"
    )


class _Ingest:
    """One run of the ingest, under the output's lock."""

    def __init__(
        self, layout: VerlLayout, save_path: Path, store: TraceStore, sync_every: int, say: Callable[[str], None]
    ):
        self.layout, self.save_path, self.store, self.sync_every, self.say = layout, save_path, store, sync_every, say
        self.unreadable: list[str] = []
        self.broken: dict[tuple[int, int], list[str]] = {}
        """(step, rank) -> why each of its trainer traces that could not be read"""
        self.left: list[str] = []
        self.clocks, self.clock_problems = read_trainer_clocks(save_path)

    def run(self) -> IngestReport:
        trainer, rollout = self._spans()
        windows = trainer_windows(trainer, self.sync_every)
        assigned, unassigned = match(recordings(rollout), windows)
        replicas = sorted({t.trace.replica for t in rollout})
        built: list[StepBuilt] = []
        for k, window in windows.items():
            kind = self._kind(k)
            placed = [a for a in assigned if a.window.step == k]
            if kind == "ours":
                self.say(f"building step {k}")
                built.append(self._build_step(k, window, placed, replicas))
                continue
            if kind == "app":
                self.say(f"adding the trainer's traces to the app's step {k}")
                built.append(self._complete_app_step(k, window))
            else:
                self.left.append(
                    f"step_{k}: a directory neither the app nor this command wrote (no records, no "
                    f"{INGEST_RECORD}); move it away to build step {k} here"
                )
            whose = "the app's step, whose own rollout entries stand" if kind == "app" else "left as is"
            unassigned += [
                Unassigned(
                    recording=a.recording, why=f"stopped inside step {k}'s trainer window, but step_{k} is {whose}"
                )
                for a in placed
            ]
        removed = self._drop_stale({s.step for s in built})
        others, not_assigned = self._artifacts(built)
        for s in built:
            s.not_merged = others.get(s.step, [])
        for s in built:
            self.say(f"merging step {s.step}")
            self._analyse(s)
        index = None
        if built:
            self.say("writing the reports")
            index = str(write_reports(self.store, [s.step for s in built]).index)
            for s in built:
                s.status = load_manifest(self.store, s.step).status
        return IngestReport(
            save_path=str(self.save_path),
            out=str(self.store.root),
            trigger_parameter_sync_step=self.sync_every,
            trainer_files=len(self.layout.trainer),
            rollout_files=len(self.layout.rollout),
            steps=built,
            unassigned=[f"{u.recording.label}: {u.why}" for u in unassigned],
            not_assigned=not_assigned,
            unreadable=self.unreadable,
            left=self.left,
            removed=removed,
            clock_problems=self.clock_problems,
            index=index,
        )

    # -- reading --------------------------------------------------------------------------
    def _spans(self) -> tuple[list[SpannedTrainer], list[SpannedRollout]]:
        trainer, rollout = [], []
        for t in self.layout.trainer:
            self.say(f"reading {t.name}")
            try:
                trainer.append(SpannedTrainer(trace=t, span=read_span(self.save_path / t.name)))
            except _UNREADABLE as e:
                self.unreadable.append(f"{t.name}: {type(e).__name__}: {e}")
                if t.step is not None:
                    key = (step_of(t.step, self.sync_every), t.rank)
                    self.broken.setdefault(key, []).append(f"{t.name} ({type(e).__name__}: {e})")
        for r in self.layout.rollout:
            self.say(f"reading {r.rel}")
            try:
                span = read_span(self.save_path / r.rel, FORWARD_RANGE[r.engine])
            except _UNREADABLE as e:
                self.unreadable.append(f"{r.rel}: {type(e).__name__}: {e}")
                continue
            rollout.append(SpannedRollout(trace=r, span=span))
        return trainer, rollout

    def _kind(self, k: int) -> str:
        """`ours` (absent, empty, or built by an earlier run), `app` (the app wrote it) or
        `foreign` (anything else: left alone)."""
        step_dir = self.store.step_dir(k)
        record = _read_record(step_dir)
        if record is not None:
            return "app" if record.app_step else "ours"
        if (step_dir / SESSION_FILE).is_file() or self.store.read_entries(k):
            return "app"
        if step_dir.is_dir() and any(step_dir.iterdir()):
            return "foreign"
        return "ours"

    # -- building -------------------------------------------------------------------------
    def _build_step(self, k: int, window: TrainerWindow, placed: list[Assigned], replicas: list[int]) -> StepBuilt:
        step_dir = self.store.step_dir(k)
        if step_dir.exists():
            shutil.rmtree(step_dir)  # an earlier run's step: links and copies only, never verl's files
        step_dir.mkdir(parents=True)
        hosts = sorted({*window.hosts, *(h for a in placed for h in a.recording.hosts)})
        step = StepBuilt(
            step=k,
            app_step=False,
            trainer_steps=window.trainer_steps,
            status="partial",
            trainer_window=(window.started_ns / 1e9, window.stopped_ns / 1e9),
            files={},
        )
        keys = [*self._trainer_entries(k, window, hosts, step), *self._rollout_entries(k, placed, hosts, step)]
        for r in sorted(set(replicas) - {a.recording.replica for a in placed}):
            entry = ManifestEntry(
                role="rollout",
                replica_id=_replica_id(r),
                status="error",
                error=f"no recording of replica {r} stopped inside step {k}'s trainer window "
                f"({span_text(window.started_ns, window.stopped_ns)}): verl did not profile its generation of step {k} "
                "(the rollout profiler off, or not selecting this replica), the recording is among those not "
                "assigned, or --trigger-parameter-sync-step is not the run's",
            )
            self.store.write_entry(k, entry)
            keys.append(entry.key)
            step.errors.append(f"{entry.key}: {entry.error}")
        self._write_record(k, window, keys, app_step=False)
        return step

    def _complete_app_step(self, k: int, window: TrainerWindow) -> StepBuilt:
        step_dir = self.store.step_dir(k)
        earlier = _read_record(step_dir)
        for key in earlier.entries if earlier else []:
            shutil.rmtree(step_dir / key, ignore_errors=True)  # what the earlier run added, only
        hosts = sorted({*window.hosts, *(c.hostname for c in self.clocks)})
        step = StepBuilt(
            step=k,
            app_step=True,
            trainer_steps=window.trainer_steps,
            status="partial",
            trainer_window=(window.started_ns / 1e9, window.stopped_ns / 1e9),
            files={},
        )
        keys = self._trainer_entries(k, window, hosts, step)
        self._write_record(k, window, keys, app_step=True)
        return step

    def _trainer_entries(self, k: int, window: TrainerWindow, hosts: list[str], step: StepBuilt) -> list[str]:
        by_rank: dict[int, list[SpannedTrainer]] = {}
        for t in window.traces:
            by_rank.setdefault(t.trace.rank, []).append(t)
        keys = []
        for rank in sorted({r for step_, r in self.broken if step_ == k} - set(by_rank)):
            entry = ManifestEntry(
                role="trainer",
                rank=rank,
                status="error",
                error=f"its traces could not be read: {'; '.join(self.broken[(k, rank)])}",
            )
            if not (self.store.trainer_dir(k, rank) / ENTRY_FILE).is_file():
                self.store.write_entry(k, entry)
                keys.append(entry.key)
                step.errors.append(f"{entry.key}: {entry.error}")
        for rank, traces in sorted(by_rank.items()):
            entry_dir = self.store.trainer_dir(k, rank)
            if (entry_dir / ENTRY_FILE).is_file():
                step.kept.append(f"trainer/rank_{rank}")  # the app's own record of this rank
                continue
            traces.sort(key=lambda t: t.span.first_ns)
            names = [t.trace.name for t in traces]
            _link_all(self.save_path, names, entry_dir)
            pid = traces[0].trace.pid
            offset = clock_for(self.clocks, rank, pid, k) if self.clocks else None
            entry = ManifestEntry(
                role="trainer",
                rank=rank,
                pid=pid,
                files=[self.store.relative(k, entry_dir / n) for n in names],
                bytes=sum((entry_dir / n).stat().st_size for n in names),
                weight_version=k - 1,
                weight_versions=[k - 1],
                started_at=min(t.span.first_ns for t in traces) / 1e9,
                stopped_at=max(t.span.last_ns for t in traces) / 1e9,
                clock_offset=offset,
                clock_unmeasured=None if offset is not None else _unmeasured(hosts, self.clocks, rank),
            )
            self.store.write_entry(k, entry)
            keys.append(entry.key)
            step.files[entry.key] = names
        return keys

    def _rollout_entries(self, k: int, placed: list[Assigned], hosts: list[str], step: StepBuilt) -> list[str]:
        keys = []
        for a in placed:
            rec = a.recording
            entry_dir = self.store.rollout_dir(k, _replica_id(rec.replica))
            files = sorted(rec.files, key=lambda f: f.span.first_ns)
            _link_all(self.save_path, [f.trace.rel for f in files], entry_dir)
            names = [f.trace.name for f in files]
            entry = ManifestEntry(
                role="rollout",
                replica_id=_replica_id(rec.replica),
                files=[self.store.relative(k, entry_dir / n) for n in names],
                bytes=sum((entry_dir / n).stat().st_size for n in names),
                weight_version=k - 1,
                weight_versions=[k - 1],
                started_at=rec.started_ns / 1e9,
                stopped_at=rec.stopped_ns / 1e9,
                forward_steps=max(f.span.ranges for f in files),
                trace_dialect=TraceDialect(forward_range=FORWARD_RANGE[rec.engine], version_in="window"),
                window_match=_window_match(a),
                clock_unmeasured=_unmeasured(hosts, [], None),
            )
            self.store.write_entry(k, entry)
            keys.append(entry.key)
            step.files[entry.key] = names
            step.rollout.append(
                RolloutPlaced(
                    replica_id=entry.replica_id or "",
                    files=names,
                    stopped_at=rec.stopped_ns / 1e9,
                    margin_s=a.margin_ns / 1e9,
                )
            )
        return keys

    def _write_record(self, k: int, window: TrainerWindow, keys: list[str], app_step: bool) -> None:
        record = IngestRecord(
            source=str(self.save_path),
            trigger_parameter_sync_step=self.sync_every,
            trainer_steps=window.trainer_steps,
            entries=keys,
            app_step=app_step,
            built_at=time.time(),
        )
        atomic_write_text(self.store.step_dir(k) / INGEST_RECORD, record.model_dump_json(indent=2))
        ranks = sorted({t.trace.rank for t in window.traces})
        sizes = {t.trace.world_size for t in window.traces if t.trace.world_size}
        world_size = sizes.pop() if len(sizes) == 1 else None

        def add_ranks(r: TrainerRecord) -> TrainerRecord:
            return r.model_copy(update={"ranks": sorted({*r.ranks, *ranks}), "world_size": r.world_size or world_size})

        self.store.update_trainer_record(k, add_ranks)  # refreshes the manifest

    def _drop_stale(self, built: set[int]) -> list[str]:
        """Remove what earlier runs on these traces built in steps this run did not build (the
        mapping changed): their whole step, or in the app's steps only the entries they added."""
        removed = []
        for k in self.store.steps():
            step_dir = self.store.step_dir(k)
            record = _read_record(step_dir)
            # Steps in verl's own save_path hold its traces, wherever that directory was copied.
            ours = record is not None and (record.source == str(self.save_path) or self.store.root == self.save_path)
            if k in built or record is None or not ours:
                continue
            if not record.app_step:
                shutil.rmtree(step_dir)
                removed.append(f"step_{k}: built by an earlier run from these traces, not a step of this mapping")
                continue
            for key in record.entries:
                shutil.rmtree(step_dir / key, ignore_errors=True)
            (step_dir / INGEST_RECORD).unlink()
            self.store.refresh_manifest(k)
            removed.append(
                f"step_{k}/{', '.join(record.entries)}: added to the app's step by an earlier run, not of this "
                f"mapping; re-merge it: python -m profiling merge {self.store.root} --step {k}"
            )
        return removed

    # -- the rest -------------------------------------------------------------------------
    def _artifacts(self, built: list[StepBuilt]) -> tuple[dict[int, list[str]], list[str]]:
        """Other tools' output by the step its name gives (of the steps built), and the rest."""
        steps = {s.step for s in built}
        by_step: dict[int, list[str]] = {}
        rest: list[str] = []
        for a in self.layout.other:
            k = None if a.verl_step is None else step_of(a.verl_step, self.sync_every)
            if k in steps:
                by_step.setdefault(k, []).append(_artifact_text(a))
            elif a.kind != "clock_records":
                rest.append(_artifact_text(a))
        for t in self.layout.trainer:
            if t.step is None:
                rest.append(f"{t.name}: a trainer trace without a step in its name (started without profile_step)")
        return by_step, rest

    def _analyse(self, step: StepBuilt) -> None:
        try:
            step.merge = merge_step(self.store, step.step)
        except MergeError as e:
            step.failed.append(str(e))
        try:
            build_tool_view(self.store, step.step)
        except ViewError as e:
            step.failed.append(str(e))


def _read_record(step_dir: Path) -> IngestRecord | None:
    try:
        return IngestRecord.model_validate_json((step_dir / INGEST_RECORD).read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None


def _link_all(root: Path, rels: list[str], into: Path) -> None:
    """Hard-link each of `rels` (under `root`) into `into` by its name; a copy where a link
    cannot be made (another filesystem). The originals are never moved or changed."""
    into.mkdir(parents=True, exist_ok=True)
    for rel in rels:
        src, dst = root / rel, into / Path(rel).name
        dst.unlink(missing_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)


def _replica_id(replica: int) -> str:
    return f"replica{replica}"


def _window_match(a: Assigned) -> WindowMatch:
    rec, w = a.recording, a.window
    hosts = sorted({*rec.hosts, *w.hosts})
    return WindowMatch(
        trainer_started_at=w.started_ns / 1e9,
        trainer_stopped_at=w.stopped_ns / 1e9,
        margin_s=a.margin_ns / 1e9,
        trainer_steps=w.trainer_steps,
        hosts=hosts,
        clocks=_match_clocks(rec, w),
    )


def _match_clocks(rec: Recording, w: TrainerWindow) -> str:
    if rec.hosts and rec.hosts == w.hosts and len(rec.hosts) == 1:
        return f"the recording and the trainer window name one host ({rec.hosts[0]}): one wall clock"
    return (
        f"the recording names host(s) {', '.join(rec.hosts) or 'none'} and the trainer window "
        f"{', '.join(w.hosts) or 'none'}: their clocks are taken to agree to well within the margin, which "
        "nothing measured (verl runs no clock exchange)"
    )


def _unmeasured(hosts: list[str], clocks: list[TrainerClock], rank: int | None) -> str:
    why = f"the plugin's clock records hold none for trainer rank {rank}" if clocks else "verl runs no clock exchange"
    return (
        f"not measured ({why}): the timeline places this trace by its own timestamps (Kineto's ts and "
        f"baseTimeNanoseconds, its host's wall clock); {clocks_assumed(hosts)}"
    )


def _artifact_text(a: Artifact) -> str:
    return f"{a.rel}: {a.why}"
