"""`python -m profiling verify`: a clean step verifies, and each hand-corrupted copy fails naming
its problem (a verifier that never fails proves nothing)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from profiling.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, app
from profiling.manifest import ClockOffset, TraceDialect
from profiling.store import TraceStore
from serve_app.engines.sglang.trace_dialect import SGLANG_DIALECT

from .synth import Ev, Proc, forward, write_step

MS = 1_000_000
runner = CliRunner()
TRACE = "trace.pt.trace.json.gz"


def procs(step: int, version: int | None = None) -> list[Proc]:
    """Two replicas with three forward steps each and a trainer rank with two, all on weights
    step-1 (or `version`), as the session writes them."""
    v = step - 1 if version is None else version
    rollout = [
        Proc(
            "rollout",
            r,
            os_pid=10 + i,
            events=[e for n in range(3) for e in forward(n, step, v, (n + 1) * MS, 300.0, [("aten::mm", 100.0)])],
            window=(0, 10 * MS),
            weight_version=v,
        )
        for i, r in enumerate(("r0", "r1"))
    ]
    trainer = Proc(
        "trainer",
        "0",
        os_pid=5,
        events=[e for n in range(2) for e in forward(n, step, v, (n + 1) * MS, 500.0)],
        window=(0, 10 * MS),
        weight_version=v,
    )
    return [*rollout, trainer]


def edit_entry(store: TraceStore, step: int, key: str, **update: object) -> None:
    """Change one producer's entry record and re-derive the manifest, as a producer would."""
    [entry] = [e for e in store.read_entries(step) if e.key == key]
    store.write_entry(step, entry.model_copy(update=update))
    store.refresh_manifest(step)


def settle(store: TraceStore, step: int) -> None:
    """What the app adds to a step recorded with pause: clock offsets measured, holds recorded, no
    pass on the step's weights outside the window."""
    for e in store.read_entries(step):
        update: dict[str, object] = {"clock_offset": ClockOffset(offset_ns=1_000, bound_ns=50_000, samples=5)}
        if e.role == "rollout":
            update.update(sync_held_s=0.1, forward_steps_outside=0)
        store.write_entry(step, e.model_copy(update=update))
    store.refresh_manifest(step)


def clean_step(store: TraceStore, step: int) -> None:
    write_step(store, step, procs(step))
    settle(store, step)


def trace(store: TraceStore, step: int, who: str) -> Path:
    return store.step_dir(step) / who / TRACE


def rewrite(path: Path, old: str, new: str, count: int = 1) -> None:
    """Replace the first `count` occurrences of `old` in a gzipped trace."""
    text = gzip.decompress(path.read_bytes()).decode()
    assert old in text, f"{old!r} not in {path}"
    path.write_bytes(gzip.compress(text.replace(old, new, count).encode()))


def verify(store: TraceStore, *args: str) -> tuple[int, dict]:
    res = runner.invoke(app, ["verify", str(store.root), "--json", *args])
    assert res.exit_code in (EXIT_OK, EXIT_FAILED), res.output
    return res.exit_code, json.loads(res.stdout)


def only_violation(store: TraceStore, *args: str) -> dict:
    code, report = verify(store, *args)
    assert code == EXIT_FAILED, report
    assert len(report["violations"]) == 1, report["violations"]
    return report["violations"][0]


@pytest.fixture
def clean(store: TraceStore) -> TraceStore:
    clean_step(store, 1)
    clean_step(store, 2)
    return store


# -- clean steps --------------------------------------------------------------------------------


