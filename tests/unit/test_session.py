"""ProfileSession with the real torch.profiler backend (CPU).

The test's own thread plays the model thread: every session method is called from it.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
from support.traces import trace_events

from profiling.backends import ProfilerBackend, RecordedTrace
from profiling.backends.torch_profiler import TRACE_FILE, TorchProfilerBackend
from profiling.config import ProfileOptions
from profiling.manifest import ManifestEntry, TraceDialect
from profiling.session import ProfileSession, SessionConflict, SessionSpec, StopOutcome

RID = "replica-0"
WAIT = 20.0


@pytest.fixture
def model():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 8)


def make_session(store, exporter, **kw) -> ProfileSession:
    return ProfileSession(
        store=store, entry_identity=ManifestEntry(role="rollout", replica_id=RID), exporter=exporter, **kw
    )


def run_steps(session: ProfileSession, model, n: int, weight_version: int) -> None:
    x = torch.randn(4, 8)
    for _ in range(n):
        with session.forward_step(weight_version):
            model(x)


def names(path: Path, prefix: str) -> list[str]:
    return sorted(
        (e["name"] for e in trace_events(path) if str(e.get("name", "")).startswith(prefix)),
        key=lambda s: int(s.split("#")[1].split()[0]) if "#" in s else 0,
    )


# -- control rules ---------------------------------------------------------------------------


def test_start_idempotent_and_conflicts(store, exporter, model, spec):
    s = make_session(store, exporter)
    assert s.state == "idle" and s.active_step is None
    assert s.start(spec(2, max_duration_s=None), weight_version=1) is True
    assert s.state == "profiling" and s.active_step == 2
    assert s.start(spec(2, max_duration_s=None), weight_version=1) is False  # same step: no restart
    with pytest.raises(SessionConflict):
        s.start(spec(3, max_duration_s=None), weight_version=1)
    assert s.active_step == 2 and s.state == "profiling"
    with pytest.raises(SessionConflict):
        s.stop(3)
    assert s.active_step == 2
    assert s.stop(2).stopped is True
    assert s.wait_exported(2, timeout=WAIT) is not None
    assert s.state == "idle"


def test_stop_when_idle_is_noop(store, exporter):
    s = make_session(store, exporter)
    seen: list[StopOutcome] = []
    out = s.stop(7, on_closed=seen.append)
    assert out.stopped is False and out.step is None
    assert seen == [out]
    assert s.state == "idle"
    assert s.wait_exported(7) is None
    assert not store.root.exists()


def test_forward_step_outside_recording_is_not_counted(store, exporter, model):
    s = make_session(store, exporter)
    run_steps(s, model, 3, weight_version=0)
    assert s.forward_steps == 0


def test_start_writes_exporting_entry_early(store, exporter, model, spec):
    s = make_session(store, exporter)
    s.start(spec(2, max_duration_s=None), weight_version=1)
    [entry] = store.read_entries(2)
    assert entry.exporting is True
    assert entry.replica_id == RID and entry.weight_version == 1
    assert entry.files == [f"rollout/{RID}/{TRACE_FILE}"]
    assert store.refresh_manifest(2).status == "exporting"
    s.stop(2)
    s.wait_exported(2, timeout=WAIT)


# -- full cycle ------------------------------------------------------------------------------


def test_full_cycle_trace_has_exactly_the_forward_steps(store, exporter, model, spec):
    s = make_session(store, exporter)
    run_steps(s, model, 2, weight_version=0)  # before start: not recorded
    t_start = time.time()
    assert s.start(spec(3, max_forward_steps=100, max_duration_s=None), weight_version=2)
    n = 5
    run_steps(s, model, n, weight_version=2)
    assert s.forward_steps == n
    out = s.stop(3)
    run_steps(s, model, 2, weight_version=3)  # after stop: not recorded
    assert out.stopped and out.step == 3 and out.forward_steps == n and out.weight_version == 2
    assert out.auto_stopped is None
    assert out.files == [f"rollout/{RID}/{TRACE_FILE}"]

    final = s.wait_exported(3, timeout=WAIT)
    assert final is not None
    assert final.status == "ok" and final.exporting is False and final.error is None
    assert final.bytes > 0 and final.export_s is not None and final.finalize_s is not None
    assert final.forward_steps == n and final.weight_versions == [2]
    assert final.forward_steps_in_window == n and final.kept is None, "an uncapped window keeps every step"
    assert final.started_at >= t_start - 1 and final.stopped_at >= final.started_at
    assert final.files == out.files

    path = store.step_dir(3) / out.files[0]
    assert path.is_file() and path.stat().st_size == final.bytes
    got = names(path, "forward_step#")
    assert got == [f"forward_step#{i} step=3 weight_version=2" for i in range(n)]
    assert s.state == "idle"

    # the entry on disk and the manifest agree
    [on_disk] = store.read_entries(3)
    assert on_disk == final
    m = store.read_manifest(3)
    assert m is not None and m.status == "complete" and m.entries == [final]
    # no temp files left behind by the export
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []


def test_on_closed_runs_before_finalize(store, exporter, model, spec):
    calls: list[str] = []
    real_stop = TorchProfilerBackend._stop

    class Spy(TorchProfilerBackend):
        def _stop(self):
            calls.append("finalize")
            return real_stop(self)

    s = make_session(store, exporter, backend_factory=lambda spec: Spy(spec.options))
    s.start(spec(2, max_duration_s=None), weight_version=1)
    run_steps(s, model, 2, weight_version=1)
    trace_path = store.rollout_dir(2, RID) / TRACE_FILE
    seen: dict = {}

    def on_closed(outcome: StopOutcome) -> None:
        calls.append("ack")
        seen["outcome"] = outcome
        seen["trace_exists"] = trace_path.exists()
        try:  # the export is registered before the ack, so a waiter waits (here: times out)
            s.wait_exported(2, timeout=0.05)
            seen["waited"] = False
        except TimeoutError:
            seen["waited"] = True
        seen["pending"] = s.exports_pending

    out = s.stop(2, on_closed=on_closed)
    assert calls == ["ack", "finalize"]
    assert seen["outcome"] == out and seen["outcome"].stopped is True
    assert seen["outcome"].forward_steps == 2
    assert seen["trace_exists"] is False and seen["waited"] and seen["pending"] == 1
    assert s.wait_exported(2, timeout=WAIT).status == "ok"
    assert trace_path.is_file()


# -- caps ------------------------------------------------------------------------------------


def test_max_forward_steps_caps(store, exporter, model, spec):
    s = make_session(store, exporter)
    s.start(spec(4, max_forward_steps=3, max_duration_s=None), weight_version=3)
    run_steps(s, model, 2, weight_version=3)
    assert s.state == "profiling"
    run_steps(s, model, 1, weight_version=3)
    assert s.state == "capped" and s.active_step == 4
    run_steps(s, model, 4, weight_version=3)  # beyond the cap: not recorded, counted for the entry only
    assert s.forward_steps == 3
    assert s.start(spec(4, max_duration_s=None), weight_version=3) is False  # still the active step
    with pytest.raises(SessionConflict):
        s.start(spec(5, max_duration_s=None), weight_version=3)

    out = s.stop(4)
    assert out.stopped is True and out.auto_stopped == "max_forward_steps" and out.forward_steps == 3
    assert s.state in ("idle", "exporting")
    final = s.wait_exported(4, timeout=WAIT)
    assert final.auto_stopped == "max_forward_steps" and final.forward_steps == 3
    path = store.step_dir(4) / final.files[0]
    assert names(path, "forward_step#") == [f"forward_step#{i} step=4 weight_version=3" for i in range(3)]
    assert s.state == "idle"
    # The stop, after the export, adds the steps run after the cap to the entry on disk.
    [on_disk] = store.read_entries(4)
    assert on_disk.forward_steps_in_window == 7
    assert on_disk.kept == (
        "kept 3 of 7 forward steps: max_forward_steps stopped the recording; "
        "raise max_forward_steps (null: no limit) to keep them all"
    )
    assert store.read_manifest(4).entries[0].kept == on_disk.kept


def test_capped_export_starts_before_stop(store, exporter, model, spec):
    s = make_session(store, exporter)
    s.start(spec(4, max_forward_steps=1, max_duration_s=None), weight_version=3)
    run_steps(s, model, 1, weight_version=3)
    assert s.state == "capped"
    # the recording ended at the cap: its export is already under way, before stop(4)
    final = s.wait_exported(4, timeout=WAIT)
    assert final is not None and final.status == "ok" and final.forward_steps == 1
    assert s.state == "capped"
    assert s.stop(4).stopped is True
    assert s.state == "idle"


def test_max_duration_caps_via_check_deadline(store, exporter, model, spec):
    s = make_session(store, exporter)
    s.start(spec(2, max_duration_s=0.05, max_forward_steps=None), weight_version=1)
    run_steps(s, model, 2, weight_version=1)
    s.check_deadline()
    assert s.state == "profiling"
    time.sleep(0.1)
    s.check_deadline()
    assert s.state == "capped"
    run_steps(s, model, 3, weight_version=1)
    assert s.forward_steps == 2
    out = s.stop(2)
    assert out.stopped and out.auto_stopped == "max_duration_s" and out.forward_steps == 2
    final = s.wait_exported(2, timeout=WAIT)
    assert final.auto_stopped == "max_duration_s"
    assert len(names(store.step_dir(2) / final.files[0], "forward_step#")) == 2
    [on_disk] = store.read_entries(2)
    assert on_disk.forward_steps_in_window == 5 and on_disk.kept.startswith("kept 2 of 5 forward steps")


def test_an_engine_that_counts_its_own_steps_gets_no_count_past_a_cap_of_the_session(store, exporter, spec):
    class EngineCounted(TorchProfilerBackend):  # a fake engine-owned profiler: it counts its steps itself
        counts_forward_steps = True

    s = make_session(store, exporter, backend_factory=lambda spec: EngineCounted(spec.options))
    s.start(spec(2, max_duration_s=0.05, max_forward_steps=None), weight_version=1)
    time.sleep(0.1)
    s.check_deadline()
    assert s.state == "capped"
    s.stop(2)
    s.wait_exported(2, timeout=WAIT)
    [on_disk] = store.read_entries(2)
    assert on_disk.forward_steps_in_window is None, "the session saw none of the engine's steps: not counted"
    assert on_disk.kept == (
        "kept 0 forward steps: max_duration_s stopped the recording; the steps run after it are not counted"
    )


def test_max_duration_caps_after_a_forward_step(store, exporter, model, spec):
    s = make_session(store, exporter)
    s.start(spec(2, max_duration_s=0.05, max_forward_steps=None), weight_version=1)
    time.sleep(0.1)
    run_steps(s, model, 1, weight_version=1)  # the step that crosses the deadline is recorded
    assert s.state == "capped" and s.forward_steps == 1
    assert s.stop(2).auto_stopped == "max_duration_s"
    s.wait_exported(2, timeout=WAIT)


# -- weight updates inside a window ----------------------------------------------------------


def test_mark_weight_update_inside_recording(store, exporter, model, spec):
    s = make_session(store, exporter)
    s.start(spec(1, steps=[1, 2], max_duration_s=None), weight_version=0)
    run_steps(s, model, 2, weight_version=0)
    applied: list[int] = []
    s.mark_weight_update(1, lambda: applied.append(1))
    assert applied == [1]
    run_steps(s, model, 2, weight_version=1)
    out = s.stop(1)
    assert out.weight_version == 0 and out.forward_steps == 4
    final = s.wait_exported(1, timeout=WAIT)
    assert final.weight_versions == [0, 1]
    path = store.step_dir(1) / final.files[0]
    assert names(path, "weight_update") == ["weight_update version=1"]
    assert names(path, "forward_step#") == [
        "forward_step#0 step=1 weight_version=0",
        "forward_step#1 step=1 weight_version=0",
        "forward_step#2 step=1 weight_version=1",
        "forward_step#3 step=1 weight_version=1",
    ]


def test_mark_weight_update_when_idle_just_applies(store, exporter):
    s = make_session(store, exporter)
    applied: list[int] = []
    s.mark_weight_update(5, lambda: applied.append(5))
    assert applied == [5]


# -- exporting state and export failures -----------------------------------------------------


class GatedTrace(RecordedTrace):
    def __init__(self, inner: RecordedTrace, gate: threading.Event, fail: bool = False):
        self.inner, self.gate, self.fail = inner, gate, fail

    def export(self, out_dir: Path) -> list[Path]:
        assert self.gate.wait(WAIT), "test never released the export"
        if self.fail:
            raise OSError(28, "No space left on device")
        return self.inner.export(out_dir)


def gated_factory(gate: threading.Event, fail: bool = False):
    class Gated(TorchProfilerBackend):
        def _stop(self) -> RecordedTrace:
            return GatedTrace(super()._stop(), gate, fail)

    def factory(spec: SessionSpec) -> ProfilerBackend:
        return Gated(spec.options)

    return factory


def test_state_exporting_while_export_pending(store, exporter, model, spec):
    gate = threading.Event()
    s = make_session(store, exporter, backend_factory=gated_factory(gate))
    s.start(spec(2, max_duration_s=None), weight_version=1)
    run_steps(s, model, 3, weight_version=1)
    out = s.stop(2)
    try:
        assert out.stopped
        assert s.active_step is None
        assert s.state == "exporting" and s.exports_pending == 1
        assert store.refresh_manifest(2).status == "exporting"
        # a new window may start while the old one exports
        assert s.start(spec(3, max_duration_s=None), weight_version=2) is True
        assert s.state == "profiling"
        s.stop(3)
    finally:
        gate.set()
    assert s.wait_exported(2, timeout=WAIT).status == "ok"
    assert s.wait_exported(3, timeout=WAIT).status == "ok"
    assert s.state == "idle" and s.exports_pending == 0
    assert store.read_manifest(2).status == "complete"


def test_export_failure_recorded_as_error(store, exporter, model, spec):
    gate = threading.Event()
    gate.set()
    s = make_session(store, exporter, backend_factory=gated_factory(gate, fail=True))
    s.start(spec(2, max_duration_s=None), weight_version=1)
    run_steps(s, model, 2, weight_version=1)
    assert s.stop(2).stopped
    final = s.wait_exported(2, timeout=WAIT)
    assert final.status == "error" and final.exporting is False
    assert final.error and "No space left on device" in final.error
    assert final.export_s is not None
    [on_disk] = store.read_entries(2)
    assert on_disk.status == "error"
    assert store.read_manifest(2).status == "partial"
    assert store.refresh_manifest(2).status == "partial"
    assert s.state == "idle"


# -- late start ------------------------------------------------------------------------------


def test_late_start_recorded_in_entry(store, exporter, model, spec):
    s = make_session(store, exporter)
    late = spec(5, late_start=True)
    assert s.start(late, weight_version=4)
    [early] = store.read_entries(5)
    assert early.late_start is True
    run_steps(s, model, 1, weight_version=4)
    s.stop(5)
    final = s.wait_exported(5, timeout=WAIT)
    assert final.late_start is True
    assert store.read_manifest(5).entries[0].late_start is True


def test_the_entry_carries_its_backends_trace_dialect(store, exporter, spec):
    """The profiler that records says how its traces read; the default is this project's markers."""
    own = TraceDialect(forward_range="iter[", version_in="file_name", file_version=r"-v(\d+)-")

    class EngineOwned(TorchProfilerBackend):
        trace_dialect = own

    s = make_session(store, exporter)
    s.start(spec(1, max_duration_s=None), weight_version=0)
    s.stop(1)
    assert s.wait_exported(1, timeout=WAIT).trace_dialect == TraceDialect()
    s = make_session(store, exporter, backend_factory=lambda spec: EngineOwned(spec.options))
    s.start(spec(2, max_duration_s=None), weight_version=1)
    [early] = store.read_entries(2)
    assert early.trace_dialect == own
    s.stop(2)
    assert s.wait_exported(2, timeout=WAIT).trace_dialect == own
    assert store.read_manifest(2).entries[0].trace_dialect == own


