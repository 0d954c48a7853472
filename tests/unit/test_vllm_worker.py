"""The worker side of vLLM profiling (serve_app/engines/vllm_worker.py) and the replica's view of
it (`WorkerTrace`, `VllmCudaProfiler`), without vLLM: a stand-in `execute_model` takes the place of
vLLM's worker method (the real one runs in tests/integration/test_vllm_engine.py)."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from profiling.config import ProfileOptions
from profiling.session import SessionSpec
from serve_app.engines import vllm_engine
from serve_app.engines.vllm_engine import VllmCudaProfiler, WorkerTrace
from serve_app.engines.vllm_worker import WorkerExport, WorkerProfiler, WorkerStop, export_record

MARKER = re.compile(r"^forward_step#(\d+) step=(\d+) weight_version=(\d+)$")


def iteration(tokens: int = 4) -> SimpleNamespace:
    """What the wrapper reads of vLLM's SchedulerOutput."""
    return SimpleNamespace(total_num_scheduled_tokens=tokens)


def marked_worker(version: int = 0) -> tuple[WorkerProfiler, list]:
    """A worker profiler around a stand-in execute_model; the list holds what reached it."""
    profiler = WorkerProfiler(rank=0, version=version)
    ran: list = []

    def execute_model(scheduler_output: SimpleNamespace) -> str:
        ran.append(scheduler_output)
        return "output"

    return profiler, [profiler.wrap(execute_model), ran]


def markers(path: Path) -> list[tuple[int, int, int]]:
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    found = [(e["ts"], MARKER.match(e["name"])) for e in events if e.get("cat") == "user_annotation"]
    return [(int(m[1]), int(m[2]), int(m[3])) for _, m in sorted(found, key=lambda x: x[0]) if m]


def wait_record(trace_dir: Path, prefix: str) -> WorkerExport:
    path = export_record(trace_dir, prefix, 0)
    for _ in range(200):
        if path.exists():
            return WorkerExport.model_validate_json(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"no export record {path}")


def test_each_iteration_is_one_range_with_step_and_version_and_all_passes_are_counted(tmp_path):
    profiler, (execute, ran) = marked_worker(version=3)
    assert execute(iteration()) == "output"  # before any window: counted, not recorded
    clock = profiler.start(4, ProfileOptions(max_forward_steps=None), "step4", tmp_path)
    assert clock is not None and clock.marker.startswith("clock_sync start")
    for _ in range(3):
        execute(iteration())
    execute(iteration(tokens=0))  # no token scheduled: no forward pass, neither marked nor counted
    stopped = profiler.stop()
    assert stopped == WorkerStop(forward_steps=3, auto_stopped=None, weight_versions=[3])
    execute(iteration())
    assert len(ran) == 6, "every call reaches vLLM's execute_model"
    assert profiler.passes == {3: 5} and profiler.recorded == {3: 3}
    record = wait_record(tmp_path, "step4")
    assert record.error is None and record.forward_steps == 3 and record.trace_bytes
    assert markers(tmp_path / record.file) == [(0, 4, 3), (1, 4, 3), (2, 4, 3)]


def test_max_forward_steps_ends_the_window_in_the_worker(tmp_path):
    profiler, (execute, _) = marked_worker()
    profiler.start(1, ProfileOptions(max_forward_steps=2), "step1", tmp_path)
    for _ in range(5):
        execute(iteration())
    assert profiler.clock("stop") is not None, "the sample taken when the window ended itself"
    assert profiler.stop() == WorkerStop(forward_steps=2, auto_stopped="max_forward_steps", weight_versions=[0])
    assert profiler.recorded == {0: 2} and profiler.passes == {0: 5}
    assert [i for i, _, _ in markers(tmp_path / wait_record(tmp_path, "step1").file)] == [0, 1]


