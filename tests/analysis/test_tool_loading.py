"""Real steps, loaded by the trace tools users open them with: Holistic Trace Analysis and
TensorBoard's profiler plugin (its own loader classes, no server).

The step is recorded by ProfileSession with torch.profiler: two replicas while a one-process gloo
group is up, so Kineto writes each its own `distributedInfo` saying rank 0 (as vLLM's
single-GPU workers do), and a trainer rank without one. The view is loaded as the background
merge of a producer's store leaves it (no `ranks` command) and as the command rebuilds it.
docs/analysis.md#trace-tools.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hta.trace_analysis import TraceAnalysis
from support.traces import read_trace
from torch_tb_profiler import consts
from torch_tb_profiler import io as tb_io
from torch_tb_profiler.plugin import TorchProfilerPlugin
from torch_tb_profiler.profiler import RunLoader
from typer.testing import CliRunner

from profiling.analysis import tool_view
from profiling.analysis.auto import MERGE_COMMAND, AutoMerger
from profiling.analysis.background_merge import merge_if_settled
from profiling.analysis.events import open_binary
from profiling.analysis.tool_view import VIEW_DIR, VIEW_LOCK, VIEW_RECORD, ToolView, ViewError, build_tool_view
from profiling.cli import EXIT_FAILED, app
from profiling.config import ProfileOptions
from profiling.manifest import ManifestEntry, SessionRecord
from profiling.session import ProfileSession
from profiling.store import ENTRY_FILE, LEGACY_ENTRY_FILE, MERGED_TRACE, TraceStore

PROCESSES = ["trainer/rank_0", "rollout/r0", "rollout/r1"]
NAMES = [
    "rank0-trainer-rank_0.pt.trace.json.gz",
    "rank1-rollout-r0.pt.trace.json.gz",
    "rank2-rollout-r1.pt.trace.json.gz",
]
TRACES = [f"{p}/trace.pt.trace.json.gz" for p in PROCESSES]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, spec) -> TraceStore:
    """Step 1: trainer rank 0, replicas r0 and r1, each with six forward steps."""
    store = TraceStore(tmp_path_factory.mktemp("tools") / "profile")
    options = ProfileOptions(max_duration_s=None)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    store.write_session(1, SessionRecord(step=1, steps=[1], tool="torch", options=options, started_at=time.time()))
    identities = [
        ManifestEntry(role="trainer", rank=0),
        ManifestEntry(role="rollout", replica_id="r0", node_id="n0"),
        ManifestEntry(role="rollout", replica_id="r1", node_id="n0"),
    ]
    with ThreadPoolExecutor(1) as exporter:
        for identity in identities:
            engine_group = identity.role == "rollout"
            if engine_group:
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            try:
                s = ProfileSession(store=store, entry_identity=identity, exporter=exporter)
                s.start(spec(1, max_duration_s=None), weight_version=0)
                for _ in range(6):
                    with s.forward_step(0):
                        model(torch.randn(32, 64))
                s.stop(1)
                s.wait_exported(1, 60)
            finally:
                if engine_group:
                    dist.destroy_process_group()
    record = store.read_session(1)
    store.write_session(1, record.model_copy(update={"stopped_at": time.time()}))
    assert store.refresh_manifest(1).status == "complete"
    return store


@pytest.fixture(scope="module")
def view(recorded):
    return build_tool_view(recorded, 1)


def _forward_steps(analyzer: TraceAnalysis, rank: int) -> int:
    """The `forward_step#…` ranges HTA parsed from the rank's trace (names are symbol ids)."""
    table = analyzer.t.symbol_table.get_sym_table()
    names = analyzer.t.get_trace(rank)["name"].map(lambda i: table[i])
    return int(names.str.startswith("forward_step#").sum())


def test_engine_traces_as_written_all_say_rank_0(recorded):
    """The premise: without the view, the replicas' traces collide as ranks."""
    for replica in ("r0", "r1"):
        with open_binary(recorded.rollout_dir(1, replica) / "trace.pt.trace.json.gz") as f:
            head = f.read(1 << 16)
        assert b'"distributedInfo"' in head and b'"rank": 0' in head


def test_hta_loads_the_whole_step_as_ranks(recorded, view):
    assert [f.process for f in view.files] == PROCESSES and view.world_size == 3
    assert [f.how for f in view.files] == ["rewritten"] * 3  # none said its step rank
    analyzer = TraceAnalysis(trace_dir=view.directory)
    traces = analyzer.t.traces
    assert sorted(traces) == [0, 1, 2]
    for f in view.files:
        assert analyzer.t.trace_files[f.rank].endswith(f.name)
        assert _forward_steps(analyzer, f.rank) == 6, f


