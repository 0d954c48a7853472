"""The trace budget, `max_trace_mb`: the cut of an exported trace, the early stop estimated from
earlier traces, the flag on engine-owned traces, and the server-side maximum.

Traces are real torch.profiler (CPU) recordings; the test's own thread plays the model thread."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch.profiler import ProfilerActivity, profile, record_function

from profiling.analysis.events import iter_events, sniff
from profiling.backends import ProfilerBackend, RecordedTrace
from profiling.config import ProfileOptions
from profiling.manifest import ManifestEntry
from profiling.markers import FORWARD_STEP, ForwardStepMarker, format_forward_step, parse_forward_step
from profiling.session import ProfileSession
from profiling.step_ranges import count_engine_steps
from profiling.trace_budget import MIB, StepSizeEstimate, cut_trace
from serve_app.limits import StartLimits

WAIT = 30.0


def record_trace(path: Path, steps: int) -> Path:
    """A real Kineto trace with `steps` forward_step ranges, each a few operators."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for i in range(steps):
            with record_function(format_forward_step(i, 1, 0)):
                for _ in range(5):
                    torch.randn(8, 8) @ torch.randn(8, 8)
    prof.export_chrome_trace(str(path))
    return path


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    return record_trace(tmp_path_factory.mktemp("trace") / "t.json", 30)


def marker(name: str) -> ForwardStepMarker:
    m = parse_forward_step(name)
    assert m is not None, name
    return m


def step_names(events: list[dict]) -> list[str]:
    found = [e["name"] for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(FORWARD_STEP)]
    return sorted(found, key=lambda n: marker(n).index)


# -- the cut ---------------------------------------------------------------------------------------


def test_cut_keeps_whole_forward_steps_within_the_budget(trace):
    max_mb = trace.stat().st_size / 3 / MIB
    out = io.BytesIO()
    cut = cut_trace(trace, out, max_mb)

    data = out.getvalue()
    assert len(data) == cut.bytes_written <= max_mb * MIB
    doc = json.loads(data)
    events = doc["traceEvents"]
    kept = cut.forward_steps_kept
    assert 0 < kept < cut.forward_steps_found == 30
    # Whole steps, from the first: no step after the cut, none before it missing.
    assert step_names(events) == [f"{FORWARD_STEP}{i} step=1 weight_version=0" for i in range(kept)]
    # The header (clock base, schema) survives; the file says plainly what was lost, and where.
    original = json.loads(trace.read_bytes())
    assert doc["baseTimeNanoseconds"] == original["baseTimeNanoseconds"]
    assert doc["truncated"]["forward_steps_kept"] == kept and doc["truncated"]["events_dropped"] == cut.events_dropped
    (marker,) = [e for e in events if e.get("ph") == "i" and str(e["name"]).startswith("trace cut")]
    assert f"forward steps {kept}..29" in marker["name"]
    later = [e for e in events if e.get("ph") != "M" and e is not marker and e["ts"] >= marker["ts"]]
    assert later == []
    # Everything recorded before the cut is still there, metadata included.
    before = [e for e in original["traceEvents"] if e.get("ph") == "M" or e["ts"] < marker["ts"]]
    assert len(events) - 1 == len(before) and len(original["traceEvents"]) - len(before) == cut.events_dropped


def test_cut_output_reads_like_any_trace(trace, tmp_path):
    """The analysis reads a cut trace like an uncut one (streamed, steps counted)."""
    out = tmp_path / "cut.json.gz"
    with gzip.open(out, "wb") as dst:
        cut = cut_trace(trace, dst, trace.stat().st_size / 2 / MIB)
    assert len(list(iter_events(out, sniff(out)))) > 0
    assert count_engine_steps(out, FORWARD_STEP) == cut.forward_steps_kept


def test_cut_that_fits_when_compact_drops_nothing(trace):
    """Kineto's JSON is indented; written compactly the whole trace can fit under a budget the
    file exceeds: then nothing is dropped and nothing claims a cut."""
    out = io.BytesIO()
    cut = cut_trace(trace, out, trace.stat().st_size * 0.9 / MIB)
    doc = json.loads(out.getvalue())
    assert cut.events_dropped == 0 and cut.forward_steps_kept == 30
    assert "truncated" not in doc and len(step_names(doc["traceEvents"])) == 30


def test_cut_without_forward_steps_keeps_a_time_prefix(tmp_path):
    """A trace with no forward_step ranges (or whose first step does not fit) keeps the
    earliest events that fit."""
    events = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "p"}}]
    events += [{"ph": "X", "name": f"op{i}", "pid": 1, "tid": 1, "ts": float(i), "dur": 0.5} for i in range(2000)]
    src = tmp_path / "t.json"
    src.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events[::-1]}))  # not in time order
    out = io.BytesIO()
    cut = cut_trace(src, out, 0.02)
    doc = json.loads(out.getvalue())
    kept = sorted(e["ts"] for e in doc["traceEvents"] if e["ph"] == "X")
    assert len(out.getvalue()) <= 0.02 * MIB and cut.forward_steps_kept == 0 and 0 < len(kept) < 2000
    assert kept == [float(i) for i in range(len(kept))]  # the earliest, none skipped
    assert cut.events_dropped == 2000 - len(kept)
    assert any(e["ph"] == "M" for e in doc["traceEvents"])


# -- the session: backstop and early stop ------------------------------------------------------


def make_session(store, exporter, **kw) -> ProfileSession:
    identity = ManifestEntry(role="rollout", replica_id="replica-0")
    return ProfileSession(store=store, entry_identity=identity, exporter=exporter, **kw)