def test_clean_steps_verify_through_the_module(clean):
    proc = subprocess.run(
        [sys.executable, "-m", "profiling", "verify", str(clean.root)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == EXIT_OK, proc.stdout + proc.stderr
    assert "2 steps verified: 0 violations" in proc.stdout


def test_json_report_shape(clean):
    rewrite(trace(clean, 2, "rollout/r1"), "weight_version=1", "weight_version=0")
    res = runner.invoke(app, ["verify", str(clean.root), "--json"])
    assert res.exit_code == EXIT_FAILED, res.output
    report = json.loads(res.stdout)
    assert set(report) == {"steps", "violations", "notes"}
    assert report["steps"] == [1, 2] and report["notes"] == []
    [v] = report["violations"]
    assert set(v) == {"step", "entry", "check", "message"}
    assert (v["step"], v["entry"], v["check"]) == (2, "rollout/r1", "versions")


def test_plain_output_is_a_table_and_a_summary(clean):
    edit_entry(clean, 1, "rollout/r0", clock_offset=None)
    res = runner.invoke(app, ["verify", str(clean.root)])
    assert res.exit_code == EXIT_FAILED, res.output
    assert "verify: violations" in res.stdout and "rollout/r0" in res.stdout
    assert "2 steps verified: 1 violation" in res.stdout


def test_one_step_only(clean):
    rewrite(trace(clean, 2, "rollout/r0"), "weight_version=1", "weight_version=0")
    code, report = verify(clean, "--step", "1")
    assert code == EXIT_OK and report["steps"] == [1], report


def test_a_step_that_is_not_there_is_a_usage_error(clean, tmp_path):
    res = runner.invoke(app, ["verify", str(clean.root), "--step", "7"])
    assert res.exit_code == EXIT_USAGE and "no step_7 under" in res.stderr
    res = runner.invoke(app, ["verify", str(tmp_path / "nope")])
    assert res.exit_code == EXIT_USAGE and "is not a directory" in res.stderr


# -- versions -----------------------------------------------------------------------------------


def test_a_rollout_marker_with_the_wrong_version_fails(clean):
    rewrite(
        trace(clean, 2, "rollout/r0"),
        "forward_step#1 step=2 weight_version=1",
        "forward_step#1 step=2 weight_version=2",
    )
    v = only_violation(clean)
    assert (v["step"], v["entry"], v["check"]) == (2, "rollout/r0", "versions")
    assert "forward_step#1 step=2 weight_version=2" in v["message"] and "weights v1" in v["message"]


def test_a_trainer_marker_with_the_wrong_version_fails(clean):
    rewrite(trace(clean, 1, "trainer/rank_0"), "step=1 weight_version=0", "step=1 weight_version=1")
    v = only_violation(clean)
    assert (v["entry"], v["check"]) == ("trainer/rank_0", "versions")


def test_a_marker_with_the_wrong_step_label_fails(clean):
    rewrite(trace(clean, 1, "rollout/r1"), "step=1 weight_version=0", "step=3 weight_version=0")
    v = only_violation(clean)
    assert v["check"] == "versions" and "step=3" in v["message"]


def test_the_manifest_weight_version_must_be_the_steps(clean):
    edit_entry(clean, 2, "rollout/r1", weight_version=2)
    v = only_violation(clean)
    assert v["check"] == "versions" and "v2" in v["message"]


def test_forward_steps_without_markers_carry_no_version(store):
    ps = procs(1)
    for e in ps[0].events:
        if e.name.startswith("forward_step#"):
            e.name = f"execute_context_{e.name}"  # an engine's own iteration ranges, no version
    write_step(store, 1, ps)
    settle(store, 1)
    edit_entry(store, 1, "rollout/r0", forward_steps=3)
    v = only_violation(store)
    assert (v["entry"], v["check"]) == ("rollout/r0", "versions")
    assert "forward steps carry no weight version" in v["message"]


def test_a_trace_that_is_not_chrome_is_a_note(store):
    ps = procs(1)
    write_step(store, 1, ps)
    settle(store, 1)
    rep = store.step_dir(1) / "rollout" / "r0" / "profile.nsys-rep"
    rep.write_bytes(b"nsys")
    edit_entry(store, 1, "rollout/r0", files=["rollout/r0/profile.nsys-rep"], clock=None)
    code, report = verify(store)
    assert code == EXIT_OK, report
    assert any(n["entry"] == "rollout/r0" and "not a Chrome trace" in n["message"] for n in report["notes"])


# -- continuous windows -------------------------------------------------------------------------


def continuous(store: TraceStore, early_second_version: bool = False) -> None:
    """A window [1, 2] labelled 1: two passes on v0, the weight update to v1, two passes on v1."""
    update_at = 4 * MS
    v1_at = (3 if early_second_version else 5) * MS
    events = [
        *forward(0, 1, 0, 1 * MS, 300.0),
        *forward(1, 1, 0, 2 * MS, 300.0),
        Ev("weight_update version=1", update_at, 200.0, cat="user_annotation"),
        *forward(2, 1, 1, v1_at, 300.0),
        *forward(3, 1, 1, 6 * MS, 300.0),
    ]
    write_step(store, 1, [Proc("rollout", "r0", os_pid=10, events=events, window=(0, 10 * MS))])
    session = store.read_session(1)
    assert session is not None
    store.write_session(1, session.model_copy(update={"steps": [1, 2]}))
    settle(store, 1)
    edit_entry(store, 1, "rollout/r0", weight_versions=[0, 1], sync_held_s=None, forward_steps_outside=None)


def test_a_continuous_window_in_order_verifies(store):
    continuous(store)
    code, report = verify(store)
    assert code == EXIT_OK, report


def test_a_version_before_its_weight_update_fails(store):
    continuous(store, early_second_version=True)
    v = only_violation(store)
    assert v["check"] == "versions" and "before any 'weight_update version=1'" in v["message"]


def test_a_continuous_version_outside_the_window_fails(store):
    continuous(store)
    rewrite(
        trace(store, 1, "rollout/r0"),
        "forward_step#3 step=1 weight_version=1",
        "forward_step#3 step=1 weight_version=2",
    )
    v = only_violation(store)
    assert v["check"] == "versions" and "outside the window's versions v0..v1" in v["message"]


def test_only_a_late_joiner_may_start_a_continuous_window_on_a_later_version(store):
    events = [*forward(0, 1, 1, 1 * MS, 300.0), *forward(1, 1, 1, 2 * MS, 300.0)]
    write_step(store, 1, [Proc("rollout", "r0", os_pid=10, events=events, window=(0, 10 * MS), weight_version=1)])
    session = store.read_session(1)
    assert session is not None
    store.write_session(1, session.model_copy(update={"steps": [1, 2]}))
    settle(store, 1)
    edit_entry(store, 1, "rollout/r0", sync_held_s=None, forward_steps_outside=None)
    assert "before any 'weight_update version=1'" in only_violation(store)["message"]
    edit_entry(store, 1, "rollout/r0", late_start=True)
    assert verify(store)[0] == EXIT_OK


# -- counts, files, manifest --------------------------------------------------------------------


def test_a_marker_count_that_disagrees_with_the_manifest_fails(clean):
    edit_entry(clean, 1, "rollout/r1", forward_steps=4)
    v = only_violation(clean)
    assert (v["entry"], v["check"]) == ("rollout/r1", "marker_count")
    assert "3 forward-step markers" in v["message"] and "forward_steps=4" in v["message"]


def test_a_truncated_trace_is_counted_against_the_steps_kept(clean):
    edit_entry(clean, 1, "rollout/r1", forward_steps=9, truncated=True, forward_steps_kept=3)
    assert verify(clean)[0] == EXIT_OK
    edit_entry(clean, 1, "rollout/r1", forward_steps_kept=2)
    assert only_violation(clean)["check"] == "marker_count"


def test_gpu_twins_of_the_markers_are_not_counted(store):
    ps = procs(1)
    ps[0].events += [
        Ev(e.name, e.at_ns, e.dur_us, cat="gpu_user_annotation")
        for e in ps[0].events
        if e.name.startswith("forward_step#")
    ]
    write_step(store, 1, ps)
    settle(store, 1)
    edit_entry(store, 1, "rollout/r0", forward_steps=3)
    assert verify(store)[0] == EXIT_OK


def test_a_missing_file_fails(clean):
    trace(clean, 2, "trainer/rank_0").unlink()
    v = only_violation(clean)
    assert (v["step"], v["entry"], v["check"]) == (2, "trainer/rank_0", "files")
    assert "listed in the manifest but missing" in v["message"]


def test_an_unparseable_trace_fails(clean):
    path = trace(clean, 1, "rollout/r0")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # an export cut off
    v = only_violation(clean)
    assert (v["entry"], v["check"]) == ("rollout/r0", "files") and "does not parse" in v["message"]


def test_a_manifest_still_exporting_fails(clean):
    edit_entry(clean, 2, "rollout/r0", exporting=True)
    v = only_violation(clean)
    assert (v["step"], v["entry"], v["check"]) == (2, "-", "manifest") and "still exporting" in v["message"]


def test_a_manifest_still_recording_fails(store):
    write_step(store, 1, procs(1), stopped=False)
    v = only_violation(store)
    assert v["check"] == "manifest" and "still recording" in v["message"]


def test_a_damaged_manifest_fails(clean):
    (clean.step_dir(1) / "manifest.json").write_text("{")
    v = only_violation(clean)
    assert (v["step"], v["check"]) == (1, "manifest") and "not a valid StepManifest" in v["message"]


def test_explained_failures_are_notes_unexplained_ones_violations(clean):
    edit_entry(clean, 1, "rollout/r1", status="error", error="replica restarted during the step", files=[])
    code, report = verify(clean)
    assert code == EXIT_OK, report
    assert any("replica restarted" in n["message"] for n in report["notes"])
    edit_entry(clean, 1, "rollout/r1", error=None)
    v = only_violation(clean)
    assert (v["entry"], v["check"]) == ("rollout/r1", "manifest") and v["message"].startswith("incomplete")


# -- outside the window, clocks -----------------------------------------------------------------


def test_passes_outside_a_paused_window_fail(clean):
    edit_entry(clean, 2, "rollout/r0", forward_steps_outside=2)
    v = only_violation(clean)
    assert (v["step"], v["entry"], v["check"]) == (2, "rollout/r0", "outside_window")
    assert "2 forward pass(es) on weights v1" in v["message"]


def test_passes_after_a_cap_are_a_note_not_a_violation(clean):
    """A window capped at max_forward_steps stops recording while its step stays active: the
    passes after the cap are unrecorded on purpose (with the same count and no cap, a violation)."""
    edit_entry(clean, 2, "rollout/r0", forward_steps_outside=7, auto_stopped="max_forward_steps")
    code, report = verify(clean)
    assert code == EXIT_OK, report
    [note] = report["notes"]
    assert (note["entry"], note["check"]) == ("rollout/r0", "outside_window") and "capped" in note["message"]


def test_passes_outside_are_a_note_when_not_counted_and_ignored_without_pause(clean):
    edit_entry(clean, 2, "rollout/r0", forward_steps_outside=None)
    edit_entry(clean, 2, "rollout/r1", forward_steps_outside=5, sync_held_s=None)
    code, report = verify(clean)
    assert code == EXIT_OK, report
    assert [(n["entry"], n["check"]) for n in report["notes"]] == [("rollout/r0", "outside_window")]


def test_a_step_without_clock_offsets_fails(clean):
    for key in ("rollout/r0", "rollout/r1", "trainer/rank_0"):
        edit_entry(clean, 1, key, clock_offset=None)
    code, report = verify(clean)
    assert code == EXIT_FAILED
    assert {(v["entry"], v["check"]) for v in report["violations"]} == {
        ("rollout/r0", "clock"),
        ("rollout/r1", "clock"),
        ("trainer/rank_0", "clock"),
    }
    assert all("no clock alignment" in v["message"] for v in report["violations"])


def test_a_clock_marker_missing_from_the_trace_fails(clean):
    rewrite(trace(clean, 1, "rollout/r1"), '"clock_sync stop pid=11"', '"something else"')
    v = only_violation(clean)
    assert (v["entry"], v["check"]) == ("rollout/r1", "clock") and "clock_sync stop pid=11" in v["message"]


def test_a_clock_sample_missing_from_the_entry_fails(clean):
    [entry] = [e for e in clean.read_entries(1) if e.key == "trainer/rank_0"]
    assert entry.clock is not None
    edit_entry(clean, 1, "trainer/rank_0", clock=entry.clock.model_copy(update={"stop": None}))
    v = only_violation(clean)
    assert v["check"] == "clock" and "no clock sample at stop" in v["message"]


def test_report_model_round_trips(clean):
    """The JSON is the pydantic report (scripts can load it back)."""
    from profiling.analysis.verify import VerifyReport

    _, data = verify(clean)
    assert VerifyReport.model_validate(data).ok


# -- several trace files per entry --------------------------------------------------------------


def test_each_tensor_parallel_rank_holds_every_iteration(clean):
    """vLLM with tensor parallelism: one trace per worker, each marking every engine iteration;
    a rank whose trace lacks one fails, named."""
    r0 = trace(clean, 1, "rollout/r0")
    rank1 = r0.with_name(f"rank1.{TRACE}")
    rank1.write_bytes(r0.read_bytes())
    [entry] = [e for e in clean.read_entries(1) if e.key == "rollout/r0"]
    edit_entry(clean, 1, "rollout/r0", files=[*entry.files, f"rollout/r0/rank1.{TRACE}"])
    assert verify(clean)[0] == EXIT_OK
    rewrite(rank1, "forward_step#2 step=1 weight_version=0", "another range")
    v = only_violation(clean)
    assert (v["entry"], v["check"]) == ("rollout/r0", "marker_count") and f"rank1.{TRACE}" in v["message"], v


def sglang_trace(path: Path, forwards: int, forward_name: str = "step[DECODE bs=1]") -> None:
    """An SGLang trace as the adapter names it: SGLang's `step[..]` range around each forward,
    no version inside (the file name carries it)."""
    events = [
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": forward_name,
            "ts": 1000 * (n + 1),
            "dur": 300,
            "pid": 1,
            "tid": 1,
        }
        for n in range(forwards)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))


