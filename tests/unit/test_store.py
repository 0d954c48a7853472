"""TraceStore: the on-disk layout of docs/design.md#traces-on-disk, atomic writes, guards, the manifest."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from profiling.config import ProfileOptions
from profiling.manifest import ManifestEntry, SessionRecord, StepManifest, SyncCost
from profiling.store import StorageError, TraceStore, atomic_write_text


def rollout(rid: str, **kw) -> ManifestEntry:
    return ManifestEntry(role="rollout", replica_id=rid, **kw)


def trainer(rank: int, **kw) -> ManifestEntry:
    return ManifestEntry(role="trainer", rank=rank, **kw)


def session(step: int = 3, *, stopped: bool = True, failures: dict[str, str] | None = None) -> SessionRecord:
    now = time.time()
    return SessionRecord(
        step=step,
        steps=[step],
        tool="torch",
        options=ProfileOptions(),
        started_at=now - 1,
        stopped_at=now if stopped else None,
        replicas=["r0", "r1"],
        failures=failures or {},
    )


def temp_files(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.name.endswith(".tmp")]


# -- layout ----------------------------------------------------------------------------------


def test_layout_paths(store: TraceStore, tmp_path: Path):
    root = (tmp_path / "profile").resolve()
    assert store.root == root
    assert store.step_dir(5) == root / "step_5"
    assert store.rollout_dir(5, "replica-0") == root / "step_5" / "rollout" / "replica-0"
    assert store.trainer_dir(5, 2) == root / "step_5" / "trainer" / "rank_2"
    assert store.entry_dir(5, rollout("r1")) == root / "step_5" / "rollout" / "r1"
    assert store.entry_dir(5, trainer(3)) == root / "step_5" / "trainer" / "rank_3"


def test_relative_is_relative_to_step_dir(store: TraceStore):
    p = store.rollout_dir(2, "r0") / "trace.json.gz"
    assert store.relative(2, p) == "rollout/r0/trace.json.gz"


def test_step_below_one_rejected(store: TraceStore):
    with pytest.raises(ValueError):
        store.step_dir(0)


@pytest.mark.parametrize(
    "rid", ["a/b", "../x", "..", ".", "", "x" * 65, "/etc", "a\\b", "r 0", "..%2f"]
)
def test_unsafe_replica_ids_rejected(store: TraceStore, rid: str):
    with pytest.raises(ValueError, match="replica_id"):
        store.rollout_dir(1, rid)
    with pytest.raises(ValueError):
        store.write_entry(1, rollout(rid))
    # nothing was created outside (or inside) the save path
    assert not store.root.exists()


def test_64_char_replica_id_accepted(store: TraceStore):
    rid = "r" * 64
    assert store.rollout_dir(1, rid).name == rid


def test_replica_id_with_trailing_newline_rejected(store: TraceStore):
    with pytest.raises(ValueError):
        store.rollout_dir(1, "r0\n")


# -- atomic writes ---------------------------------------------------------------------------


def test_atomic_write_creates_parents_and_leaves_no_temp(tmp_path: Path):
    path = tmp_path / "a" / "b" / "manifest.json"
    atomic_write_text(path, "hello")
    assert path.read_text() == "hello"
    atomic_write_text(path, "world")
    assert path.read_text() == "world"
    assert sorted(p.name for p in path.parent.iterdir()) == ["manifest.json"]


def test_atomic_write_failure_keeps_old_content(tmp_path: Path, monkeypatch):
    path = tmp_path / "manifest.json"
    atomic_write_text(path, "old")

    def boom(src, dst):
        # the new content was fully written to the temp file before the rename
        assert Path(src).read_text() == "new" * 1000
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        atomic_write_text(path, "new" * 1000)
    monkeypatch.undo()
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


def test_atomic_write_failure_while_writing_leaves_nothing(tmp_path: Path, monkeypatch):
    path = tmp_path / "entry.json"

    def boom(fd):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError):
        atomic_write_text(path, "x" * 10_000)
    monkeypatch.undo()
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_interrupt_cleans_up(tmp_path: Path, monkeypatch):
    path = tmp_path / "m.json"
    atomic_write_text(path, "old")

    def interrupt(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupt)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_text(path, "new")
    monkeypatch.undo()
    assert path.read_text() == "old"
    assert temp_files(tmp_path) == []


# -- records round trip ----------------------------------------------------------------------


def test_entries_and_session_round_trip(store: TraceStore):
    e0 = rollout("r0", files=["rollout/r0/t.json.gz"], forward_steps=4, weight_version=2)
    e1 = trainer(0, sync=SyncCost(stop_s=0.1, update_s=0.5, start_s=0.2))
    store.write_entry(3, e0)
    store.write_entry(3, e1)
    rec = session(3)
    store.write_session(3, rec)
    assert (store.rollout_dir(3, "r0") / "entry.record").is_file()
    assert (store.trainer_dir(3, 0) / "entry.record").is_file()
    assert store.read_entries(3) == [e0, e1]
    assert store.read_session(3) == rec
    assert store.read_session(4) is None
    assert store.read_manifest(3) is None
    assert temp_files(store.root) == []


def test_refresh_manifest_writes_file(store: TraceStore):
    store.write_session(3, session(3))
    store.write_entry(3, trainer(0, sync=SyncCost(stop_s=0.1, update_s=0.5)))
    store.write_entry(3, rollout("r0", files=["rollout/r0/t.gz"]))
    m = store.refresh_manifest(3)
    on_disk = json.loads((store.step_dir(3) / "manifest.json").read_text())
    assert on_disk["step"] == 3 and on_disk["status"] == "complete" and on_disk["tool"] == "torch"
    assert [e["role"] for e in on_disk["entries"]] == ["rollout", "trainer"]
    assert store.read_manifest(3) == m
    assert m.sync is not None and m.sync.total_s == pytest.approx(0.6)
    assert temp_files(store.root) == []


# -- manifest status rules -------------------------------------------------------------------


def test_status_recording_while_session_not_stopped(store: TraceStore):
    store.write_session(3, session(3, stopped=False))
    store.write_entry(3, rollout("r0", exporting=True))
    store.write_entry(3, rollout("r1", status="error", error="boom"))
    assert store.refresh_manifest(3).status == "recording"


def test_status_exporting_when_any_entry_exporting(store: TraceStore):
    store.write_session(3, session(3))
    store.write_entry(3, rollout("r0"))
    store.write_entry(3, rollout("r1", exporting=True))
    assert store.refresh_manifest(3).status == "exporting"


def test_status_partial_when_an_entry_errored(store: TraceStore):
    store.write_session(3, session(3))
    store.write_entry(3, rollout("r0"))
    store.write_entry(3, rollout("r1", status="error", error="export failed"))
    m = store.refresh_manifest(3)
    assert m.status == "partial"
    assert {e.replica_id: e.status for e in m.entries} == {"r0": "ok", "r1": "error"}


def test_failure_for_replica_without_entry_adds_error_entry(store: TraceStore):
    store.write_session(3, session(3, failures={"r1": "timed out after 5 s"}))
    store.write_entry(3, rollout("r0"))
    m = store.refresh_manifest(3)
    assert m.status == "partial"
    by_id = {e.replica_id: e for e in m.entries}
    assert set(by_id) == {"r0", "r1"}
    assert by_id["r1"].role == "rollout"
    assert by_id["r1"].status == "error"
    assert by_id["r1"].error == "timed out after 5 s"
    assert by_id["r1"].exporting is False
    assert by_id["r0"].status == "ok"


def test_failure_for_replica_stuck_exporting_marks_it_error(store: TraceStore):
    # a replica died mid-recording: its entry says exporting forever; the controller's failure wins
    store.write_session(3, session(3, failures={"r1": "replica died"}))
    store.write_entry(3, rollout("r0"))
    store.write_entry(3, rollout("r1", exporting=True, files=["rollout/r1/t.gz"]))
    m = store.refresh_manifest(3)
    assert m.status == "partial"
    r1 = next(e for e in m.entries if e.replica_id == "r1")
    assert (r1.status, r1.exporting, r1.error) == ("error", False, "replica died")
    assert r1.files == ["rollout/r1/t.gz"]  # what it had is kept


def test_status_complete_when_all_ok(store: TraceStore):
    store.write_session(3, session(3))
    store.write_entry(3, rollout("r0"))
    store.write_entry(3, rollout("r1"))
    store.write_entry(3, trainer(0))
    m = store.refresh_manifest(3)
    assert m.status == "complete"
    assert [e.key for e in m.entries] == ["rollout/r0", "rollout/r1", "trainer/rank_0"]


def test_status_partial_when_stopped_with_no_entries(store: TraceStore):
    store.write_session(3, session(3))
    assert store.refresh_manifest(3).status == "partial"


def test_manifest_without_session_record(store: TraceStore):
    store.write_entry(2, rollout("r0", weight_version=1))
    m = store.refresh_manifest(2)
    assert (m.step, m.steps, m.status) == (2, [2], "complete")


def test_assemble_failure_for_finished_ok_entry_keeps_it():
    # documents current behaviour: a stale failure does not override a finished, ok trace
    rec = session(3, failures={"r0": "stop timed out"})
    m = StepManifest.assemble(3, rec, [rollout("r0", files=["rollout/r0/t.gz"])])
    assert [(e.replica_id, e.status) for e in m.entries] == [("r0", "ok")]


# -- steps listing ---------------------------------------------------------------------------


def test_steps_lists_step_dirs_ascending(store: TraceStore):
    assert store.steps() == []
    for k in (10, 2, 1, 33):
        store.step_dir(k).mkdir(parents=True)
    (store.root / "step_x").mkdir()
    (store.root / "notes").mkdir()
    (store.root / "step_7").write_text("a file, not a step dir")
    assert store.steps() == [1, 2, 10, 33]


# -- guards ----------------------------------------------------------------------------------


def test_check_writable_ok_creates_root(store: TraceStore):
    store.check_writable(min_free_mb=0)
    assert store.root.is_dir()
    assert list(store.root.iterdir()) == []  # the probe file is gone


def test_check_writable_not_writable_names_path(tmp_path: Path):
    (tmp_path / "afile").write_text("I am a file")
    s = TraceStore(tmp_path / "afile" / "x")
    with pytest.raises(StorageError) as ei:
        s.check_writable(min_free_mb=0)
    assert str(s.root) in str(ei.value)
    assert "not writable" in str(ei.value)


def test_check_writable_low_free_space_names_path(store: TraceStore):
    with pytest.raises(StorageError) as ei:
        store.check_writable(min_free_mb=1e15)
    msg = str(ei.value)
    assert str(store.root) in msg and "free" in msg


# -- concurrency -----------------------------------------------------------------------------


def test_concurrent_entry_writes_and_refreshes_keep_all_entries(store: TraceStore):
    n = 12
    store.write_session(4, session(4))
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def producer(i: int) -> None:
        try:
            barrier.wait()
            entry = rollout(f"r{i}") if i % 3 else trainer(i)
            store.write_entry(4, entry)
            for _ in range(3):
                store.refresh_manifest(4)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=producer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    m = store.read_manifest(4)
    assert m is not None
    assert len(m.entries) == n
    assert m.status == "complete"
    assert temp_files(store.root) == []


def test_set_aside_moves_an_earlier_run_of_a_step_out_of_the_listing(store: TraceStore):
    assert store.set_aside(3) is None
    old = store.rollout_dir(3, "r-old")
    old.mkdir(parents=True)
    (old / "trace.pt.trace.json.gz").write_bytes(b"earlier run")
    moved = store.set_aside(3)
    assert moved is not None and moved.name.startswith("step_3.replaced-")
    assert (moved / "rollout" / "r-old" / "trace.pt.trace.json.gz").read_bytes() == b"earlier run"
    assert not store.step_dir(3).exists() and store.steps() == []


def test_prune_keeps_the_most_recently_written_step_directories(store):
    """keep_steps: runs moved aside count as directories; other files under save_path are not touched."""
    names = ["step_1", "step_2.replaced-20260101T000000-000000001", "step_2", "step_3"]
    for i, name in enumerate(names):
        (store.root / name).mkdir(parents=True)
        os.utime(store.root / name, (1000 + i, 1000 + i))
    (store.root / "index.html").write_text("report")
    (store.root / ".engine").mkdir()
    assert store.prune(2) == ["step_1", "step_2.replaced-20260101T000000-000000001"]
    assert sorted(p.name for p in store.root.iterdir()) == [".engine", "index.html", "step_2", "step_3"]
    assert store.prune(5) == []
    assert TraceStore(store.root / "absent").prune(1) == []


# -- retention never removes what is still being written -------------------------------------


def settled_steps(store: TraceStore, *steps: int) -> None:
    """Complete steps, written in the order given (each older than the next)."""
    for i, k in enumerate(steps):
        store.write_session(k, session(k))
        store.write_entry(k, rollout("r0"))
        store.refresh_manifest(k)
        os.utime(store.step_dir(k), (1000 + i, 1000 + i))


def make_oldest(store: TraceStore, step: int) -> None:
    os.utime(store.step_dir(step), (1, 1))


@pytest.mark.parametrize(
    ("records", "why"),
    [
        ({"stopped": False, "entries": [rollout("r0", exporting=True)]}, "recorded"),
        ({"stopped": True, "entries": [rollout("r0"), rollout("r1", exporting=True)]}, "exported"),
        ({"stopped": True, "entries": [], "trainer_ranks": [0]}, "exported"),
    ],
    ids=["recording", "an-entry-exporting", "a-trainer-rank-not-written-yet"],
)
def test_prune_keeps_a_step_whose_records_say_it_is_still_being_written(store, caplog, records, why):
    """Derived from the records (no manifest.json refreshed yet): kept, logged, not counted."""
    settled_steps(store, 1, 2)
    store.write_session(5, session(5, stopped=records["stopped"]))
    for e in records["entries"]:
        store.write_entry(5, e)
    if ranks := records.get("trainer_ranks"):
        store.update_trainer_record(5, lambda r: r.model_copy(update={"ranks": ranks}))
    (store.step_dir(5) / "manifest.json").unlink(missing_ok=True)
    make_oldest(store, 5)
    with caplog.at_level(logging.WARNING, logger="profiling.store"):
        assert store.prune(1) == ["step_1"]
    assert store.steps() == [2, 5]
    assert f"retention kept step_5 beyond the 1 most recently written: its traces are still being {why}" in (
        caplog.text
    )


def test_prune_keeps_a_step_whose_copied_manifest_says_exporting(store):
    """A step without its records (copied from elsewhere): its manifest.json decides."""
    settled_steps(store, 1)
    atomic_write_text(
        store.step_dir(4) / "manifest.json",
        StepManifest(step=4, steps=[4], tool="torch", status="exporting").model_dump_json(),
    )
    make_oldest(store, 4)
    assert store.prune(0) == ["step_1"]
    assert store.steps() == [4]


def test_prune_keeps_a_step_whose_records_cannot_be_read(store, caplog):
    settled_steps(store, 1, 2)
    (store.step_dir(1) / "session.json").write_text('{"step": 1, ')
    with caplog.at_level(logging.WARNING, logger="profiling.store"):
        assert store.prune(1) == []
    assert store.steps() == [1, 2]
    assert "step_1/session.json under save_path is not a valid SessionRecord" in caplog.text


def test_prune_removes_settled_steps_and_runs_moved_aside_whatever_their_records_say(store):
    """Complete and partial steps go; so does a run moved aside while it said exporting (its
    producers write into step_<k>/, never into it), though a new run of its step records."""
    settled_steps(store, 1, 2)
    store.write_session(3, session(3))
    store.write_entry(3, rollout("r0", status="error", error="export failed"))
    store.write_session(4, session(4))
    store.write_entry(4, rollout("r0", exporting=True))
    aside = store.set_aside(4)
    assert aside is not None
    store.write_session(4, session(4, stopped=False))
    for i, run in enumerate([store.step_dir(1), store.step_dir(2), store.step_dir(3), aside, store.step_dir(4)]):
        os.utime(run, (1000 + i, 1000 + i))
    assert store.prune(0) == ["step_1", "step_2", "step_3", aside.name]
    assert sorted(p.name for p in store.root.iterdir()) == ["step_4"]


def test_prune_keeps_a_step_held_by_a_writer_until_it_lets_go(store, caplog):
    settled_steps(store, 1, 2)
    with store.writing(1), caplog.at_level(logging.WARNING, logger="profiling.store"):
        assert store.prune(0) == ["step_2"]
    assert "retention kept step_1 beyond the 0 most recently written: a merge or the ranks view" in caplog.text
    assert store.prune(0) == ["step_1"]  # the retention catches up once it is settled


def test_prune_from_another_process_keeps_a_step_held_here(store):
    settled_steps(store, 1, 2)
    prune = f"from profiling.store import TraceStore; print(TraceStore({str(store.root)!r}).prune(0))"
    with store.writing(1):
        done = subprocess.run([sys.executable, "-c", prune], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "['step_2']", done.stderr
    assert store.steps() == [1]


def test_a_writer_waiting_for_a_prune_finds_the_step_gone(store):
    """A writer blocked on the hold while a prune removes the step must not write into it (nor
    recreate it): it is told the step is gone."""
    settled_steps(store, 1)
    outcome: list[BaseException | None] = []

    def write() -> None:
        try:
            with store.writing(1):
                outcome.append(None)
        except FileNotFoundError as e:
            outcome.append(e)

    with open(store.step_dir(1) / ".write.lock", "a") as pruning:
        fcntl.flock(pruning, fcntl.LOCK_EX)  # as a prune holds it while it removes the step
        writer = threading.Thread(target=write)
        writer.start()
        time.sleep(0.2)
        store.step_dir(1).rename(store.root / ".step_1.removing-1")
    writer.join(timeout=10)
    assert len(outcome) == 1 and isinstance(outcome[0], FileNotFoundError), outcome
    assert "step_1 was removed or moved aside" in str(outcome[0])
    assert not store.step_dir(1).exists()


def test_writing_a_step_without_a_directory_creates_nothing(store):
    store.root.mkdir(parents=True)
    with pytest.raises(FileNotFoundError), store.writing(7):
        pass
    assert list(store.root.iterdir()) == []


def test_prune_finishes_a_removal_that_failed_before(store, monkeypatch):
    settled_steps(store, 1, 2)
    real_rmtree = shutil.rmtree

    def full_disk(path, *args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(shutil, "rmtree", full_disk)
    with pytest.raises(OSError):
        store.prune(1)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    [left] = [p.name for p in store.root.iterdir() if p.name.startswith(".")]
    assert left.startswith(".step_1.removing-") and store.steps() == [2]  # out of the listing already
    assert store.prune(1) == []
    assert sorted(p.name for p in store.root.iterdir()) == ["step_2"]


def test_prune_during_a_merge_keeps_the_step(store, monkeypatch):
    """merge_step holds the step from its start until the manifest shows the merge."""
    from profiling.analysis import merge
    from profiling.manifest import MergeRecord

    settled_steps(store, 1, 2)
    pruned: list[list[str]] = []

    def merging(step_dir, manifest, **_):
        pruned.append(store.prune(0))
        return MergeRecord(status="ok", digest="", finished_at=time.time(), duration_s=0.0)

    monkeypatch.setattr(merge, "merge_manifest", merging)
    monkeypatch.setattr(merge, "_record_in_manifest", lambda *a: pruned.append(store.prune(0)))
    merge.merge_step(store, 1)
    assert pruned == [["step_2"], []]
    assert store.steps() == [1] and store.read_merge(1) is not None


def test_prune_while_the_ranks_view_is_written_keeps_the_step(store, monkeypatch):
    from profiling.analysis import tool_view

    settled_steps(store, 1, 2)
    pruned: list[list[str]] = []
    write_view = tool_view._write_view

    def writing_view(step_dir, inputs):
        pruned.append(store.prune(0))
        return write_view(step_dir, inputs)

    monkeypatch.setattr(tool_view, "_write_view", writing_view)
    view = tool_view.build_tool_view(store, 1)
    assert pruned == [["step_2"]]
    assert store.steps() == [1] and Path(view.directory).is_dir()
