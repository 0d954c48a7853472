"""The trace store: the on-disk layout of docs/design.md#traces-on-disk, atomic writes, and guards.

    <save_path>/step_<k>/manifest.json
    <save_path>/step_<k>/session.json                 controller's record
    <save_path>/step_<k>/rollout/<replica_id>/...     engine traces + entry.record
    <save_path>/step_<k>/trainer/rank_<r>/...         trainer traces + entry.record
    <save_path>/step_<k>/trainer/ranks.record         the trainer ranks selected, and those that died
    <save_path>/step_<k>/ranks/                       every trace as a rank (profiling.analysis.tool_view)
    <save_path>/step_<k>/merged.trace.json.gz         one timeline (profiling.analysis.merge)
    <save_path>/step_<k>/merge.json                   the last merge's record
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from profiling.config import MAX_STEP, check_safe_name
from profiling.manifest import ManifestEntry, MergeRecord, SessionRecord, StepManifest, TrainerRecord

ENTRY_FILE = "entry.record"
"""A producer's manifest entry (JSON) beside its traces. Not `*.json`: trace tools (HTA,
TensorBoard's profiler plugin) take every `*.json` / `*.gz` of a directory for a trace."""
LEGACY_ENTRY_FILE = "entry.json"
"""The entry's name before `entry.record`; still read, never written."""
SESSION_FILE = "session.json"
TRAINER_RECORD = "trainer/ranks.record"
"""The trainer's ranks record (profiling.manifest.TrainerRecord), relative to the step dir."""
MANIFEST_FILE = "manifest.json"
MERGE_FILE = "merge.json"
MERGED_TRACE = "merged.trace.json.gz"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_STEP_RUN = re.compile(r"^step_\d+(\.replaced-[\w-]+)?$")
"""A step's directory, or an earlier run of it moved aside."""
M = TypeVar("M", bound=BaseModel)


class StorageError(RuntimeError):
    """The save path cannot take traces (not writable, disk full). The message names the fix."""