def record_window(session: ProfileSession, spec, step: int, n: int, **options: object) -> ManifestEntry:
    model, x = torch.nn.Linear(16, 16), torch.randn(4, 16)
    session.start(spec(step, max_duration_s=None, **options), weight_version=step - 1)
    for _ in range(n):
        with session.forward_step(step - 1):
            model(x)
    session.stop(step)
    entry = session.wait_exported(step, timeout=WAIT)
    assert entry is not None and entry.status == "ok", entry
    return entry


def test_export_over_budget_is_cut_and_the_entry_says_what_was_kept(store, exporter, spec):
    s = make_session(store, exporter)
    entry = record_window(s, spec, 1, 40, max_trace_mb=0.05)
    assert entry.truncated and entry.forward_steps == 40
    assert entry.forward_steps_kept is not None and 0 < entry.forward_steps_kept < 40
    assert entry.trace_mb is not None and entry.trace_mb > 0.05 and not entry.over_budget
    path = store.step_dir(1) / entry.files[0]
    assert len(gzip.decompress(path.read_bytes())) <= 0.05 * MIB
    assert count_engine_steps(path, FORWARD_STEP) == entry.forward_steps_kept
    # The manifest carries it too.
    (listed,) = store.read_manifest(1).entries
    assert listed.truncated and listed.forward_steps_kept == entry.forward_steps_kept


def test_window_under_budget_is_neither_cut_nor_flagged(store, exporter, spec):
    entry = record_window(make_session(store, exporter), spec, 1, 5)
    assert not entry.truncated and entry.forward_steps_kept is None and not entry.over_budget
    assert entry.trace_mb is not None and 0 < entry.trace_mb < 1024


def test_window_stops_early_when_the_estimate_fills_the_budget(store, exporter, spec):
    """What a step cost in the last trace (same options) predicts the next window's size: the
    recording ends before the step that would overfill the budget."""
    s = make_session(store, exporter)
    first = record_window(s, spec, 1, 10, max_trace_mb=None)
    assert first.trace_mb is not None and first.auto_stopped is None
    per_step_mb = first.trace_mb / 10
    second = record_window(s, spec, 2, 20, max_trace_mb=per_step_mb * 5.5)
    assert second.auto_stopped == "max_trace_mb" and second.forward_steps == 5
    # Other options (record_shapes) make other step sizes: nothing learned for them yet.
    third = record_window(s, spec, 3, 20, max_trace_mb=per_step_mb * 5.5, record_shapes=True)
    assert third.auto_stopped is None and third.forward_steps == 20 and third.truncated


def test_estimate_rules():
    est, opts = StepSizeEstimate(), ProfileOptions(max_trace_mb=1.0)
    assert not est.next_step_overflows(opts, 10**6)  # nothing learned: no guess
    est.learn(opts, trace_bytes=MIB, forward_steps=0)  # no steps: nothing to learn from
    assert not est.next_step_overflows(opts, 10**6)
    est.learn(opts, trace_bytes=MIB // 2, forward_steps=4)  # 128 KiB per step
    assert not est.next_step_overflows(opts, 7) and est.next_step_overflows(opts, 8)
    assert not est.next_step_overflows(opts.model_copy(update={"max_trace_mb": None}), 10**6)  # null: no budget
    est.learn(opts, trace_bytes=MIB, forward_steps=4)  # the latest trace wins
    assert est.next_step_overflows(opts, 4)


# -- engine-owned traces: flagged, not cut -------------------------------------------------------


class WrittenTrace(RecordedTrace):
    """An engine-owned trace: the engine wrote it, the export only moves it (size not measured)."""

    def __init__(self, size: int):
        self._size = size

    def export(self, out_dir: Path) -> list[Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "engine.trace.json.gz"
        body = json.dumps({"traceEvents": [{"ph": "X", "name": "x" * self._size, "ts": 0, "dur": 1}]})
        path.write_bytes(gzip.compress(body.encode()))
        return [path]


class EngineBackend(ProfilerBackend):
    def __init__(self, options: ProfileOptions, size: int):
        super().__init__(options)
        self._size = size

    def _start(self) -> None:
        pass

    def _stop(self) -> RecordedTrace:
        return WrittenTrace(self._size)


@pytest.mark.parametrize(("size", "over"), [(2 * MIB, True), (MIB // 2, False)])
def test_engine_owned_trace_over_budget_is_flagged(store, exporter, spec, size, over):
    s = make_session(store, exporter, backend_factory=lambda sp: EngineBackend(sp.options, size))
    s.start(spec(1, max_trace_mb=1.0), weight_version=0)
    s.stop(1)
    entry = s.wait_exported(1, timeout=WAIT)
    assert entry is not None and entry.status == "ok"
    assert entry.over_budget is over and not entry.truncated and entry.trace_mb is None
    # Kept whole: the engine's file is not ours to cut.
    assert len(gzip.decompress((store.step_dir(1) / entry.files[0]).read_bytes())) > size


# -- options and the server-side maximum ------------------------------------------------------------


def test_budget_is_on_by_default_and_must_be_positive():
    assert ProfileOptions().max_trace_mb == 1024.0
    assert ProfileOptions(max_trace_mb=None).max_trace_mb is None
    for bad in (0, -1, float("inf")):
        with pytest.raises(ValidationError, match="max_trace_mb"):
            ProfileOptions(max_trace_mb=bad)


def test_start_limits_bound_the_budget():
    limits = StartLimits()
    assert limits.problems(ProfileOptions()) == []
    (problem,) = limits.problems(ProfileOptions(max_trace_mb=limits.max_trace_mb * 2))
    assert "start_limits.max_trace_mb" in problem
    (problem,) = limits.problems(ProfileOptions(max_trace_mb=None))  # no budget: only if the limit is null
    assert "max_trace_mb None exceeds" in problem
    assert StartLimits(max_trace_mb=None).problems(ProfileOptions(max_trace_mb=None)) == []