def test_not_late_by_default(store, exporter, spec):
    s = make_session(store, exporter)
    s.start(spec(1, max_duration_s=None), weight_version=0)
    s.stop(1)
    assert s.wait_exported(1, timeout=WAIT).late_start is False


def test_trainer_identity_writes_under_rank_dir(store, exporter, model, spec):
    s = ProfileSession(store=store, entry_identity=ManifestEntry(role="trainer", rank=1), exporter=exporter)
    s.start(spec(2, max_duration_s=None), weight_version=1)
    run_steps(s, model, 1, weight_version=1)
    s.stop(2)
    final = s.wait_exported(2, timeout=WAIT)
    assert final.files == [f"trainer/rank_1/{TRACE_FILE}"]
    assert (store.trainer_dir(2, 1) / TRACE_FILE).is_file()


# -- failures at start -----------------------------------------------------------------------


class FailingStart(TorchProfilerBackend):
    def _start(self) -> None:
        raise RuntimeError("profiler refused to start")


def test_failed_start_leaves_session_idle_and_restartable(store, exporter, model, spec):
    s = make_session(store, exporter, backend_factory=lambda spec: FailingStart(spec.options))
    with pytest.raises(RuntimeError, match="refused"):
        s.start(spec(2, max_duration_s=None), weight_version=1)
    assert s.state == "idle" and s.active_step is None
    assert s.stop(2).stopped is False
    ok = make_session(store, exporter)
    assert ok.start(spec(2, max_duration_s=None), weight_version=1) is True
    run_steps(ok, model, 1, weight_version=1)
    ok.stop(2)
    assert ok.wait_exported(2, timeout=WAIT).status == "ok"
    assert store.read_manifest(2).status == "complete"


