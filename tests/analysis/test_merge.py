"""Merging a step's traces into one timeline: clock alignment, naming, control calls, streaming
inputs of every shape, and the record it leaves (synthetic traces with known clock errors)."""

from __future__ import annotations

import gzip
import json
import multiprocessing
import subprocess
import sys
import time

import pytest
from support.traces import read_trace, trace_events

from profiling.analysis.auto import MERGE_COMMAND
from profiling.analysis.background_merge import merge_if_settled
from profiling.analysis.merge import CONTROL_PID, MergeError, merge_step
from profiling.analysis.sources import StepNotFound
from profiling.analysis.tool_view import VIEW_DIR, VIEW_RECORD
from profiling.store import MERGED_TRACE, TraceStore

from .synth import BASE_NS, T0_NS, Proc, forward, write_step

MS = 1_000_000


def interleaved(errors: dict[str, int]) -> list[Proc]:
    """Three processes whose forward steps truly interleave (r0, r1, trainer, r0, ...), 1 ms
    apart, each trace clock off by its own error."""
    names = list(errors)
    procs = []
    for j, name in enumerate(names):
        role, label = ("trainer", "0") if name == "trainer" else ("rollout", name)
        events = [
            e for i in range(4) for e in forward(i, 1, 0, (3 * i + j + 1) * MS, 200.0, [("aten::mm", 50.0)])
        ]
        procs.append(
            Proc(role, label, os_pid=4242, clock_error_ns=errors[name], events=events, window=(0, 20 * MS))
        )
    return procs


def forward_events(trace: dict) -> list[dict]:
    return sorted(
        (e for e in trace["traceEvents"] if str(e.get("name", "")).startswith("forward_step#")),
        key=lambda e: e["ts"],
    )