def test_rewritten_traces_say_rank_and_world_size_once(view):
    for f in view.files:
        data = read_trace(Path(view.directory) / f.name)
        assert data["distributedInfo"]["rank"] == f.rank and data["distributedInfo"]["world_size"] == 3
        # Kineto's own key was replaced, not followed by a second one that json.loads would take.
        assert data["traceEvents"] and data.get("baseTimeNanoseconds")


def test_hta_loads_a_process_directory_as_written(recorded):
    """A replica's directory holds its trace and its entry record: HTA takes only the trace."""
    entry_dir = recorded.rollout_dir(1, "r0")
    assert sorted(p.name for p in entry_dir.iterdir()) == [ENTRY_FILE, "trace.pt.trace.json.gz"]
    analyzer = TraceAnalysis(trace_dir=str(entry_dir))
    assert list(analyzer.t.traces) == [0] and _forward_steps(analyzer, 0) == 6


def test_hta_fails_on_a_json_sidecar_beside_the_trace(recorded, tmp_path):
    """The old layout: `entry.json` beside a trace. A trainer's entry says `"rank": 0`, so HTA
    takes it for rank 0's trace and cannot parse it."""
    legacy = tmp_path / "trainer_rank_0"
    legacy.mkdir()
    src = recorded.trainer_dir(1, 0)
    shutil.copy(src / "trace.pt.trace.json.gz", legacy)
    shutil.copy(src / ENTRY_FILE, legacy / LEGACY_ENTRY_FILE)
    with pytest.raises(Exception):  # noqa: B017 - whatever HTA raises, it cannot load the step
        analyzer = TraceAnalysis(trace_dir=str(legacy))
        assert _forward_steps(analyzer, 0) == 6


def test_hta_keeps_one_of_colliding_ranks_without_the_view(recorded, tmp_path):
    """The replicas' traces side by side, as written (both rank 0): HTA silently keeps one."""
    both = tmp_path / "both"
    both.mkdir()
    for replica in ("r0", "r1"):
        shutil.copy(recorded.rollout_dir(1, replica) / "trace.pt.trace.json.gz", both / f"{replica}.pt.trace.json.gz")
    assert list(TraceAnalysis(trace_dir=str(both)).t.traces) == [0]


def test_tensorboard_lists_the_step_and_loads_every_process_as_a_worker(recorded, view, tmp_path):
    step_dir = recorded.step_dir(1)
    finder = TorchProfilerPlugin.__new__(TorchProfilerPlugin)  # only its run discovery; no server
    finder.logdir = str(step_dir)
    runs = {Path(d).relative_to(step_dir).as_posix() for d in finder._get_run_dirs()}
    assert runs == {VIEW_DIR, "rollout/r0", "rollout/r1", "trainer/rank_0"}
    run = RunLoader("step_1", view.directory, tb_io.Cache(str(tmp_path))).load()
    workers = {f.name.removesuffix(".pt.trace.json.gz") for f in view.files}
    assert set(run.workers) == workers and len(workers) == 3
    for w in workers:
        profile = run.get_profile(w, "default")  # the plugin's span key of a file without one
        assert profile is not None and consts.OP_VIEW in profile.views and consts.TRACE_VIEW in profile.views, w


def test_a_trace_that_already_says_its_rank_is_linked(recorded, tmp_path):
    """A step of one replica whose engine trace says rank 0 of 1 (Kineto's own key) needs no copy."""
    store = TraceStore(tmp_path / "profile")
    entry_dir = store.rollout_dir(2, "r0")
    entry_dir.mkdir(parents=True)
    shutil.copy(recorded.rollout_dir(1, "r0") / "trace.pt.trace.json.gz", entry_dir)
    store.write_entry(2, ManifestEntry(role="rollout", replica_id="r0", files=["rollout/r0/trace.pt.trace.json.gz"]))
    v = build_tool_view(store, 2)
    assert [(f.how, f.name) for f in v.files] == [("link", "rank0-rollout-r0.pt.trace.json.gz")]
    assert (Path(v.directory) / v.files[0].name).is_symlink() and v.rewritten_bytes == 0
    analyzer = TraceAnalysis(trace_dir=v.directory)
    assert list(analyzer.t.traces) == [0] and _forward_steps(analyzer, 0) == 6