def as_sglang(store: TraceStore, step: int, versions: dict[int, int], forward_steps: int) -> None:
    """Replace replica r0's trace with SGLang's: one recording per version (with a second TP rank
    for the first), `versions` = {version: forwards}."""
    rels = []
    for i, (v, n) in enumerate(versions.items()):
        ranks = (0, 1) if i == 0 else (0,)
        for tp in ranks:
            rel = f"rollout/r0/step{step}-v{v}-1796000000.{i}-TP-{tp}.trace.json.gz"
            sglang_trace(store.step_dir(step) / rel, n)
            rels.append(rel)
    trace(store, step, "rollout/r0").unlink()
    edit_entry(
        store, step, "rollout/r0", files=rels, forward_steps=forward_steps, clock=None, trace_dialect=SGLANG_DIALECT
    )


def test_sglang_recordings_are_versioned_and_counted_by_file(clean):
    as_sglang(clean, 2, {1: 4}, forward_steps=4)
    code, report = verify(clean)
    assert code == EXIT_OK, report
    assert any(n["entry"] == "rollout/r0" and n["check"] == "clock" for n in report["notes"]), report


def test_an_sglang_recording_on_other_weights_fails(clean):
    as_sglang(clean, 2, {0: 4}, forward_steps=4)
    v = only_violation(clean)
    assert (v["step"], v["entry"], v["check"]) == (2, "rollout/r0", "versions") and "weights v0" in v["message"], v