class CorruptRecord(StorageError, ValueError):
    """A record under save_path (manifest, session, entry, merge) is not what this version wrote:
    truncated, edited by hand, or from an incompatible version. The message names the file
    relative to save_path and the fix."""


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file in the same directory + rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class TraceStore:
    """All paths under one `save_path`; nothing here writes outside it."""

    def __init__(self, save_path: str | os.PathLike, *, merge_on_complete: bool = False):
        """`merge_on_complete`: when a refresh finds a step `complete` or `partial`, merge its
        traces into `merged.trace.json.gz` in a background child process (never on the caller's
        thread, never in the caller's interpreter)."""
        self.root = Path(save_path).expanduser().resolve()
        self._auto_merge = None
        if merge_on_complete:
            from profiling.analysis.auto import AutoMerger  # lazy: only producers that merge

            self._auto_merge = AutoMerger(self.root)

    # -- layout -------------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        if not 1 <= step <= MAX_STEP:
            raise ValueError(f"step must be in [1, {MAX_STEP}], got {step}")
        return self.root / f"step_{step}"

    def rollout_dir(self, step: int, replica_id: str) -> Path:
        return self.step_dir(step) / "rollout" / check_safe_name(replica_id, "replica_id")

    def trainer_dir(self, step: int, rank: int) -> Path:
        return self.step_dir(step) / "trainer" / f"rank_{int(rank)}"

    def entry_dir(self, step: int, entry: ManifestEntry) -> Path:
        if entry.role == "rollout":
            return self.rollout_dir(step, entry.replica_id or "")
        return self.trainer_dir(step, entry.rank or 0)

    def relative(self, step: int, path: Path) -> str:
        return str(path.resolve().relative_to(self.step_dir(step)))

    # -- guards -------------------------------------------------------------------------
    def check_writable(self, min_free_mb: float) -> None:
        """Raise StorageError unless save_path can be created, written, and has room."""
        if self.root.exists() and not self.root.is_dir():
            raise StorageError(
                f"save_path {self.root} is not a directory; move that file away or point save_path elsewhere"
            )
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.root, prefix=".probe."):
                pass
        except OSError as e:
            raise StorageError(
                f"save_path {self.root} is not writable ({e.strerror}); "
                "point save_path at a writable directory"
            ) from e
        free_mb = shutil.disk_usage(self.root).free / 2**20
        if free_mb < min_free_mb:
            raise StorageError(
                f"save_path {self.root} has {free_mb:.0f} MiB free, below min_free_disk_mb="
                f"{min_free_mb:.0f}; free disk space or point save_path elsewhere"
            )

    # -- records ------------------------------------------------------------------------
    def write_entry(self, step: int, entry: ManifestEntry) -> None:
        atomic_write_text(self.entry_dir(step, entry) / ENTRY_FILE, entry.model_dump_json(indent=2))

    def write_session(self, step: int, session: SessionRecord) -> None:
        atomic_write_text(self.step_dir(step) / SESSION_FILE, session.model_dump_json(indent=2))

    def read_session(self, step: int) -> SessionRecord | None:
        return _read_model(self.step_dir(step) / SESSION_FILE, SessionRecord)

    def read_trainer_record(self, step: int) -> TrainerRecord | None:
        return _read_model(self.step_dir(step) / TRAINER_RECORD, TrainerRecord)

    def update_trainer_record(self, step: int, change: Callable[[TrainerRecord], TrainerRecord]) -> StepManifest:
        """Rewrite the step's trainer record as `change` makes it (from an empty one if none),
        under the manifest's lock (the driving rank and the launcher both write it), then
        refresh the manifest."""
        step_dir = self.step_dir(step)
        step_dir.mkdir(parents=True, exist_ok=True)
        with open(step_dir / ".manifest.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            record = change(self.read_trainer_record(step) or TrainerRecord())
            atomic_write_text(step_dir / TRAINER_RECORD, record.model_dump_json(indent=2))
        return self.refresh_manifest(step)

    def read_entries(self, step: int) -> list[ManifestEntry]:
        found = [p for kind in ("rollout", "trainer") for p in self._entry_files(step, kind)]
        return [e for e in (_read_model(p, ManifestEntry) for p in found) if e is not None]

    def _entry_files(self, step: int, kind: str = "*") -> list[Path]:
        """Each producer's entry under `<kind>/*/`, sorted; an `entry.json` of an older version
        where its directory has no `entry.record`."""
        step_dir = self.step_dir(step)
        found = {p.parent: p for p in step_dir.glob(f"{kind}/*/{LEGACY_ENTRY_FILE}")}
        found.update({p.parent: p for p in step_dir.glob(f"{kind}/*/{ENTRY_FILE}")})
        return [found[d] for d in sorted(found)]

    def refresh_manifest(self, step: int) -> StepManifest:
        """Re-derive and atomically rewrite `manifest.json` from the step's records.

        A file lock serialises refreshes from several processes: each reads all records after
        taking the lock, so the last refresh always sees every record written before it.
        """
        step_dir = self.step_dir(step)
        step_dir.mkdir(parents=True, exist_ok=True)
        with open(step_dir / ".manifest.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            manifest = StepManifest.assemble(
                step, self.read_session(step), self.read_entries(step), self.read_trainer_record(step)
            )
            manifest.merge = self.read_merge(step)
            atomic_write_text(step_dir / MANIFEST_FILE, manifest.model_dump_json(indent=2))
        if self._auto_merge is not None and manifest.status in ("complete", "partial"):
            self._auto_merge.request(step)
        return manifest

    def read_manifest(self, step: int) -> StepManifest | None:
        return _read_model(self.step_dir(step) / MANIFEST_FILE, StepManifest)

    def write_merge(self, step: int, record: MergeRecord) -> None:
        atomic_write_text(self.step_dir(step) / MERGE_FILE, record.model_dump_json(indent=2))

    def read_merge(self, step: int) -> MergeRecord | None:
        return _read_model(self.step_dir(step) / MERGE_FILE, MergeRecord)

    def records_digest(self, step: int) -> str:
        """A digest of the step's session record and entries: a merge made from the same digest
        is up to date."""
        step_dir = self.step_dir(step)
        h = hashlib.sha256()
        for path in [step_dir / SESSION_FILE, step_dir / TRAINER_RECORD, *self._entry_files(step)]:
            h.update(str(path.relative_to(step_dir)).encode())
            try:
                h.update(path.read_bytes())
            except FileNotFoundError:
                h.update(b"\0missing")
        return h.hexdigest()

    def set_aside(self, step: int) -> Path | None:
        """Move an earlier run's `step_<k>` to `step_<k>.replaced-<time>` so a new recording of
        step k never mixes with it (nothing is deleted); returns where it went, None if absent."""
        src = self.step_dir(step)
        if not src.exists():
            return None
        stamp = time.strftime("%Y%m%dT%H%M%S")
        dst = src.with_name(f"{src.name}.replaced-{stamp}-{time.time_ns() % 10**9:09d}")
        src.rename(dst)
        return dst

    def prune(self, keep: int) -> list[str]:
        """Remove the step directories (runs moved aside included) beyond the `keep` most
        recently written; returns the names removed, oldest first."""
        runs = [p for p in self.root.iterdir() if p.is_dir() and _STEP_RUN.match(p.name)] if self.root.exists() else []
        runs.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        removed = runs[max(0, keep) :][::-1]
        for p in removed:
            shutil.rmtree(p)
        return [p.name for p in removed]

    def steps(self) -> list[int]:
        """Steps that have a directory under save_path, ascending (OSError if save_path is a
        file or unreadable: that is not the same as no steps)."""
        if not self.root.exists():
            return []
        found = (_STEP_DIR.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)


def _read_model(path: Path, model: type[M]) -> M | None:
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):  # no such file (a parent may be a file)
        return None
    try:
        return model.model_validate_json(text)
    except ValueError as e:  # invalid JSON or fields: pydantic's ValidationError is a ValueError
        parts = path.parts
        first = next((i for i in range(len(parts) - 1, -1, -1) if _STEP_DIR.match(parts[i])), len(parts) - 1)
        where = "/".join(parts[first:])
        detail = e.errors()[0]["msg"] if isinstance(e, ValidationError) else str(e).splitlines()[0]
        raise CorruptRecord(
            f"{where} under save_path is not a valid {model.__name__} ({detail}): move it aside "
            "(or delete it) and refresh the step"
        ) from e
