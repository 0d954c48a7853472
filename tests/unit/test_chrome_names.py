"""Event names torch.profiler writes as invalid JSON (profiling/backends/chrome_names.py): a
frame of freed code gets a garbage name, once seen as `..._cupti_monitor.py(0): "` with the quote
unescaped, and the whole trace failed to read. The export escapes such names and the step keeps
its trace; a trace without them is left byte for byte as it was.

Traces are real torch.profiler (CPU) exports; the garbage is put in by hand, since which bytes
torch reads from freed memory cannot be arranged."""

from __future__ import annotations

import gzip
import logging
import os
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from profiling.analysis.chunks import iter_chunks
from profiling.analysis.events import sniff
from profiling.backends import chrome_names, torch_profiler
from profiling.backends.chrome_names import repair_names
from profiling.backends.torch_profiler import TorchProfilerBackend
from profiling.config import ProfileOptions

GOOD = b'"name": "aten::tanh",'
GARBAGE = {
    "an unescaped quote (seen in CI)": b'"name": "torch/profiler/_cupti_monitor.py(0): "",',
    "a control byte": b'"name": "mod.py(0): a\x07b",',
    "invalid UTF-8": b'"name": "mod.py(0): \xff\xfe",',
    "a stray backslash": b'"name": "mod.py(0): a\\qb",',
}


def _events(path: Path) -> list:
    return [e for chunk in iter_chunks(path, sniff(path)) for e in chunk]


def _names(path: Path) -> list[str]:
    return [e.name for e in _events(path)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> bytes:
    """A real CPU trace, with stacks, holding one `aten::tanh` event to spoil."""
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    x = torch.ones(8, 8)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(3):
            with record_function("work"):
                x = x @ x
        x = torch.tanh(x)
    prof.export_chrome_trace(str(path))
    data = path.read_bytes()
    assert data.count(GOOD) == 1
    return data


@pytest.mark.parametrize("garbage", GARBAGE.values(), ids=GARBAGE.keys())
def test_a_garbage_name_is_escaped_and_the_trace_reads_again(exported, tmp_path, garbage):
    path = tmp_path / "trace.json"
    path.write_bytes(exported.replace(GOOD, garbage))
    with pytest.raises(ValueError):
        _events(path)  # what the verifier and the merge saw before the repair

    assert repair_names(path) == 1
    names = _names(path)
    assert "aten::tanh" not in names and names.count("work") == 3
    assert len(names) == len(_names(_write(tmp_path / "good.json", exported))), "no event was lost"
    assert garbage[len(b'"name": "') : -len(b'",')].decode("utf-8", "replace") in names


def test_a_trace_without_garbage_is_left_as_it_was(exported, tmp_path):
    path = _write(tmp_path / "trace.json", exported)
    before = path.stat()
    assert repair_names(path) == 0
    assert path.read_bytes() == exported
    assert path.stat().st_mtime_ns == before.st_mtime_ns and path.stat().st_ino == before.st_ino


KINETO_INSTANTS = (
    b'  {\n    "name": "Iteration Start: PyTorch Profiler", "ph": "i", "s": "g",\n'
    b'    "pid": "Traces", "tid": "Trace PyTorch Profiler", "ts": 5549736077208.981\n  },\n'
    b'  {\n    "name": "Record Window End", "ph": "i", "s": "g",\n'
    b'    "pid": "", "tid": "", "ts": 5549736267226.913\n  },\n'
)
"""Kineto's instant events, each with more fields on its name line, as a CUDA trace holds them
(seen on an H200): valid JSON, not garbage."""


def test_kineto_instant_events_with_fields_on_the_name_line_are_left_as_they_were(exported, tmp_path):
    head = b'"traceEvents": [\n'
    assert exported.count(head) == 1
    data = exported.replace(head, head + KINETO_INSTANTS)
    path = _write(tmp_path / "trace.json", data)
    assert repair_names(path) == 0
    assert path.read_bytes() == data

    def instants(p: Path) -> list[str]:
        return [e.ph for e in _events(p) if e.name in ("Iteration Start: PyTorch Profiler", "Record Window End")]

    assert instants(path) == [*instants(_write(tmp_path / "good.json", exported)), "i", "i"]
    # A garbage name is still one, with fields after it on its line.
    spoiled_instants = KINETO_INSTANTS.replace(b'"Record Window End"', b'"Record "Window End"')
    spoiled = _write(tmp_path / "spoiled.json", exported.replace(head, head + spoiled_instants))
    assert repair_names(spoiled) == 1


def test_the_repair_changes_nothing_else_whatever_the_block_size(exported, tmp_path, monkeypatch):
    """Blocks end at newlines: a line split over two blocks would be missed or doubled."""
    spoiled = exported.replace(GOOD, GARBAGE["an unescaped quote (seen in CI)"])
    for block in (97, 4096, 1 << 20):
        monkeypatch.setattr(chrome_names, "_BLOCK", block)
        path = _write(tmp_path / f"trace-{block}.json", spoiled)
        assert repair_names(path) == 1
        assert path.read_bytes() == spoiled.replace(b'(0): "",', b'(0): \\"",'), block
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".names"], "no temporary file is left"


@pytest.fixture
def torch_writes_garbage(monkeypatch):
    """torch.profiler's export, with the first `work` event's name spoiled as CI saw one."""
    real = profile.export_chrome_trace

    def export(self, path):
        real(self, path)
        data = Path(path).read_bytes()
        Path(path).write_bytes(data.replace(b'"name": "work",', GARBAGE["an unescaped quote (seen in CI)"], 1))

    monkeypatch.setattr(profile, "export_chrome_trace", export)


@pytest.mark.parametrize("in_child", [True, False])
def test_the_backend_export_repairs_what_torch_wrote(tmp_path, monkeypatch, caplog, torch_writes_garbage, in_child):
    """Through the torch backend's export, in its forked child and in the process: the written
    trace reads, and a warning says how many names were escaped."""
    if not in_child:
        monkeypatch.setattr(torch_profiler, "run_forked", _refuse)
    backend = TorchProfilerBackend(ProfileOptions(tool="torch", activities=["cpu"], with_stack=True))
    backend.start()
    x = torch.ones(8, 8)
    for _ in range(3):
        with record_function("work"):
            x = torch.tanh(x @ x)
    with caplog.at_level(logging.WARNING, logger=torch_profiler.__name__):
        (path,) = backend.stop().export(tmp_path / "entry")
    names = _names(path)
    assert names.count("work") == 2 and "aten::mm" in names
    assert "1 event names torch.profiler wrote as invalid JSON" in caplog.text


def test_without_the_repair_the_backend_writes_an_unreadable_trace(tmp_path, monkeypatch, torch_writes_garbage):
    """The test above fails without the repair: the trace torch wrote does not read."""
    monkeypatch.setattr(torch_profiler, "repair_names", lambda path: 0)
    monkeypatch.setattr(torch_profiler, "run_forked", _refuse)
    backend = TorchProfilerBackend(ProfileOptions(tool="torch", activities=["cpu"]))
    backend.start()
    with record_function("work"):
        torch.ones(4) * 2
    (path,) = backend.stop().export(tmp_path / "entry")
    with pytest.raises(ValueError):
        _events(path)
    with gzip.open(path) as f:
        assert f.read().count(b'(0): "",') == 1


def _refuse(work, timeout_s):
    raise torch_profiler.ForkUnavailable("this test exports in the process")


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    os.utime(path, ns=(1, 1))
    return path
