"""The analysis on real torch.profiler traces recorded by ProfileSession: the clock markers the
session records are found and the offsets they give are measured, not assumed."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from support.traces import read_trace

from profiling.analysis.merge import merge_step
from profiling.analysis.summary import summarize_step
from profiling.config import ProfileOptions
from profiling.manifest import ManifestEntry, SessionRecord, SyncCost
from profiling.session import ProfileSession
from profiling.store import MERGED_TRACE, TraceStore


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, spec) -> TraceStore:
    """Step 1 recorded by two replicas and a trainer rank, one after the other (torch allows one
    profiler per process at a time), each with forward steps and a weight update."""
    store = TraceStore(tmp_path_factory.mktemp("torch") / "profile")
    options = ProfileOptions(max_duration_s=None)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    store.write_session(
        1, SessionRecord(step=1, steps=[1], tool="torch", options=options, started_at=time.time())
    )
    identities = [
        ManifestEntry(role="rollout", replica_id="r0", node_id="n0"),
        ManifestEntry(role="rollout", replica_id="r1", node_id="n0"),
        ManifestEntry(role="trainer", rank=0),
    ]
    with ThreadPoolExecutor(1) as exporter:
        for identity in identities:
            s = ProfileSession(store=store, entry_identity=identity, exporter=exporter)
            s.start(spec(1, max_duration_s=None), weight_version=0)
            for _ in range(6):
                with s.forward_step(0):
                    model(torch.randn(32, 64))
            s.mark_weight_update(1, lambda: time.sleep(0.005))
            began = time.time()
            s.stop(1)
            if identity.role == "trainer":
                s.annotate(1, sync=SyncCost(stop_s=0.001, update_s=0.002, start_s=0.001, began_at=began))
            s.wait_exported(1, 60)
    record = store.read_session(1)
    store.write_session(1, record.model_copy(update={"stopped_at": time.time()}))
    assert store.refresh_manifest(1).status == "complete"
    return store


def test_session_records_clock_samples_at_start_and_stop(recorded):
    for e in recorded.read_entries(1):
        assert e.clock is not None and e.clock.start is not None and e.clock.stop is not None
        for sample in (e.clock.start, e.clock.stop):
            assert sample.marker.startswith("clock_sync ") and sample.wall_before_ns <= sample.wall_after_ns
        assert (
            e.started_at * 1e9
            <= e.clock.start.wall_before_ns
            <= e.clock.stop.wall_after_ns
            <= e.stopped_at * 1e9 + 1e9
        )


def test_merge_measures_each_offset_and_places_forward_steps_inside_their_windows(recorded):
    record = merge_step(recorded, 1)
    assert {a.key: a.source for a in record.processes} == {
        "rollout/r0": "clock_sync",
        "rollout/r1": "clock_sync",
        "trainer/rank_0": "clock_sync",
    }
    for a in record.processes:
        # Kineto's clock is torch's TSC clock converted to unix time: close to time.time_ns().
        assert abs(a.offset_ns) < 5_000_000 and a.uncertainty_ns < 5_000_000, a
    trace = read_trace(recorded.step_dir(1) / MERGED_TRACE)
    base = trace["baseTimeNanoseconds"]
    windows = {e["pid"]: e for e in trace["traceEvents"] if e.get("name") == "profiling window step 1"}
    assert len(windows) == 3
    forward = [e for e in trace["traceEvents"] if str(e.get("name", "")).startswith("forward_step#")]
    assert len(forward) == 18
    for e in forward:
        w = windows[e["pid"]]
        assert w["ts"] <= e["ts"] and e["ts"] + e["dur"] <= w["ts"] + w["dur"], (e, w)
    # and the trainer's sync comes after its own recording, in wall-clock order
    stop = next(e for e in trace["traceEvents"] if e.get("name") == "stop step 1")
    trainer_window = next(
        w for w in windows.values() if w["args"]["forward_steps"] == 6 and w["pid"] // 1000 == 1
    )
    assert stop["ts"] >= trainer_window["ts"]
    assert base > 0


def test_summary_of_real_traces(recorded):
    s = summarize_step(recorded, 1)
    assert [p.key for p in s.processes] == ["trainer/rank_0", "rollout/r0", "rollout/r1"]
    for p in s.processes:
        assert p.forward_steps == 6 and p.forward_ms > 0 and p.forward_mean_ms > 0
        assert p.weight_updates == 1 and p.weight_update_ms >= 5.0
        assert p.ops and p.ops[0].self_ms > 0
        names = [o.name for o in p.ops]
        assert "aten::addmm" in names and not any(
            n.startswith(("forward_step#", "clock_sync", "PyTorch Profiler")) for n in names
        )
        assert (
            p.overhead.finalize_ms is not None
            and p.overhead.export_ms is not None
            and p.overhead.clock_sync_ms > 0
        )
        # self times of the ops never add up to more than the process's forward steps + update
        assert sum(o.self_ms for o in p.ops) <= p.forward_ms + p.weight_update_ms + 1.0
    assert s.skew.replicas == 2 and s.skew.slowest_replica in ("r0", "r1")