def test_a_weight_load_inside_a_window_is_marked_and_later_passes_carry_the_new_version(tmp_path):
    profiler, (execute, _) = marked_worker()
    profiler.start(1, ProfileOptions(), "step1", tmp_path)
    execute(iteration())
    loaded = threading.Event()
    profiler.load_weights(1, loaded.set)
    execute(iteration())
    assert loaded.is_set() and profiler.stop().weight_versions == [0, 1]
    record = wait_record(tmp_path, "step1")
    names = [e["name"] for e in json.loads(gzip.decompress((tmp_path / record.file).read_bytes()))["traceEvents"]]
    assert "weight_update version=1" in names
    assert markers(tmp_path / record.file) == [(0, 1, 0), (1, 1, 1)]


def test_a_second_start_and_a_stop_without_a_window_are_refused(tmp_path):
    profiler, _ = marked_worker()
    with pytest.raises(RuntimeError, match="not recording"):
        profiler.stop()
    profiler.start(1, ProfileOptions(), "step1", tmp_path)
    with pytest.raises(RuntimeError, match="already recording step 1"):
        profiler.start(2, ProfileOptions(), "step2", tmp_path)
    profiler.stop()


def test_the_replica_moves_each_ranks_trace_once_its_record_is_written(tmp_path):
    engine_dir, out = tmp_path / "engine", tmp_path / "step_1" / "rollout" / "r0"
    engine_dir.mkdir()
    stopped = WorkerStop(forward_steps=2, weight_versions=[0])
    trace = WorkerTrace(engine_dir, "step1", ranks=2, stopped=stopped)
    assert trace.forward_steps == 2 and trace.weight_versions == [0]

    def write_later() -> None:
        time.sleep(0.2)
        for rank in (0, 1):
            (engine_dir / f"r{rank}.json.gz").write_bytes(b"trace")
            export_record(engine_dir, "step1", rank).write_text(
                WorkerExport(rank=rank, file=f"r{rank}.json.gz", forward_steps=2, trace_bytes=10).model_dump_json()
            )

    threading.Thread(target=write_later).start()
    paths = trace.export(out)  # waits for both records
    assert [p.name for p in paths] == ["rank0.trace.pt.trace.json.gz", "rank1.trace.pt.trace.json.gz"]
    assert all(p.read_bytes() == b"trace" for p in paths) and not any(engine_dir.iterdir())
    assert trace.trace_bytes == 10


def test_a_failed_worker_export_or_none_at_all_fails_the_replicas_export(tmp_path, monkeypatch):
    export_record(tmp_path, "step1", 0).write_text(
        WorkerExport(rank=0, forward_steps=1, error="the vLLM worker's trace export failed: disk full").model_dump_json()
    )
    with pytest.raises(RuntimeError, match="disk full"):
        WorkerTrace(tmp_path, "step1", 1, WorkerStop(forward_steps=1, weight_versions=[0])).export(tmp_path / "out")
    monkeypatch.setattr(vllm_engine, "EXPORT_WAIT_S", 0.1)
    with pytest.raises(TimeoutError, match="worker 0 wrote no trace"):
        WorkerTrace(tmp_path, "step2", 1, WorkerStop(forward_steps=1, weight_versions=[0])).export(tmp_path / "out")


def test_nsys_brackets_the_window_with_vllms_cuda_profiler_and_leaves_the_note(tmp_path):
    calls: list[tuple] = []

    class FakeLLM:  # a FAKE AsyncLLM: only the two profiler calls
        async def start_profile(self, profile_prefix: str) -> None:
            calls.append(("start", profile_prefix))

        async def stop_profile(self) -> None:
            calls.append(("stop",))

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        spec = SessionSpec(step=3, steps=[3], options=ProfileOptions(tool="nsys"))
        profiler = VllmCudaProfiler(spec, llm=FakeLLM(), trace_dir=tmp_path, loop=loop)  # type: ignore[arg-type]
        profiler.start()
        [note] = profiler.stop().export(tmp_path / "out")
    finally:
        loop.call_soon_threadsafe(loop.stop)
    assert calls == [("start", "step3"), ("stop",)]
    assert json.loads(note.read_text())["tool"] == "nsys"
