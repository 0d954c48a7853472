"""The trace store: the on-disk layout of docs/design.md#traces-on-disk, atomic writes, and guards.

    <save_path>/step_<k>/manifest.json
    <save_path>/step_<k>/session.json                 controller's record
    <save_path>/step_<k>/rollout/<replica_id>/...     engine traces + entry.record
    <save_path>/step_<k>/trainer/rank_<r>/...         trainer traces + entry.record
    <save_path>/step_<k>/trainer/ranks.record         the trainer ranks selected, and those that died
    <save_path>/step_<k>/ranks/                       every trace as a rank (analysis.tool_view, with the merge)
    <save_path>/step_<k>/merged.trace.json.gz         one timeline (profiling.analysis.merge)
    <save_path>/step_<k>/merge.json                   the last merge's record
    <save_path>/step_<k>/.write.lock                  held while a merge or the ranks view writes (`writing`)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TypeVar

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
_REMOVING = re.compile(r"^\.step_\d+(\.replaced-[\w-]+)?\.removing-\d+$")
"""A step directory a prune renamed before removing it (left over if the removal failed)."""
WRITE_LOCK = ".write.lock"
"""Held shared by each writer whose work the step's records do not show (a merge, the ranks
view: `TraceStore.writing`), exclusively by a prune: a step held is never removed."""
M = TypeVar("M", bound=BaseModel)
log = logging.getLogger(__name__)


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
        traces into `merged.trace.json.gz` and write its `ranks/` view in a background child
        process (never on the caller's thread, never in the caller's interpreter)."""
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
            manifest = self._assemble(step)
            manifest.merge = self.read_merge(step)
            atomic_write_text(step_dir / MANIFEST_FILE, manifest.model_dump_json(indent=2))
        if self._auto_merge is not None and manifest.status in ("complete", "partial"):
            self._auto_merge.request(step)
        return manifest

    def _assemble(self, step: int) -> StepManifest:
        return StepManifest.assemble(
            step, self.read_session(step), self.read_entries(step), self.read_trainer_record(step)
        )

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

    @contextlib.contextmanager
    def writing(self, step: int) -> Iterator[None]:
        """Hold `step_<k>/` while writing into it something its records do not show (a merge, the
        ranks view): a prune, from any process, keeps the step meanwhile. FileNotFoundError if
        the step has no directory, or a prune removed it (or a start moved it aside) while this
        waited for the hold."""
        step_dir = self.step_dir(step)
        with open(step_dir / WRITE_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
            if not _is_at(lock, step_dir / WRITE_LOCK):
                raise FileNotFoundError(errno.ENOENT, f"{step_dir.name} was removed or moved aside", str(step_dir))
            yield

    def prune(self, keep: int) -> list[str]:
        """Remove the step directories (runs moved aside included) beyond the `keep` most
        recently written, except those still being written (`_being_written`): each of those is
        kept and logged, and a later prune removes it once settled. Returns the names removed,
        oldest first."""
        if not self.root.exists():
            return []
        for left in (p for p in self.root.iterdir() if _REMOVING.match(p.name)):
            shutil.rmtree(left, ignore_errors=True)  # a removal that failed before: nothing writes there
        runs = [p for p in self.root.iterdir() if p.is_dir() and _STEP_RUN.match(p.name)]
        runs.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        removed = []
        for p in runs[max(0, keep) :][::-1]:
            if (why := self._remove_unless_written(p)) is None:
                removed.append(p.name)
            else:
                log.warning("retention kept %s beyond the %s most recently written: %s", p.name, keep, why)
        return removed

    def _remove_unless_written(self, run: Path) -> str | None:
        """Remove `run` unless it is still being written; returns why it was kept, or None."""
        with open(run / WRITE_LOCK, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return "a merge or the ranks view is being written into it"
            if (why := self._being_written(run)) is not None:
                return why
            # Renamed away under the hold: a writer waiting for it finds no step to write into.
            doomed = run.with_name(f".{run.name}.removing-{time.time_ns()}")
            run.rename(doomed)
        shutil.rmtree(doomed)
        return None

    def _being_written(self, run: Path) -> str | None:
        """Why the records of step directory `run` say it is still being written, or None.

        It is while its records, derived as a refresh derives them (so a manifest.json not yet
        refreshed does not matter), say recording (its session not stopped) or exporting (an
        entry still exporting, or a selected trainer rank without one). A run moved aside never
        is: its producers write by step number, into `step_<k>/`."""
        found = _STEP_DIR.match(run.name)
        if found is None:
            return None
        step = int(found.group(1))
        try:
            if (
                self.read_session(step) is None
                and not self._entry_files(step)
                and self.read_trainer_record(step) is None
            ):
                manifest = self.read_manifest(step)  # a step copied without its records
                status = manifest.status if manifest is not None else None
            else:
                status = self._assemble(step).status
        except CorruptRecord as e:
            return f"its records cannot be read, so it may still be written ({e})"
        if status == "recording":
            return "its traces are still being recorded (manifest status recording)"
        if status == "exporting":
            return "its traces are still being exported (manifest status exporting)"
        return None

    def steps(self) -> list[int]:
        """Steps that have a directory under save_path, ascending (OSError if save_path is a
        file or unreadable: that is not the same as no steps)."""
        if not self.root.exists():
            return []
        found = (_STEP_DIR.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)


def _is_at(f: IO[str], path: Path) -> bool:
    """Whether the open file `f` is still the file at `path`."""
    try:
        there = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(f.fileno())
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


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