def test_an_array_form_trace_is_rewritten_as_an_object_that_says_its_rank(tmp_path):
    store = TraceStore(tmp_path / "profile")
    for rid in ("a", "b"):
        d = store.rollout_dir(3, rid)
        d.mkdir(parents=True)
        (d / "x.json").write_text(json.dumps([{"ph": "X", "name": "op", "ts": 1, "dur": 2, "pid": 1, "tid": 1}]))
        store.write_entry(3, ManifestEntry(role="rollout", replica_id=rid, files=[f"rollout/{rid}/x.json"]))
    v = build_tool_view(store, 3)
    for f in v.files:
        data = json.loads((Path(v.directory) / f.name).read_text())
        assert data["distributedInfo"] == {"rank": f.rank, "world_size": 2} and data["traceEvents"][0]["name"] == "op"


def test_rebuilding_replaces_the_view_whole(recorded, view):
    stale = Path(view.directory) / "rank9-gone.pt.trace.json.gz"
    stale.write_bytes(b"")
    again = build_tool_view(recorded, 1)
    names = [VIEW_RECORD, *(f.name for f in again.files)]
    assert sorted(p.name for p in Path(again.directory).iterdir()) == sorted(names)
    assert not any(p.name.startswith(f".{VIEW_DIR}.") for p in recorded.step_dir(1).iterdir())


def test_steps_written_with_entry_json_are_still_read(recorded, tmp_path):
    old = TraceStore(tmp_path / "old")
    shutil.copytree(recorded.step_dir(1), old.step_dir(1))
    for p in old.step_dir(1).glob(f"*/*/{ENTRY_FILE}"):
        p.rename(p.with_name(LEGACY_ENTRY_FILE))
    assert {e.replica_id or f"rank {e.rank}" for e in old.read_entries(1)} == {"r0", "r1", "rank 0"}


# -- the view as the background merge leaves it ------------------------------------------------------


def _copy_step(recorded: TraceStore, root: Path) -> TraceStore:
    """Step 1's records and traces under a fresh save_path, without any view or merge."""
    store = TraceStore(root)
    shutil.copytree(
        recorded.step_dir(1), store.step_dir(1), ignore=shutil.ignore_patterns(VIEW_DIR, "merge*", ".*")
    )
    return store


def _poll(what: str, done, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s:.0f} s"
        time.sleep(0.1)


def _traces(store: TraceStore) -> dict[str, bytes]:
    return {rel: (store.step_dir(1) / rel).read_bytes() for rel in TRACES}


def test_hta_loads_the_step_as_the_background_merge_left_it(recorded, tmp_path):
    """A producer's store with merge_on_complete (the app's controller, the trainer) settles the
    step; its background merge writes `ranks/` beside the merged timeline: HTA loads it as it is,
    one rank per process, named after the process, with no `ranks` command run."""
    store = _copy_step(recorded, tmp_path / "profile")
    written = _traces(store)
    producer = TraceStore(store.root, merge_on_complete=True)
    assert producer.refresh_manifest(1).status == "complete"
    record = store.step_dir(1) / VIEW_DIR / VIEW_RECORD
    _poll("the background view of step 1", lambda: record.is_file() and store.read_manifest(1).merge is not None)

    step_dir = store.step_dir(1)
    assert store.read_manifest(1).merge.status == "ok" and (step_dir / MERGED_TRACE).is_file()
    assert sorted(p.name for p in step_dir.iterdir() if not p.name.startswith(".")) == sorted(
        ["manifest.json", "session.json", "merge.json", MERGED_TRACE, "rollout", "trainer", VIEW_DIR]
    )  # docs/design.md#traces-on-disk
    view = ToolView.model_validate_json(record.read_text())
    assert view.digest == store.records_digest(1) and view.world_size == 3
    assert [(f.rank, f.process, f.name) for f in view.files] == list(zip(range(3), PROCESSES, NAMES, strict=True))
    assert sorted(p.name for p in (step_dir / VIEW_DIR).iterdir()) == sorted([VIEW_RECORD, *NAMES])

    analyzer = TraceAnalysis(trace_dir=str(step_dir / VIEW_DIR))
    assert sorted(analyzer.t.traces) == [0, 1, 2]
    for rank, name in enumerate(NAMES):
        assert Path(analyzer.t.trace_files[rank]).name == name
        assert _forward_steps(analyzer, rank) == 6, name
    assert _traces(store) == written  # the traces as exported: the view only reads them


