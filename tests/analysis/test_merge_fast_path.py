"""The merge's fast path: events read in blocks (msgspec) must give exactly what parsing event
by event gives, keep fields it does not declare, find clock markers by search (or fall back to a
parse), and take a damaged input back whole from the gzip output."""

from __future__ import annotations

import gzip
import json
import subprocess

import msgspec
import pytest
from support.traces import read_trace

from profiling.analysis import chunks
from profiling.analysis.chunks import TraceEvent, find_markers, iter_chunks
from profiling.analysis.events import iter_events, sniff
from profiling.analysis.gzip_parts import GzipParts
from profiling.analysis.merge import merge_step
from profiling.store import MERGED_TRACE

from .synth import Proc, forward, write_step

MS = 1_000_000


def busy(name: str, role: str = "rollout", file: str = "trace.pt.trace.json", error_ns: int = 0) -> Proc:
    """A process with enough events to span many small blocks (~60 KB of JSON)."""
    ops = [("aten::mm", 5.0), ("aten::add", 2.0), ("aten::empty", 1.0)]
    events = [e for i in range(100) for e in forward(i, 1, 0, (i + 1) * MS // 10, 80.0, ops)]
    return Proc(role, name, os_pid=4242, clock_error_ns=error_ns, events=events, window=(0, 20 * MS), file=file)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 2 KiB: every trace spans dozens of them."""
    monkeypatch.setattr(chunks, "BLOCK_BYTES", 2048)
    monkeypatch.setattr(chunks, "SEARCH_BLOCK_BYTES", 4096)


def as_dict(e: TraceEvent | dict) -> dict:
    if isinstance(e, dict):
        return e
    d = {k: v for k, v in msgspec.structs.asdict(e).items() if v is not msgspec.UNSET}
    return {k: msgspec.json.decode(v) if isinstance(v, msgspec.Raw) else v for k, v in d.items()}


@pytest.mark.parametrize("file", ["trace.pt.trace.json", "trace.pt.trace.json.gz"])
def test_blocks_give_exactly_the_events_of_an_event_by_event_parse(store, small_blocks, file):
    write_step(store, 1, [busy("r0", file=file)])
    path = store.rollout_dir(1, "r0") / file
    fmt = sniff(path)
    read = [as_dict(e) for chunk in iter_chunks(path, fmt) for e in chunk]
    assert read == list(iter_events(path, fmt))
    assert len(read) > 400


def test_compact_json_falls_back_to_the_event_by_event_parse(tmp_path):
    events = [{"ph": "X", "name": f"op{i}", "pid": 1, "tid": 1, "ts": i, "dur": 1} for i in range(50)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert [as_dict(e) for c in iter_chunks(path, sniff(path)) for e in c] == events


def test_a_field_no_struct_declares_is_kept_in_the_merged_timeline(store, small_blocks):
    write_step(store, 1, [busy("r0")])
    path = store.rollout_dir(1, "r0") / "trace.pt.trace.json"
    text = path.read_text()
    odd = '"name": "aten::add", "x_custom": {"kept": [1, 2]},'
    assert text.count('"name": "aten::add",') == 100
    path.write_text(text.replace('"name": "aten::add",', odd, 1))
    merge_step(store, 1)
    events = read_trace(store.step_dir(1) / MERGED_TRACE)["traceEvents"]
    assert [e["x_custom"] for e in events if "x_custom" in e] == [{"kept": [1, 2]}]
    assert sum(str(e.get("name")).startswith("forward_step#") for e in events) == 100


def test_an_input_cut_off_part_way_is_taken_back_whole(store, small_blocks):
    write_step(store, 1, [busy("r0"), busy("r1")])
    path = store.rollout_dir(1, "r1") / "trace.pt.trace.json"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])  # dozens of blocks in, then nothing
    record = merge_step(store, 1)
    [why] = record.skipped
    assert why.startswith("rollout/r1/trace.pt.trace.json: unreadable trace") and "cut off" in why
    assert [a.key for a in record.processes] == ["rollout/r0"]
    out = store.step_dir(1) / MERGED_TRACE
    subprocess.run(["gzip", "-t", str(out)], check=True)  # one whole, valid gzip member
    trace = read_trace(out)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert any(n.startswith("rollout r1") and "no trace" in n for n in names)
    forward_pids = {e["pid"] for e in trace["traceEvents"] if str(e.get("name")).startswith("forward_step#")}
    assert len(forward_pids) == 1, "events of the damaged input were left in the output"
    assert trace["rolloutProfiler"]["skipped"] == [why]


def test_markers_found_by_search_are_the_ones_a_parse_finds(store, small_blocks):
    write_step(store, 1, [busy("r0", error_ns=7 * MS)])
    entry = store.read_entries(1)[0]
    path = store.rollout_dir(1, "r0") / "trace.pt.trace.json"
    names = frozenset(s.marker for s in (entry.clock.start, entry.clock.stop))
    found = find_markers(path, names)
    parsed = {e["name"]: e for e in iter_events(path, sniff(path)) if e.get("name") in names}
    assert found == parsed and len(found) == 2
    assert merge_step(store, 1).processes[0].offset_ns == 7 * MS


def test_markers_that_search_cannot_read_are_found_by_a_parse(store, small_blocks):
    # `args` (an object) before `name`: the search cannot tell where the event begins
    write_step(store, 1, [busy("r0", error_ns=-3 * MS)])
    entry = store.read_entries(1)[0]
    path = store.rollout_dir(1, "r0") / "trace.pt.trace.json"
    trace = json.loads(path.read_text())
    trace["traceEvents"] = [{"args": {"x": {"y": 1}}, **e} for e in trace["traceEvents"]]
    path.write_text(json.dumps(trace, indent=1))
    assert find_markers(path, frozenset({entry.clock.start.marker})) is None
    [alignment] = merge_step(store, 1).processes
    assert alignment.source == "clock_sync" and alignment.offset_ns == -3 * MS


def test_a_part_taken_back_leaves_only_the_parts_kept(tmp_path):
    path = tmp_path / "out.gz"
    with open(path, "wb") as f:
        gz = GzipParts(f)
        for text, keep in ((b"first,", True), (b"dropped" * 1000, False), (b"second", True)):
            gz.begin()
            gz.write(text)
            gz.commit() if keep else gz.rollback()
        gz.close()
    assert gzip.decompress(path.read_bytes()) == b"first,second"
    subprocess.run(["gzip", "-t", str(path)], check=True)


def test_the_merged_timeline_is_the_same_whatever_the_block_size(store, monkeypatch):
    write_step(store, 1, [busy("r0", error_ns=2 * MS), busy("r1", file="trace.pt.trace.json.gz")])
    merge_step(store, 1)
    whole = read_trace(store.step_dir(1) / MERGED_TRACE)
    monkeypatch.setattr(chunks, "BLOCK_BYTES", 1500)
    store.write_entry(1, store.read_entries(1)[0])  # a record rewritten: merged again
    merge_step(store, 1)
    assert read_trace(store.step_dir(1) / MERGED_TRACE) == whole
