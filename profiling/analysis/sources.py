"""What a step's records say to the analysis: its manifest, which files are traces and which
process each belongs to, and when the trainer's control calls ran.

Every manifest entry is one process group in the merged timeline; each of its files that is a
Chrome trace (`.json` / `.json.gz` with `traceEvents`, or a JSON array of events) is an input.
Everything else (e.g. `*.profiler_out.txt`, NPU raw data) is skipped with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from profiling.analysis.clocks import reference_s
from profiling.analysis.events import NotATrace, TraceFormat, sniff
from profiling.manifest import ManifestEntry, StepManifest
from profiling.store import TraceStore


class StepNotFound(LookupError):
    """No such step under the save path; the message names the fix."""


class ControlCall(BaseModel):
    """One of the trainer's control calls of the sync that ended the step, in wall-clock time."""

    name: str
    start: float
    """Unix seconds on the reference clock (the app controller's)."""
    dur_s: float
    caller: str


def load_manifest(store: TraceStore, step: int) -> StepManifest:
    """The step's manifest derived from its records now (not the possibly older manifest.json,
    unless the records are gone), or StepNotFound."""
    step_dir = store.step_dir(step)
    if not step_dir.is_dir():
        have = ", ".join(map(str, store.steps())) or "none"
        raise StepNotFound(f"no step_{step} under {store.root} (steps there: {have})")
    session, entries = store.read_session(step), store.read_entries(step)
    if session is None and not entries:
        found = store.read_manifest(step)
        if found is not None:
            return found
    return StepManifest.assemble(step, session, entries)


def control_calls(manifest: StepManifest) -> list[ControlCall]:
    """stop / update_weights / start of the sync that ended the step, placed from each trainer
    entry's `sync.began_at` (on the reference clock: the trainer's `clock_offset` added) and
    measured durations (the calls run back to back)."""
    calls = []
    for e in group_order(manifest.entries):
        s = e.sync
        if e.role != "trainer" or s is None or s.began_at is None:
            continue
        at = reference_s(e, s.began_at)
        for name, dur in (
            (f"stop step {manifest.step}", s.stop_s),
            (f"update_weights v{manifest.steps[-1]}", s.update_s),
            (f"start step {manifest.steps[-1] + 1}", s.start_s),
        ):
            if dur is not None:
                calls.append(
                    ControlCall(name=name, start=at, dur_s=dur, caller=e.trainer_name)
                )
                at += dur
    return calls


@dataclass(frozen=True)
class TraceInput:
    """One trace file of one process."""

    entry: ManifestEntry
    group: int
    """Index of the entry's process group (trainer ranks first, then replicas by id)."""
    rel: str
    """The file, relative to the step directory (as listed in the manifest)."""
    path: Path
    fmt: TraceFormat

    @property
    def size(self) -> int:
        return self.path.stat().st_size


def group_order(entries: list[ManifestEntry]) -> list[ManifestEntry]:
    """Trainer ranks first (by rank), then rollout replicas (by id): the timeline's row order."""
    return sorted(entries, key=lambda e: (e.role != "trainer", e.rank or 0, e.replica_id or ""))


def group_name(entry: ManifestEntry) -> str:
    """`trainer rank 0` (`trainer tp1 pp0 (rank 1)` with Megatron's coordinates) or
    `rollout <replica_id> (node <id>, weights v<k>)`."""
    if entry.role == "trainer":
        return entry.trainer_name
    versions = entry.weight_versions or ([entry.weight_version] if entry.weight_version is not None else [])
    facts = []
    if entry.node_id:
        facts.append(f"node {entry.node_id[:12]}")
    if versions:
        facts.append("weights " + ",".join(f"v{v}" for v in versions))
    return f"rollout {entry.replica_id}" + (f" ({', '.join(facts)})" if facts else "")


def find_inputs(step_dir: Path, manifest: StepManifest) -> tuple[list[TraceInput], list[str]]:
    """The step's trace inputs in timeline order, and `'<file>: <why>'` for each file skipped."""
    inputs: list[TraceInput] = []
    skipped: list[str] = []
    for group, entry in enumerate(group_order(manifest.entries)):
        for rel in entry.files:
            path = step_dir / rel
            if not path.is_file():
                skipped.append(f"{rel}: listed in the manifest but missing")
                continue
            try:
                fmt = sniff(path)
            except NotATrace as e:
                skipped.append(f"{rel}: {e}")
                continue
            inputs.append(TraceInput(entry, group, rel, path, fmt))
    return inputs, skipped