def process_names(trace: dict) -> dict[int, str]:
    return {
        e["pid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e["name"] == "process_name"
    }


def test_known_clock_offsets_are_undone_and_events_come_back_in_order(store):
    # Raw trace times would order the trainer (50 ms behind) after everything else.
    errors = {"r0": 5 * MS, "r1": -7 * MS, "trainer": -50 * MS}
    write_step(store, 1, interleaved(errors))
    record = merge_step(store, 1)
    assert record is not None and record.status == "ok"
    offsets = {a.key: a for a in record.processes}
    assert offsets["rollout/r0"].offset_ns == 5 * MS and offsets["rollout/r1"].offset_ns == -7 * MS
    assert offsets["trainer/rank_0"].offset_ns == -50 * MS
    assert all(a.source == "clock_sync" and a.drift_ns == 0 for a in offsets.values())

    trace = read_trace(store.step_dir(1) / MERGED_TRACE)
    names = process_names(trace)
    order = [names[e["pid"]].split(" (")[0] for e in forward_events(trace)]
    assert order == ["rollout r0", "rollout r1", "trainer rank 0"] * 4
    # Every forward step lands at its true wall-clock time (to the µs).
    base = trace["baseTimeNanoseconds"]
    for k, e in enumerate(forward_events(trace)):
        true_ns = T0_NS + (k + 1) * MS
        assert abs(base + e["ts"] * 1000 - true_ns) < 1_000, (k, e)
    assert all(e["ts"] >= 0 for e in trace["traceEvents"] if "ts" in e)


def test_each_process_is_its_own_named_group_and_pids_never_collide(store):
    # All three inputs use the same OS pid (4242): the merge must keep them apart.
    write_step(store, 1, interleaved({"r0": 0, "r1": 0, "trainer": 0}))
    merge_step(store, 1)
    trace = read_trace(store.step_dir(1) / MERGED_TRACE)
    names = process_names(trace)
    assert names[CONTROL_PID].startswith("control calls")
    assert set(names.values()) - {names[CONTROL_PID]} == {
        "rollout r0 (node node-abcdef0, weights v0)",
        "rollout r1 (node node-abcdef0, weights v0)",
        "trainer rank 0",
    }
    events = [e for e in trace["traceEvents"] if e.get("ph") != "M"]
    assert {e["pid"] for e in events} <= set(names), "an event's process has no name"
    by_pid = {}
    for e in forward_events(trace):
        by_pid.setdefault(e["pid"], 0)
        by_pid[e["pid"]] += 1
    assert sorted(by_pid.values()) == [4, 4, 4]  # each input's events stayed in its own process
    labels = {
        e["pid"]: e["args"]["labels"] for e in trace["traceEvents"] if e.get("name") == "process_labels"
    }
    assert any(
        "replica=r0" in v and "node=node-abcdef0123456789" in v and "weights=v0" in v for v in labels.values()
    )
    sort = {
        e["pid"]: e["args"]["sort_index"]
        for e in trace["traceEvents"]
        if e.get("name") == "process_sort_index"
    }
    assert sort[CONTROL_PID] < min(v for p, v in sort.items() if p != CONTROL_PID)
    # Kineto's string-pid side tracks fold into their process; flow ids are scoped per input.
    assert not any(isinstance(e.get("pid"), str) for e in events)
    flow_ids = [e["id"] for e in events if e.get("ph") in ("s", "f")]
    assert len(flow_ids) == 6 and len(set(flow_ids)) == 3
    global_instants = [e for e in events if e.get("ph") == "i" and e.get("s") == "g"]
    assert not global_instants, "an input's global instants must be scoped to its process"


def test_control_calls_and_windows_are_on_the_timeline(store):
    procs = interleaved({"r0": 0, "r1": 0, "trainer": 0})
    write_step(store, 3, procs, sync_at_ns=15 * MS, sync=(0.010, 0.020, 0.005))
    merge_step(store, 3)
    trace = read_trace(store.step_dir(3) / MERGED_TRACE)
    base = trace["baseTimeNanoseconds"]
    control = {
        e["name"]: e for e in trace["traceEvents"] if e.get("pid") == CONTROL_PID and e.get("ph") == "X"
    }
    assert {"stop step 3", "update_weights v3", "start step 4", "controller: profiling step 3"} <= set(
        control
    )
    stop, update, start = control["stop step 3"], control["update_weights v3"], control["start step 4"]
    assert abs(base + stop["ts"] * 1000 - (T0_NS + 15 * MS)) < 1_000
    assert stop["dur"] == pytest.approx(10_000) and update["dur"] == pytest.approx(20_000)
    # back to back (unix seconds as floats resolve ~0.25 µs)
    assert update["ts"] == pytest.approx(stop["ts"] + stop["dur"], abs=0.5)
    assert start["ts"] == pytest.approx(update["ts"] + update["dur"], abs=0.5)
    windows = [e for e in trace["traceEvents"] if e.get("name") == "profiling window step 3"]
    assert len(windows) == 3 and all(w["dur"] == pytest.approx(20_000) for w in windows)


def test_trace_without_clock_sample_falls_back_to_base_time_and_says_so(store):
    procs = interleaved({"r0": 0, "r1": 0, "trainer": 0})
    procs[1].with_clock = False
    write_step(store, 1, procs)
    record = merge_step(store, 1)
    by_key = {a.key: a.source for a in record.processes}
    assert by_key == {
        "rollout/r0": "clock_sync",
        "rollout/r1": "baseTimeNanoseconds",
        "trainer/rank_0": "clock_sync",
    }
    meta = read_trace(store.step_dir(1) / MERGED_TRACE)["rolloutProfiler"]
    [note] = meta["clock_notes"]
    assert "rollout/r1" in note and "baseTimeNanoseconds" in note and "not measured" in note


def test_non_trace_files_and_broken_traces_are_skipped_and_reported(store):
    procs = interleaved({"r0": 0, "r1": 0, "trainer": 0})
    procs[0].extra_files = {
        "worker.profiler_out.txt": b"Self CPU time total: 1ms\n",
        "profiler_info.json": b'{"config": {"with_stack": false}}',
        # valid gzip, JSON cut off: found out while streaming, past sniff's head
        "cut.pt.trace.json.gz": gzip.compress(
            b'{"traceEvents": [' + b'{"ph": "X", "name": "a", "ts": 1, "dur": 1},' * 20_000
        ),
        # gzip cut off after more than sniff reads
        "broken.pt.trace.json.gz": gzip.compress(
            b'{"traceEvents": ['
            + b",".join(b'{"ph": "X", "name": "op%d", "ts": %d, "dur": 1}' % (i, i) for i in range(60_000))
            + b"]}"
        )[:-4000],
    }
    write_step(store, 1, procs)
    record = merge_step(store, 1)
    assert record.status == "ok" and len(record.processes) == 3
    why = {s.split(":")[0]: s for s in record.skipped}
    assert set(why) == {
        "rollout/r0/worker.profiler_out.txt",
        "rollout/r0/profiler_info.json",
        "rollout/r0/cut.pt.trace.json.gz",
        "rollout/r0/broken.pt.trace.json.gz",
    }
    assert "not a .json" in why["rollout/r0/worker.profiler_out.txt"]
    assert "not a Chrome trace" in why["rollout/r0/profiler_info.json"]
    assert "unreadable trace (IncompleteJSONError" in why["rollout/r0/cut.pt.trace.json.gz"]
    assert "unreadable trace (EOFError" in why["rollout/r0/broken.pt.trace.json.gz"]
    assert read_trace(store.step_dir(1) / MERGED_TRACE)["rolloutProfiler"]["skipped"] == record.skipped


def test_array_form_and_uncompressed_traces_merge(store):
    procs = interleaved({"r0": 0, "r1": 0, "trainer": 0})
    procs[0].file = "trace.json"  # plain JSON
    write_step(store, 1, procs)
    # r1 as a bare JSON array of events (no header), e.g. torch_npu's trace_view.json
    r1 = store.rollout_dir(1, "r1")
    events = trace_events(r1 / "trace.pt.trace.json.gz")
    for e in events:
        if isinstance(e.get("ts"), float):
            e["ts"] += BASE_NS / 1000  # absolute microseconds, as an array trace has no base
    (r1 / "trace_view.json").write_text(json.dumps(events))
    entry = next(e for e in store.read_entries(1) if e.replica_id == "r1")
    store.write_entry(1, entry.model_copy(update={"files": ["rollout/r1/trace_view.json"]}))
    record = merge_step(store, 1)
    assert {a.file for a in record.processes} == {
        "rollout/r0/trace.json",
        "rollout/r1/trace_view.json",
        "trainer/rank_0/trace.pt.trace.json.gz",
    }
    trace = read_trace(store.step_dir(1) / MERGED_TRACE)
    names = process_names(trace)
    assert [names[e["pid"]].split(" (")[0] for e in forward_events(trace)] == [
        "rollout r0",
        "rollout r1",
        "trainer rank 0",
    ] * 4


def test_entry_without_any_trace_still_gets_a_named_row(store):
    procs = interleaved({"r0": 0, "r1": 0, "trainer": 0})
    write_step(store, 1, procs)
    entry = next(e for e in store.read_entries(1) if e.replica_id == "r1")
    store.write_entry(1, entry.model_copy(update={"status": "error", "files": [], "error": "replica died"}))
    merge_step(store, 1)
    names = process_names(read_trace(store.step_dir(1) / MERGED_TRACE))
    assert any(n.startswith("rollout r1") and "no trace: replica died" in n for n in names.values())


def test_merge_is_recorded_in_the_manifest_and_skipped_when_up_to_date(store):
    write_step(store, 1, interleaved({"r0": 0, "r1": 0, "trainer": 0}))
    first = merge_step(store, 1, only_if_stale=True)
    assert first is not None
    m = store.read_manifest(1)
    assert m.merge is not None and m.merge.status == "ok" and m.merge.path == MERGED_TRACE
    assert m.merge.events == first.events and {a.key for a in m.merge.processes} == {
        "rollout/r0",
        "rollout/r1",
        "trainer/rank_0",
    }
    assert merge_step(store, 1, only_if_stale=True) is None  # same records: nothing to do
    entry = store.read_entries(1)[0]
    store.write_entry(1, entry.model_copy(update={"forward_steps": entry.forward_steps + 1}))
    assert merge_step(store, 1, only_if_stale=True) is not None  # records changed: merged again
    assert not list(store.step_dir(1).glob("*.tmp"))


def test_failed_merge_is_recorded_and_raised(store):
    write_step(store, 1, interleaved({"r0": 0, "r1": 0, "trainer": 0}))
    (store.step_dir(1) / MERGED_TRACE).mkdir()  # the rename onto it fails
    with pytest.raises(MergeError, match="merging step 1 failed"):
        merge_step(store, 1)
    m = store.read_manifest(1)
    assert m.merge.status == "error" and "IsADirectoryError" in m.merge.error
    assert not list(store.step_dir(1).glob(".merged*"))


def test_a_merge_that_would_not_fit_on_disk_is_not_attempted_and_says_so(store, monkeypatch):
    import shutil
    from collections import namedtuple

    write_step(store, 1, interleaved({"r0": 0, "r1": 0, "trainer": 0}))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**9, 10**9 - 1024, 1024))
    with pytest.raises(MergeError, match="not merged"):
        merge_step(store, 1)
    m = store.read_manifest(1)
    assert m.merge.status == "error" and "0 MiB free" in m.merge.error
    assert "merged.trace.json.gz is not written" in m.merge.error and "python -m profiling merge" in m.merge.error
    assert not (store.step_dir(1) / MERGED_TRACE).exists()
    assert all(e.files for e in m.entries)  # the traces themselves are untouched


