"""`python -m profiling verl`: verl's own profiler output made into steps (docs/analysis.md#verl).

On synthetic save_paths named and shaped as verl 0.9.1's profilers write them (`verl_synth`): the
names parsed (every optional part), verl's steps mapped to versions, each rollout recording
matched to the step whose trainer window holds its stop (with its margin), or left unassigned
saying why; the steps built (manifests valid, traces linked, never moved), merged and reported;
verify's notes on them, and a verifier for each way an assignment can be wrong: a recording moved
to another step, a trace swapped in from another step, an entry that lost its match. The plugin's
shape (the app's steps completed with the trainer's traces and their measured clocks) too.
tests/integration/test_verl_traces.py does it on a real verl and vLLM run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from profiling.analysis.trace_span import read_span
from profiling.analysis.verify import verify_steps
from profiling.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, app
from profiling.manifest import ClockOffset, ManifestEntry, StepManifest, TraceDialect
from profiling.store import TraceStore
from profiling.verl_traces.clocks import TrainerClock, append_trainer_clock
from profiling.verl_traces.ingest import INGEST_RECORD, NoVerlTraces, ingest
from profiling.verl_traces.layout import engine_of, parse_trainer_name, scan_layout, step_of
from profiling.verl_traces.windows import (
    SpannedRollout,
    SpannedTrainer,
    match,
    recordings,
    trainer_windows,
)

from .synth import T0_NS, write_step
from .test_verify import procs, settle
from .verl_synth import (
    HOST,
    MARGIN_S,
    MS,
    SECOND,
    STEPS,
    SYNC_EVERY,
    rollout_window,
    trainer_name,
    write_recording,
    write_run,
    write_trainer,
)

runner = CliRunner()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """One synthetic verl save_path, ingested in place (T = 2), shared read-only: tests that
    change it work on a copy."""
    save = tmp_path_factory.mktemp("verl") / "profile"
    save.mkdir()
    write_run(save)
    res = runner.invoke(app, ["verl", str(save), "--trigger-parameter-sync-step", str(SYNC_EVERY)])
    assert res.exit_code == EXIT_OK, res.output
    return save


@pytest.fixture
def copy(built: Path, tmp_path: Path) -> TraceStore:
    return TraceStore(shutil.copytree(built, tmp_path / "profile", symlinks=True))


def findings(store: TraceStore, steps: list[int]) -> tuple[list, list]:
    report = verify_steps(store, steps)
    return report.violations, report.notes


# -- names ----------------------------------------------------------------------------------------


def test_a_trainer_name_with_every_part():
    t = parse_trainer_name("actor-rollout_train_step12_rank3-of-8_tp1-pp0-dp2-cp0_pid4242_20260101120000123.json.gz")
    assert t is not None
    assert (t.labels, t.step, t.rank, t.world_size, t.pid, t.written) == (
        ("actor-rollout", "train"),
        12,
        3,
        8,
        4242,
        "20260101120000123",
    )
    assert t.parallel == {"tp": 1, "pp": 0, "dp": 2, "cp": 0}
    assert (t.part, t.mini_batches) == (None, None)


@pytest.mark.parametrize(
    ("name", "labels", "step", "part", "mini_batches"),
    [
        ("step2_rank0_pid9_20260101120000123.json.gz", (), 2, None, None),
        ("ref_rank1_pid9_20260101120000123.json.gz", ("ref",), None, None, None),
        (
            "actor_actor-update_step4_rank0_pid9_20260101120000123_mb2-5.json.gz",
            ("actor", "actor-update"),
            4,
            None,
            (2, 5),
        ),
        (
            "actor_actor-update_step4_rank0_pid9_20260101120000123_mb3.json.gz",
            ("actor", "actor-update"),
            4,
            None,
            (3, 3),
        ),
        ("actor_train_step4_rank0_pid9_20260101120000123_part1.json.gz", ("actor", "train"), 4, 1, None),
    ],
)
def test_the_optional_parts_of_a_trainer_name(name, labels, step, part, mini_batches):
    t = parse_trainer_name(name)
    assert t is not None
    assert (t.labels, t.step, t.part, t.mini_batches, t.world_size, t.parallel) == (
        labels,
        step,
        part,
        mini_batches,
        None,
        {},
    )


@pytest.mark.parametrize(
    "name",
    [
        "rank0.1796670714765301899.pt.trace.json.gz",  # vLLM's
        "actor_train_step1_rank0_pid9_2026010112.json.gz",  # a short timestamp
        "actor_train_step1_rank0_pid9_20260101120000123.json",  # verl gzips every trace
        "merged.trace.json.gz",
    ],
)
def test_names_verl_s_trainer_does_not_write(name):
    assert parse_trainer_name(name) is None


@pytest.mark.parametrize(
    ("name", "engine"),
    [
        ("rank0.1796670714765301899.pt.trace.json.gz", "vllm"),  # tensorboard_trace_handler's, vLLM's worker
        ("dp0_pp0_tp1_dcp0_ep0_rank1.1796670714765.pt.trace.json", "vllm"),
        ("1796670714.2057-TP-0.trace.json.gz", "sglang"),  # <profile_id>-TP-<tp>
        ("cuda_graph_capture-decode-TP-0.json.gz", None),  # SGLang's capture, no window
        ("rank0.profiler_out.txt", None),
    ],
)
def test_which_engine_wrote_a_rollout_trace(name, engine):
    assert engine_of(name) == engine


def test_verl_steps_map_to_the_version_they_produce():
    assert [step_of(s, 1) for s in (1, 2, 5)] == [1, 2, 5]
    assert [step_of(s, 4) for s in (1, 4, 5, 8, 17, 20)] == [1, 1, 2, 2, 5, 5]
    with pytest.raises(ValueError, match="at least 1"):
        step_of(0, 4)


def test_the_layout_sorts_what_it_finds(tmp_path):
    save = tmp_path / "profile"
    write_trainer(save, 3)
    write_recording(save, rollout_window(2), replica=1)
    (save / "agent_loop_rollout_replica_1" / "rank0.profiler_out.txt").write_text("table")
    (save / "rollout-replica4-globalrank8_rank0.1796000000000000001.pt.trace.json.gz").write_bytes(b"")
    (save / "actor_vm_worker_process_77.nsys-rep").write_bytes(b"")
    npu = save / "7" / "train" / "vm_77_20260101_ascend_pt"
    npu.mkdir(parents=True)
    (save / "notes.txt").write_text("mine")
    (save / "step_3").mkdir()  # this project's output: not read
    layout = scan_layout(save)
    assert [t.step for t in layout.trainer] == [3]
    assert sorted((r.replica, r.global_rank, r.engine) for r in layout.rollout) == [(1, None, "vllm"), (4, 8, "vllm")]
    kinds = {a.rel: (a.kind, a.verl_step) for a in layout.other}
    assert kinds == {
        "agent_loop_rollout_replica_1/rank0.profiler_out.txt": ("vllm_op_table", None),
        "actor_vm_worker_process_77.nsys-rep": ("nsys", None),
        "7/train/vm_77_20260101_ascend_pt/": ("npu", 7),
        "notes.txt": ("unknown", None),
    }


# -- the matching ---------------------------------------------------------------------------------


def spanned(save: Path) -> tuple[list[SpannedTrainer], list[SpannedRollout]]:
    layout = scan_layout(save)
    trainer = [SpannedTrainer(trace=t, span=read_span(save / t.name)) for t in layout.trainer]
    rollout = [SpannedRollout(trace=r, span=read_span(save / r.rel, "execute_")) for r in layout.rollout]
    return trainer, rollout


def test_each_recording_goes_to_the_step_whose_trainer_window_holds_its_stop(tmp_path):
    write_run(tmp_path)
    trainer, rollout = spanned(tmp_path)
    windows = trainer_windows(trainer, SYNC_EVERY)
    assert {k: w.trainer_steps for k, w in windows.items()} == {1: [1, 2], 2: [3, 4], 5: [9, 10]}
    assert (windows[5].started_ns, windows[5].stopped_ns) == (T0_NS + 8 * SECOND, T0_NS + 9 * SECOND + 900 * MS)
    assigned, unassigned = match(recordings(rollout), windows)
    assert unassigned == []
    assert [(a.window.step, a.recording.replica) for a in assigned] == [(1, 0), (2, 0), (5, 0)]
    assert all(a.margin_ns == MARGIN_S * SECOND for a in assigned)
    assert [a.recording.files[0].span.ranges for a in assigned] == [4, 5, 8]  # its engine steps


def test_with_one_trainer_step_per_version_the_same_recordings_fall_elsewhere(tmp_path):
    write_run(tmp_path)
    trainer, rollout = spanned(tmp_path)
    assigned, unassigned = match(recordings(rollout), trainer_windows(trainer, 1))
    assert [a.window.step for a in assigned] == [2, 4, 10] and unassigned == []


def test_a_recording_stopping_in_no_trainer_window_is_not_assigned(tmp_path):
    write_run(tmp_path)
    write_recording(tmp_path, (5 * SECOND, 6 * SECOND + 500 * MS))  # inside version 3's unprofiled steps
    trainer, rollout = spanned(tmp_path)
    assigned, unassigned = match(recordings(rollout), trainer_windows(trainer, SYNC_EVERY))
    assert [a.window.step for a in assigned] == [1, 2, 5]
    [u] = unassigned
    assert "inside no step's trainer window; the nearest is step 5's" in u.why
    assert "1.500 s before it opened" in u.why


def test_two_recordings_of_a_replica_in_one_window_are_both_left_out(tmp_path):
    write_run(tmp_path)
    write_recording(tmp_path, (3 * SECOND + 600 * MS, 3 * SECOND + 700 * MS))  # a second one in step 2's window
    trainer, rollout = spanned(tmp_path)
    assigned, unassigned = match(recordings(rollout), trainer_windows(trainer, SYNC_EVERY))
    assert [a.window.step for a in assigned] == [1, 5]
    assert len(unassigned) == 2 and all("one of 2 recordings of replica 0" in u.why for u in unassigned)


def test_workers_of_one_window_are_one_recording(tmp_path):
    write_run(tmp_path)
    first = write_recording(tmp_path, rollout_window(2))
    first.rename(first.with_name("tp1-" + first.name))  # a second worker's trace of the same window
    write_recording(tmp_path, rollout_window(2))
    trainer, rollout = spanned(tmp_path)
    found = recordings(rollout)
    assert [len(r.files) for r in found] == [1, 2, 1]
    assigned, unassigned = match(found, trainer_windows(trainer, SYNC_EVERY))
    assert [len(a.recording.files) for a in assigned] == [1, 2, 1] and unassigned == []


# -- the steps built ------------------------------------------------------------------------------


def test_the_steps_are_built_complete_and_merged(built):
    store = TraceStore(built)
    assert store.steps() == STEPS
    for k in STEPS:
        m = StepManifest.model_validate_json((built / f"step_{k}" / "manifest.json").read_text())
        assert m.status == "complete" and m.merge is not None and m.merge.status == "ok"
        by_key = {e.key: e for e in m.entries}
        assert set(by_key) == {"trainer/rank_0", "rollout/replica0"}
        trainer, rollout = by_key["trainer/rank_0"], by_key["rollout/replica0"]
        assert [Path(f).name for f in trainer.files] == [trainer_name(s) for s in (2 * k - 1, 2 * k)]
        assert (trainer.weight_version, trainer.pid, trainer.clock_offset) == (k - 1, 4242, None)
        assert trainer.started_at == (T0_NS + (2 * k - 2) * SECOND) / 1e9
        assert (rollout.weight_version, rollout.weight_versions, rollout.forward_steps) == (k - 1, [k - 1], 3 + k)
        assert rollout.trace_dialect == TraceDialect(forward_range="execute_", version_in="window")
        assert rollout.stopped_at == (T0_NS + rollout_window(k)[1]) / 1e9
        w = rollout.window_match
        assert w is not None and w.trainer_steps == [2 * k - 1, 2 * k] and w.hosts == [HOST]
        assert w.margin_s == pytest.approx(MARGIN_S) and "one host (node-a)" in w.clocks
        assert rollout.clock_unmeasured and "verl runs no clock exchange" in rollout.clock_unmeasured
        for name in ("merged.trace.json.gz", "report.html", "ranks/view.record", INGEST_RECORD):
            assert (built / f"step_{k}" / name).is_file(), name
    assert (built / "index.html").is_file()


def test_verl_s_files_stay_where_they_were_linked_into_the_steps(built):
    original = built / trainer_name(9)
    linked = built / "step_5" / "trainer" / "rank_0" / trainer_name(9)
    assert original.is_file() and linked.stat().st_ino == original.stat().st_ino
    assert len(list((built / "agent_loop_rollout_replica_0").glob("*.pt.trace.json.gz"))) == 3


def test_verify_notes_how_each_recording_was_assigned_and_finds_nothing_wrong(built):
    violations, notes = findings(TraceStore(built), STEPS)
    assert violations == []
    assigned = [n for n in notes if n.check == "versions"]
    assert [(n.step, n.entry) for n in assigned] == [(k, "rollout/replica0") for k in STEPS]
    n = assigned[2].message
    assert n.startswith(
        "8 forward passes ('execute_...' ranges) carry no weight version: assigned to step 5 (weights v4)"
    )
    assert "trainer steps 9, 10), 0.400 s from its nearer edge" in n and "one host (node-a)" in n
    clocks = [n for n in notes if n.check == "clock"]
    assert len(clocks) == 2 * len(STEPS)
    assert all(n.message.startswith("clock offset not measured (verl runs no clock exchange)") for n in clocks)


def test_a_recording_moved_to_another_step_fails(copy):
    root = copy.root
    shutil.rmtree(root / "step_5" / "rollout" / "replica0")
    shutil.copytree(root / "step_2" / "rollout" / "replica0", root / "step_5" / "rollout" / "replica0")
    copy.refresh_manifest(5)
    violations, _ = findings(copy, [5])
    moved = [v for v in violations if "outside step 5's trainer window" in v.message]
    assert len(moved) == 1 and moved[0].entry == "rollout/replica0" and moved[0].check == "versions"
    assert "4.500 s outside" in moved[0].message  # stopped at 3.5 s, the window opens at 8 s


def test_a_recording_moved_without_its_weight_version_still_fails(copy):
    """The time check alone catches it: the entry's version was edited to the new step's."""
    root = copy.root
    shutil.rmtree(root / "step_5" / "rollout" / "replica0")
    shutil.copytree(root / "step_2" / "rollout" / "replica0", root / "step_5" / "rollout" / "replica0")
    [entry] = [e for e in copy.read_entries(5) if e.role == "rollout"]
    copy.write_entry(5, entry.model_copy(update={"weight_version": 4, "weight_versions": [4]}))
    copy.refresh_manifest(5)
    [v] = findings(copy, [5])[0]
    assert v.check == "versions" and "outside step 5's trainer window" in v.message


def test_a_trace_swapped_in_from_another_step_fails(copy):
    root = copy.root
    [mine] = (root / "step_5" / "rollout" / "replica0").glob("*.pt.trace.json.gz")
    [theirs] = (root / "step_2" / "rollout" / "replica0").glob("*.pt.trace.json.gz")
    mine.unlink()  # a hard link of verl's file: replaced, not written through
    shutil.copy(theirs, mine)
    violations, _ = findings(copy, [5])
    assert {v.check for v in violations} == {"files", "marker_count"}
    [v] = [v for v in violations if v.check == "files"]
    assert "the traces' events run from" in v.message and "swapped in from another step?" in v.message


def test_an_entry_that_lost_its_match_fails(copy):
    [entry] = [e for e in copy.read_entries(1) if e.role == "rollout"]
    copy.write_entry(1, entry.model_copy(update={"window_match": None}))
    copy.refresh_manifest(1)
    [v] = findings(copy, [1])[0]
    assert v.check == "versions" and "has no window_match" in v.message


def test_a_step_without_its_trainer_entry_cannot_check_the_match(copy):
    shutil.rmtree(copy.root / "step_2" / "trainer")
    copy.refresh_manifest(2)
    [v] = findings(copy, [2])[0]
    assert v.check == "versions" and "step 2 has no trainer entry" in v.message


def test_an_engine_step_count_that_disagrees_fails(copy):
    [entry] = [e for e in copy.read_entries(1) if e.role == "rollout"]
    copy.write_entry(1, entry.model_copy(update={"forward_steps": 9}))
    copy.refresh_manifest(1)
    [v] = findings(copy, [1])[0]
    assert v.check == "marker_count" and "4 forward ranges ('execute_...')" in v.message


def test_an_entry_without_a_clock_and_without_a_reason_still_fails(copy):
    [entry] = [e for e in copy.read_entries(1) if e.role == "trainer"]
    copy.write_entry(1, entry.model_copy(update={"clock_unmeasured": None}))
    copy.refresh_manifest(1)
    [v] = findings(copy, [1])[0]
    assert (v.entry, v.check) == ("trainer/rank_0", "clock") and "no clock alignment" in v.message


def test_the_command_as_verl_s_finish_hook_runs_it(tmp_path, monkeypatch):
    save = tmp_path / "profile"
    write_run(save)
    monkeypatch.setenv("VERL_PROFILE_SAVE_PATH", str(save))
    res = runner.invoke(app, ["verl", "--trigger-parameter-sync-step", "2"])
    assert res.exit_code == EXIT_OK, res.output
    lines = res.stdout.splitlines()
    assert lines[0] == f"verl traces under {save}: 6 trainer and 3 rollout trace file(s); trigger_parameter_sync_step 2"
    assert "step 5 (complete): verl steps 9, 10, trainer window" in res.stdout
    assert "; stopped at " in res.stdout and "0.400 s inside the trainer window" in res.stdout
    assert "not merged, no step: agent_loop_rollout_replica_0/rank0.profiler_out.txt" in res.stdout
    assert lines[-1] == f"report: {save / 'index.html'}"


def test_a_rerun_with_another_mapping_replaces_what_the_first_built(copy):
    res = runner.invoke(app, ["verl", str(copy.root), "--json"])  # T = 1: verl's steps are the versions
    assert res.exit_code == EXIT_OK, res.output
    report = json.loads(res.stdout)
    assert [s["step"] for s in report["steps"]] == [1, 2, 3, 4, 9, 10]
    assert report["removed"] == ["step_5: built by an earlier run from these traces, not a step of this mapping"]
    partial = {s["step"]: s["errors"] for s in report["steps"] if s["status"] == "partial"}
    assert sorted(partial) == [1, 3, 9]
    assert "no recording of replica 0 stopped inside step 1's trainer window" in partial[1][0]
    assert copy.steps() == [1, 2, 3, 4, 9, 10]


def test_what_is_recognised_but_not_merged_is_listed_by_step(tmp_path):
    save = tmp_path / "profile"
    write_run(save)
    (save / "9" / "train" / "vm_1_20260101_ascend_pt").mkdir(parents=True)  # verl step 9 -> step 5
    (save / "actor_vm_worker_process_4242.nsys-rep").write_bytes(b"")
    write_recording(save, (5 * SECOND, 6 * SECOND + 500 * MS))
    report = ingest(save, sync_every=SYNC_EVERY)
    [five] = [s for s in report.steps if s.step == 5]
    assert five.not_merged == [
        "9/train/vm_1_20260101_ascend_pt/: torch_npu's profiler output (msprof data, not a "
        "Chrome trace of its own): not merged"
    ]
    assert any(
        n.startswith("actor_vm_worker_process_4242.nsys-rep: an Nsight Systems report") for n in report.not_assigned
    )
    [u] = report.unassigned
    assert u.startswith("replica 0 (agent_loop_rollout_replica_0/") and "inside no step's trainer window" in u


def test_no_verl_traces_is_a_usage_error_naming_the_fix(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    res = runner.invoke(app, ["verl", str(tmp_path)])
    assert res.exit_code == EXIT_USAGE
    assert (
        "no verl traces in" in res.stderr and "global_profiler.save_path with global_profiler.tool: torch" in res.stderr
    )
    with pytest.raises(NoVerlTraces):
        ingest(tmp_path)
    res = runner.invoke(app, ["verl", str(tmp_path / "nope")])
    assert res.exit_code == EXIT_USAGE and "is not a directory" in res.stderr


def test_without_a_save_path_the_hook_s_variable_is_needed(monkeypatch):
    monkeypatch.delenv("VERL_PROFILE_SAVE_PATH", raising=False)
    res = runner.invoke(app, ["verl"])
    assert res.exit_code == EXIT_USAGE and "$VERL_PROFILE_SAVE_PATH" in res.stderr


def test_a_directory_it_did_not_write_is_left_alone(tmp_path):
    save = tmp_path / "profile"
    write_run(save)
    (save / "step_2").mkdir()
    (save / "step_2" / "mine.txt").write_text("someone's")
    report = ingest(save, sync_every=SYNC_EVERY)
    assert [s.step for s in report.steps] == [1, 5]
    assert report.left[0].startswith("step_2: a directory neither the app nor this command wrote")
    assert (save / "step_2" / "mine.txt").read_text() == "someone's"


# -- the plugin's shape: the app's steps completed ------------------------------------------------


def app_step(store: TraceStore, k: int, window: tuple[int, int]) -> None:
    """Step k as the app writes it with the plugin: its replicas' entries, this project's markers."""
    ps = [p for p in procs(k) if p.role == "rollout"]
    for p in ps:
        p.window = window
    write_step(store, k, ps)
    settle(store, k)


def test_the_app_s_steps_get_the_trainer_traces_and_their_clocks(tmp_path):
    verl_dir, app_dir = tmp_path / "verl", tmp_path / "app"
    for s in (1, 2, 3, 4):
        write_trainer(verl_dir, s)
    store = TraceStore(app_dir)
    app_step(store, 1, (0, 2 * SECOND))
    app_step(store, 2, (2 * SECOND, 4 * SECOND))
    offset = ClockOffset(offset_ns=2_000_000, bound_ns=300_000, samples=5)
    for version in (1, 2):
        append_trainer_clock(
            verl_dir,
            TrainerClock(rank=0, pid=4242, hostname=HOST, version=version, measured_at=0.0, offset=offset),
        )
    before = {k: [e for e in store.read_entries(k) if e.role == "rollout"] for k in (1, 2)}
    res = runner.invoke(
        app, ["verl", str(verl_dir), "--app-save-path", str(app_dir), "--trigger-parameter-sync-step", "2"]
    )
    assert res.exit_code == EXIT_OK, res.output
    assert "step 1 (complete, the app's step: trainer entries added)" in res.stdout
    for k in (1, 2):
        m = store.read_manifest(k)
        assert m is not None and m.status == "complete" and m.merge is not None and m.merge.status == "ok"
        [trainer] = [e for e in m.entries if e.role == "trainer"]
        assert trainer.clock_offset == offset and trainer.clock_unmeasured is None
        assert [Path(f).name for f in trainer.files] == [trainer_name(2 * k - 1), trainer_name(2 * k)]
        assert [e for e in m.entries if e.role == "rollout"] == before[k]  # the app's, untouched
    report = verify_steps(store, [1, 2])
    assert report.violations == [], report.violations
    # again: what the first run added is replaced, not doubled
    res = runner.invoke(
        app, ["verl", str(verl_dir), "--app-save-path", str(app_dir), "--trigger-parameter-sync-step", "2"]
    )
    assert res.exit_code == EXIT_OK, res.output
    assert [e.key for e in store.read_entries(1)] == ["rollout/r0", "rollout/r1", "trainer/rank_0"]


def test_a_recording_in_the_app_s_step_is_not_used(tmp_path):
    save = tmp_path / "profile"
    write_run(save)
    store = TraceStore(save)
    app_step(store, 2, (2 * SECOND, 4 * SECOND))  # the app wrote step 2 itself
    report = ingest(save, sync_every=SYNC_EVERY)
    assert [(s.step, s.app_step) for s in report.steps] == [(1, False), (2, True), (5, False)]
    [u] = report.unassigned
    assert u.endswith(
        "stopped inside step 2's trainer window, but step_2 is the app's step, whose own rollout entries stand"
    )
    assert sorted(e.key for e in store.read_entries(2)) == ["rollout/r0", "rollout/r1", "trainer/rank_0"]


def test_the_app_s_own_trainer_entry_is_kept(tmp_path):
    verl_dir, app_dir = tmp_path / "verl", tmp_path / "app"
    write_trainer(verl_dir, 1)
    store = TraceStore(app_dir)
    write_step(store, 1, procs(1))  # the app's trainer rank 0 recorded the step itself
    settle(store, 1)
    report = ingest(verl_dir, app_dir)
    [one] = report.steps
    assert one.app_step and one.kept == ["trainer/rank_0"] and one.files == {}
    [trainer] = [e for e in store.read_entries(1) if e.role == "trainer"]
    assert trainer.clock is not None  # the app's entry, with its clock samples


def test_out_and_app_save_path_must_agree(tmp_path):
    write_trainer(tmp_path / "verl", 1)
    res = runner.invoke(
        app, ["verl", str(tmp_path / "verl"), "--out", str(tmp_path / "a"), "--app-save-path", str(tmp_path / "b")]
    )
    assert res.exit_code == EXIT_USAGE and "give only --app-save-path" in res.stderr


# -- the manifest ---------------------------------------------------------------------------------


def test_manifests_written_before_the_fields_still_read():
    old = {
        "role": "rollout",
        "replica_id": "r0",
        "trace_dialect": {"forward_range": "forward_step#", "version_in": "marker"},
    }
    e = ManifestEntry.model_validate(old)
    assert (e.window_match, e.clock_unmeasured) == (None, None)


def test_a_window_dialect_takes_no_file_version():
    with pytest.raises(ValueError, match="takes no file_version"):
        TraceDialect(forward_range="execute_", version_in="window", file_version=r"-v(\d+)")


def test_a_failed_merge_exits_1(copy, monkeypatch):
    from profiling.analysis import merge

    def broken(*_: object) -> None:
        raise OSError("no room")

    monkeypatch.setattr(merge, "check_merge_room", broken)
    res = runner.invoke(app, ["verl", str(copy.root), "--trigger-parameter-sync-step", "2"])
    assert res.exit_code == EXIT_FAILED
    assert "failed: merging step 1 failed: OSError: no room" in res.stderr


def test_unreadable_trainer_traces_are_named_and_a_rank_left_without_one_fails(tmp_path):
    save = tmp_path / "profile"
    write_run(save)
    (save / trainer_name(11)).write_bytes(b"\x1f\x8b cut off")  # step 6: no other trace, no step
    (save / trainer_name(9, rank=1)).write_bytes(b"\x1f\x8b cut off")  # step 5's rank 1, still being written?
    report = ingest(save, sync_every=SYNC_EVERY)
    assert sorted(u.split(":")[0] for u in report.unreadable) == sorted([trainer_name(11), trainer_name(9, rank=1)])
    assert [(s.step, s.status) for s in report.steps] == [(1, "complete"), (2, "complete"), (5, "partial")]
    [error] = report.steps[2].errors
    assert error.startswith(f"trainer/rank_1: its traces could not be read: {trainer_name(9, rank=1)} (")
    violations, notes = findings(TraceStore(save), [5])
    assert violations == [] and any(n.entry == "trainer/rank_1" and "failed, explained" in n.message for n in notes)


def test_rollout_recordings_without_trainer_traces_build_nothing(tmp_path):
    write_recording(tmp_path, rollout_window(1))
    res = runner.invoke(app, ["verl", str(tmp_path)])
    assert res.exit_code == EXIT_FAILED
    assert "not assigned to a step: replica 0" in res.stdout and "no trainer trace names a step" in res.stdout
    assert "no step built from" in res.stderr and "profile the trainer too" in res.stderr


def test_a_trace_without_a_host_leaves_the_clocks_unknown(tmp_path):
    save = tmp_path / "profile"
    write_trainer(save, 1, host=None)
    write_recording(save, (100 * MS, 500 * MS), host=None)
    report = ingest(save)
    [one] = report.steps
    [rollout] = [e for e in TraceStore(save).read_entries(1) if e.role == "rollout"]
    assert rollout.window_match is not None and "nothing measured" in rollout.window_match.clocks
    assert one.rollout[0].margin_s == pytest.approx(0.4)