def test_an_sglang_count_that_disagrees_fails(clean):
    as_sglang(clean, 2, {1: 4}, forward_steps=5)
    v = only_violation(clean)
    assert (v["entry"], v["check"]) == ("rollout/r0", "marker_count") and "forward_steps=5" in v["message"], v


def test_the_entrys_dialect_decides_how_its_traces_are_read(clean):
    """An engine's own naming, declared in its entry (`iter[..]` around each forward, the version
    in the file's name): verified by it. The same files read as this project's markers (an entry
    without the dialect) carry no weight version."""
    own = TraceDialect(forward_range="iter[", version_in="file_name", file_version=r"\.w(\d+)\.")
    rel = "rollout/r0/engine.w1.trace.json.gz"
    sglang_trace(clean.step_dir(2) / rel, 3, forward_name="iter[3 tokens]")
    trace(clean, 2, "rollout/r0").unlink()
    edit_entry(clean, 2, "rollout/r0", files=[rel], forward_steps=3, clock=None, trace_dialect=own)
    code, report = verify(clean)
    assert code == EXIT_OK, report
    edit_entry(clean, 2, "rollout/r0", forward_steps=4)
    v = only_violation(clean)
    assert (v["entry"], v["check"]) == ("rollout/r0", "marker_count") and "('iter[...')" in v["message"], v
    edit_entry(clean, 2, "rollout/r0", forward_steps=3, trace_dialect=TraceDialect())
    v = only_violation(clean)
    assert (v["entry"], v["check"]) == ("rollout/r0", "versions") and "carry no weight version" in v["message"], v