def test_missing_step_names_the_steps_there(store):
    write_step(store, 2, interleaved({"r0": 0, "r1": 0, "trainer": 0}))
    with pytest.raises(StepNotFound, match=r"no step_7 under .* \(steps there: 2\)"):
        merge_step(store, 7)


def _merge_in_child(root: str) -> None:
    merge_step(TraceStore(root), 1)


def test_racing_merges_leave_one_whole_trace(store):
    write_step(store, 1, interleaved({"r0": 0, "r1": 0, "trainer": 0}))
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_merge_in_child, args=(str(store.root),)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    trace = read_trace(store.step_dir(1) / MERGED_TRACE)
    assert len(forward_events(trace)) == 12
    assert [p.name for p in store.step_dir(1).iterdir() if "tmp" in p.name] == []


def test_store_merges_in_the_background_when_a_step_settles(tmp_path):
    producer = TraceStore(tmp_path / "profile", merge_on_complete=True)
    procs = interleaved({"r0": 0, "r1": 0, "trainer": 0})
    write_step(producer, 1, procs, stopped=False)  # still recording: no merge
    write_step(producer, 2, procs)  # complete: merged
    deadline = time.monotonic() + 60
    merged = producer.step_dir(2) / MERGED_TRACE
    while (
        not (merged.is_file() and producer.read_manifest(2).merge is not None) and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert merged.is_file(), "the settled step was not merged in the background"
    assert producer.read_manifest(2).merge.status == "ok"
    assert not (producer.step_dir(1) / MERGED_TRACE).exists()


def test_a_background_merge_merges_only_settled_stale_steps(store):
    write_step(store, 1, interleaved({"r0": 0, "r1": 0, "trainer": 0}), stopped=False)
    write_step(store, 2, interleaved({"r0": 0, "r1": 0, "trainer": 0}))
    assert merge_if_settled(store.root, 1) == [] and merge_if_settled(store.root, 2) == []
    assert not (store.step_dir(1) / MERGED_TRACE).exists() and (store.step_dir(2) / MERGED_TRACE).is_file()
    # The ranks view comes with the merge (docs/analysis.md#trace-tools), of the settled step only.
    assert not (store.step_dir(1) / VIEW_DIR).exists() and (store.step_dir(2) / VIEW_DIR / VIEW_RECORD).is_file()
    before = (store.step_dir(2) / MERGED_TRACE).stat().st_mtime_ns
    merge_if_settled(store.root, 2)
    assert (store.step_dir(2) / MERGED_TRACE).stat().st_mtime_ns == before  # up to date: not redone


def test_a_background_merge_that_fails_exits_1_naming_the_cause(store):
    write_step(store, 2, interleaved({"r0": 0, "r1": 0, "trainer": 0}))
    (store.step_dir(2) / MERGED_TRACE).mkdir()  # the merged file cannot be written
    proc = subprocess.run(
        [sys.executable, *MERGE_COMMAND, str(store.root), "2"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1 and "IsADirectoryError" in proc.stderr, proc.stderr


def test_auto_merge_off_by_default(store):
    write_step(store, 1, interleaved({"r0": 0, "r1": 0, "trainer": 0}))
    time.sleep(0.5)
    assert not (store.step_dir(1) / MERGED_TRACE).exists()
