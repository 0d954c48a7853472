"""The nsys backend against FakeCuda, fakes of torch.cuda.profiler / torch.cuda.nvtx, on CPU.

FakeCuda replaces `torch.cuda.is_available`, `torch.cuda.synchronize`,
`torch.cuda.profiler.start/stop` and `torch.cuda.nvtx.range_push/range_pop` and records the calls.
Nothing here ran under nsys or on an NVIDIA GPU.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from profiling.backends import create_backend
from profiling.backends.nsys_profiler import NEEDS_CUDA, NOTE_FILE, NsysProfilerBackend
from profiling.config import ProfileOptions
from profiling.manifest import ManifestEntry
from profiling.session import ProfileSession

RID = "replica-0"
WAIT = 20.0


class FakeCuda:
    """Stands in for the CUDA runtime calls the nsys backend makes; records them in order."""

    def __init__(self, available: bool = True):
        self.available = available
        self.calls: list[str] = []
        self.depth = 0

    def install(self, monkeypatch) -> FakeCuda:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: self.available)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.calls.append("synchronize"))
        monkeypatch.setattr(torch.cuda.profiler, "start", lambda: self.calls.append("profiler.start"))
        monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: self.calls.append("profiler.stop"))
        monkeypatch.setattr(torch.cuda.nvtx, "range_push", self.range_push)
        monkeypatch.setattr(torch.cuda.nvtx, "range_pop", self.range_pop)
        return self

    def range_push(self, msg: str) -> int:
        self.calls.append(f"range_push {msg}")
        self.depth += 1
        return self.depth - 1

    def range_pop(self) -> int:
        self.calls.append("range_pop")
        self.depth -= 1
        return self.depth


@pytest.fixture
def cuda(monkeypatch) -> FakeCuda:
    return FakeCuda().install(monkeypatch)


def session(store, exporter) -> ProfileSession:
    # backend_factory left at its default: create_backend picks the nsys backend from options.tool
    return ProfileSession(store=store, entry_identity=ManifestEntry(role="rollout", replica_id=RID), exporter=exporter)


def test_factory_builds_the_nsys_backend():
    backend = create_backend(ProfileOptions(tool="nsys"))
    assert isinstance(backend, NsysProfilerBackend)
    assert backend.trace_files == ()


def test_start_marks_stop_in_order(cuda):
    backend = create_backend(ProfileOptions(tool="nsys"))
    backend.start()
    with backend.mark("forward_step#0 step=1 weight_version=0"):
        cuda.calls.append("model")
    backend.stop()
    assert cuda.calls == [
        "profiler.start",
        "range_push forward_step#0 step=1 weight_version=0",
        "model",
        "range_pop",
        "synchronize",
        "profiler.stop",
    ]
    assert cuda.depth == 0


def test_range_popped_when_the_step_raises(cuda):
    backend = create_backend(ProfileOptions(tool="nsys"))
    backend.start()
    with pytest.raises(ValueError), backend.mark("boom"):
        raise ValueError("engine step failed")
    assert cuda.calls[-1] == "range_pop" and cuda.depth == 0
    backend.stop()


def test_session_cycle_writes_the_capture_note(cuda, store, exporter, spec):
    s = session(store, exporter)
    t0 = time.time()
    assert s.start(spec(2, steps=[2, 3], tool="nsys", max_duration_s=None), weight_version=1)
    [early] = store.read_entries(2)
    assert early.files == []  # nsys writes the report, not us
    for _ in range(2):
        with s.forward_step(weight_version=1):
            pass
    s.mark_weight_update(2, lambda: cuda.calls.append("load weights"))
    with s.forward_step(weight_version=2):
        pass
    out = s.stop(2)
    t1 = time.time()
    assert out.stopped and out.forward_steps == 3

    assert cuda.calls == [
        "profiler.start",
        "range_push forward_step#0 step=2 weight_version=1",
        "range_pop",
        "range_push forward_step#1 step=2 weight_version=1",
        "range_pop",
        "range_push weight_update version=2",
        "load weights",
        "range_pop",
        "range_push forward_step#2 step=2 weight_version=2",
        "range_pop",
        "synchronize",
        "profiler.stop",
    ]

    final = s.wait_exported(2, timeout=WAIT)
    assert final is not None and final.status == "ok" and final.error is None
    assert final.files == [f"rollout/{RID}/{NOTE_FILE}"] and final.bytes > 0
    assert final.weight_versions == [1, 2]
    note = json.loads((store.rollout_dir(2, RID) / NOTE_FILE).read_text())
    assert note["tool"] == "nsys" and note["trace_written_here"] is False
    assert "nsys profile" in note["report"] and ".nsys-rep" in note["report"]
    assert "--capture-range=cudaProfilerApi" in note["run_under"]
    assert note["pid"] == os.getpid()
    cap = note["capture"]
    assert t0 <= cap["started_at"] <= cap["stopped_at"] <= t1
    assert cap["duration_s"] == pytest.approx(cap["stopped_at"] - cap["started_at"])
    assert cap["nvtx_ranges"] == 4
    assert final.started_at <= cap["started_at"] and cap["stopped_at"] >= final.stopped_at - 1

    m = store.read_manifest(2)
    assert m is not None and m.status == "complete" and m.entries == [final]
    # The note is JSON but no trace: the verifier reads it as present, not as a broken trace
    # (it did, on a CUDA machine).
    from profiling.analysis.verify import verify_steps

    report = verify_steps(store, [2])
    assert not [v for v in report.violations if v.check == "files"], report.violations


def test_clear_error_without_cuda(monkeypatch, store, exporter, spec):
    cuda = FakeCuda(available=False).install(monkeypatch)
    backend = create_backend(ProfileOptions(tool="nsys"))
    with pytest.raises(RuntimeError) as ei:
        backend.start()
    assert str(ei.value) == NEEDS_CUDA
    assert NEEDS_CUDA == (
        "tool 'nsys' needs a CUDA device and must run under `nsys profile --capture-range=cudaProfilerApi`"
    )
    assert cuda.calls == [] and not backend.recording

    s = session(store, exporter)
    with pytest.raises(RuntimeError, match="tool 'nsys' needs a CUDA device"):
        s.start(spec(1, tool="nsys", max_duration_s=None), weight_version=0)
    assert s.state == "idle" and s.active_step is None
    assert cuda.calls == []