def test_failed_start_does_not_leave_a_forever_exporting_entry(store, exporter, spec):
    s = make_session(store, exporter, backend_factory=lambda spec: FailingStart(spec.options))
    with pytest.raises(RuntimeError):
        s.start(spec(2, max_duration_s=None), weight_version=1)
    assert s.exports_pending == 0
    assert store.refresh_manifest(2).status != "exporting"


def test_failed_export_lists_no_missing_files(store, exporter, model, spec):
    gate = threading.Event()
    gate.set()
    s = make_session(store, exporter, backend_factory=gated_factory(gate, fail=True))
    s.start(spec(2, max_duration_s=None), weight_version=1)
    run_steps(s, model, 1, weight_version=1)
    s.stop(2)
    final = s.wait_exported(2, timeout=WAIT)
    assert final.status == "error"
    missing = [f for f in final.files if not (store.step_dir(2) / f).exists()]
    assert missing == []


def test_export_frees_the_recorded_events_without_waiting_for_garbage_collection(tmp_path, model):
    """torch's `profile` is in a reference cycle (it holds bound methods of itself); a large
    process rarely runs the full collection that frees cycles, so dead recordings piled up in
    the soak. The export must drop the events itself."""
    backend = TorchProfilerBackend(ProfileOptions(max_duration_s=None))
    backend.start()
    model(torch.randn(4, 8))
    trace = backend.stop()
    events = weakref.ref(trace._prof.profiler)
    gc.disable()
    try:
        trace.export(tmp_path)
        del trace
        assert events() is None, "the recorded events outlived the export"
    finally:
        gc.enable()
    assert (tmp_path / TRACE_FILE).stat().st_size > 0