def test_the_background_merge_keeps_a_current_view_and_rebuilds_a_stale_one(recorded, tmp_path):
    store = _copy_step(recorded, tmp_path / "profile")
    view_dir = store.step_dir(1) / VIEW_DIR
    assert merge_if_settled(store.root, 1) == []
    built = {p.name: p.lstat().st_mtime_ns for p in view_dir.iterdir()}
    assert set(built) == {VIEW_RECORD, *NAMES}

    assert merge_if_settled(store.root, 1) == []  # the same records: nothing rewritten
    assert {p.name: p.lstat().st_mtime_ns for p in view_dir.iterdir()} == built

    (view_dir / NAMES[2]).unlink()  # a view file gone (by hand): rebuilt whole
    assert merge_if_settled(store.root, 1) == []
    assert sorted(p.name for p in view_dir.iterdir()) == sorted(built)

    session = store.read_session(1)
    store.write_session(1, session.model_copy(update={"tag": "changed"}))  # a record changed: rebuilt
    assert merge_if_settled(store.root, 1) == []
    assert ToolView.model_validate_json((view_dir / VIEW_RECORD).read_text()).digest == store.records_digest(1)


def test_a_view_that_fails_in_the_background_is_logged_and_the_traces_kept(recorded, tmp_path, caplog):
    """The child exits 1 naming the view, the cause and the command that rebuilds it; the producer
    logs that; the merge and the traces are untouched."""
    store = _copy_step(recorded, tmp_path / "profile")
    written = _traces(store)
    (store.step_dir(1) / VIEW_LOCK).mkdir()  # the view cannot be written
    proc = subprocess.run(
        [sys.executable, *MERGE_COMMAND, str(store.root), "1"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stderr
    assert "step 1's ranks view not written (IsADirectoryError" in proc.stderr, proc.stderr
    assert f"python -m profiling ranks {store.root} --step 1" in proc.stderr
    assert store.read_manifest(1).merge.status == "ok" and (store.step_dir(1) / MERGED_TRACE).is_file()
    assert not (store.step_dir(1) / VIEW_DIR).exists()
    assert not [p.name for p in store.step_dir(1).iterdir() if p.name.startswith(f".{VIEW_DIR}.")]
    assert _traces(store) == written

    with caplog.at_level(logging.ERROR, logger="profiling.analysis.auto"):
        AutoMerger(store.root)._run(1)  # what the producer's merge thread runs, here on this one
    assert "background merge of step 1 failed (exit 1): step 1's ranks view not written" in caplog.text


def test_a_view_that_would_not_fit_writes_nothing_and_keeps_the_last(recorded, tmp_path, monkeypatch):
    store = _copy_step(recorded, tmp_path / "profile")
    first = build_tool_view(store, 1)
    before = sorted(p.name for p in Path(first.directory).iterdir())
    usage = shutil.disk_usage(store.root)
    need = sum(len(b) for b in _traces(store).values())  # every trace is rewritten
    # A fake of a full disk (a real one cannot be made here): room for half the copies.
    monkeypatch.setattr(tool_view.shutil, "disk_usage", lambda _: usage._replace(free=need // 2))
    with pytest.raises(ViewError) as failed:
        build_tool_view(store, 1)
    message = str(failed.value)
    mib = f"{need // 2 / 2**20:.1f} MiB free and the view needs about {need / 2**20:.1f} MiB"
    assert f"step_1 has {mib} for the traces it rewrites" in message
    assert "free disk space" in message
    assert f"python -m profiling ranks {store.root} --step 1" in message
    assert sorted(p.name for p in Path(first.directory).iterdir()) == before
    assert not [p.name for p in store.step_dir(1).iterdir() if p.name.startswith(f".{VIEW_DIR}.")]


def test_the_ranks_command_rebuilds_the_view_and_fails_naming_the_cause(recorded, tmp_path):
    store = _copy_step(recorded, tmp_path / "profile")
    assert merge_if_settled(store.root, 1) == []
    runner = CliRunner()
    res = runner.invoke(app, ["ranks", str(store.root), "--json"])
    assert res.exit_code == 0, res.output
    [view] = json.loads(res.stdout)
    assert [f["name"] for f in view["files"]] == NAMES and view["digest"] == store.records_digest(1)
    assert sorted(p.name for p in (store.step_dir(1) / VIEW_DIR).iterdir()) == sorted([VIEW_RECORD, *NAMES])

    shutil.rmtree(store.step_dir(1) / VIEW_DIR)
    (store.step_dir(1) / VIEW_LOCK).unlink()
    (store.step_dir(1) / VIEW_LOCK).mkdir()
    res = runner.invoke(app, ["ranks", str(store.root), "--step", "1"])
    assert res.exit_code == EXIT_FAILED
    assert "error: step 1's ranks view not written (IsADirectoryError" in res.stderr, res.stderr