def test_annotations_before_and_after_the_export_all_reach_the_entry(store, exporter, model, spec):
    """A replica adds its requests before the export and its sync hold after it; a trainer its
    sync cost and clock offset after it: a later annotation must not drop an earlier one."""
    s = make_session(store, exporter)
    s.start(spec(4), weight_version=3)
    run_steps(s, model, 2, weight_version=3)
    s.annotate(4, pid=77)
    s.stop(4)
    s.wait_exported(4, timeout=WAIT)
    s.annotate(4, late_start=True)
    s.annotate(4, node_id="n1")
    [entry] = store.read_entries(4)
    assert (entry.pid, entry.late_start, entry.node_id, entry.forward_steps) == (77, True, "n1", 2)


def test_an_annotation_that_arrives_just_as_the_export_writes_is_not_lost(store, exporter, model, spec):
    """The export writes the entry, then resolves its future: an annotation made in between
    (here from the export's own manifest refresh) must still reach the entry."""
    s = make_session(store, exporter)
    refresh = store.refresh_manifest
    annotated = []

    def refresh_then_annotate(step: int):
        [entry] = store.read_entries(step)
        if not entry.exporting and not annotated:
            annotated.append(step)
            s.annotate(step, node_id="late")
        return refresh(step)

    store.refresh_manifest = refresh_then_annotate
    s.start(spec(6), weight_version=5)
    run_steps(s, model, 1, weight_version=5)
    s.stop(6)
    s.wait_exported(6, timeout=WAIT)
    assert annotated == [6]
    [entry] = store.read_entries(6)
    assert entry.node_id == "late" and not entry.exporting


def test_the_window_that_recorded_a_version_alone_is_found_for_its_outside_count(store, exporter, model):
    """`step_started_on(v)`: the closed window that started on weights v with no weight load
    inside it, which `forward_steps_outside` is counted into; recorded passes counted by version."""
    session = make_session(store, exporter)
    opts = ProfileOptions(max_forward_steps=None)
    session.start(SessionSpec(step=2, steps=[2], options=opts), weight_version=1)
    assert session.step_started_on(1) is None, "still recording: more passes may come"
    run_steps(session, model, 3, weight_version=1)
    session.stop(2)
    assert session.step_started_on(1) == 2 and session.recorded_by_version() == {1: 3}
    session.start(SessionSpec(step=3, steps=[3, 4], options=opts), weight_version=2)
    session.note_weight_load()  # a weight load inside the window: it records two versions
    session.stop(3)
    assert session.step_started_on(2) is None and session.step_started_on(7) is None
    session.wait_exported(3, WAIT)
