"""The control flow shared by engines with their own profiler (serve_app/engines/external.py),
against FakeProfilingEngine: a fake engine that writes files the way vLLM does and records
the order of the calls it gets. The real engines are tested in tests/integration."""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from profiling.config import ProfileOptions
from profiling.manifest import ManifestEntry
from profiling.session import ProfileSession, SessionConflict, SessionSpec
from profiling.store import TraceStore
from serve_app.engines.base import GenerateRequest, GenerateResult
from serve_app.engines.external import ExternalEngine, recording_prefix

FLUSH_S = 0.3


class FakeProfilingEngine(ExternalEngine):
    """A fake engine: its profiler 'flushes' for FLUSH_S at stop and writes a vLLM-named trace."""

    model_name = "fake"
    step_range = '"name": "execute_context_'

    def __init__(
        self, store: TraceStore, exporter: ThreadPoolExecutor, trace_dir: Path, model_dir: Path, hold_timeout_s: float = 5.0
    ):
        super().__init__(
            session_factory=lambda backend_factory: ProfileSession(
                store=store,
                entry_identity=ManifestEntry(role="rollout", replica_id="fake0"),
                exporter=exporter,
                backend_factory=backend_factory,
            ),
            trace_dir=trace_dir,
            hold_timeout_s=hold_timeout_s,
            model_dir=model_dir,
        )
        self.calls: list[tuple[str, float]] = []
        self.prefix: str | None = None
        self.loaded: list[tuple[Path, int]] = []
        self.fail_start = False

    def _log(self, what: str) -> None:
        self.calls.append((what, time.monotonic()))

    async def _engine_start_profile(self, prefix: str, options: ProfileOptions) -> None:
        if self.fail_start:
            raise RuntimeError("the fake profiler refused to start")
        self.prefix = prefix
        self._log("start")

    async def _engine_stop_profile(self) -> None:
        await asyncio.sleep(FLUSH_S)
        trace = {"traceEvents": [{"ph": "X", "cat": "user_annotation", "name": "execute_context_0(1)", "ts": 1, "dur": 1}]}
        (self.trace_dir / f"{self.prefix}_rank0.123.pt.trace.json").write_text(json.dumps(trace, indent=1))
        (self.trace_dir / f"{self.prefix}_rank0.profiler_out.txt").write_text("table")
        (self.trace_dir / f"{self.prefix}0_rank0.999.pt.trace.json").write_text("{}")  # another step's
        self._log("stop-flushed")

    async def _engine_pause(self) -> None:
        self._log("pause")

    async def _engine_resume(self) -> None:
        self._log("resume")

    async def _engine_load_weights(self, path: Path, version: int) -> None:
        self.loaded.append((path, version))
        self._log("load")

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        raise NotImplementedError

    def healthy(self) -> bool:
        return True

    async def shutdown(self) -> None:
        await self._close_control()

    def names(self) -> list[str]:
        return [c for c, _ in self.calls]


@pytest.fixture
def engine(store, exporter, tmp_path, model_dir):
    return FakeProfilingEngine(store, exporter, tmp_path / "engine" / "fake0", model_dir)


def spec(step: int, **options) -> SessionSpec:
    return SessionSpec(step=step, steps=[step], options=ProfileOptions(**options))


async def test_stop_with_pause_answers_before_the_engine_flush_and_update_waits_for_it(engine, store):
    assert await engine.start_profile(spec(3))
    t0 = time.monotonic()
    outcome = await engine.stop_profile(3, pause=True)
    answered = time.monotonic() - t0
    assert outcome.stopped and outcome.step == 3
    assert answered < FLUSH_S / 2, f"the stop waited for the flush ({answered:.2f} s)"
    await engine.update_weights(1, str(store.root), resume=False)
    assert engine.names() == ["start", "pause", "stop-flushed", "load"]
    assert engine.status().paused and engine.weight_version == 1
    assert await engine.start_profile(spec(4))
    assert engine.names()[-2:] == ["start", "resume"] and not engine.status().paused
    await engine.stop_profile(4, pause=False)
    await engine.shutdown()


async def test_stop_without_pause_answers_after_the_flush(engine):
    await engine.start_profile(spec(2))
    t0 = time.monotonic()
    await engine.stop_profile(2, pause=False)
    assert time.monotonic() - t0 >= FLUSH_S
    assert "pause" not in engine.names()
    await engine.shutdown()


async def test_export_moves_only_this_recordings_files_gzipped_and_counts_steps(engine, store):
    await engine.start_profile(spec(1, max_forward_steps=5))
    await engine.stop_profile(1, pause=False)
    entry = await engine.wait_exported(1, 10)
    assert entry is not None and entry.status == "ok", entry
    assert sorted(entry.files) == [
        "rollout/fake0/step1_rank0.123.pt.trace.json.gz",
        "rollout/fake0/step1_rank0.profiler_out.txt",
    ]
    with gzip.open(store.step_dir(1) / entry.files[0], "rt") as f:
        assert json.load(f)["traceEvents"][0]["name"].startswith("execute_context_")
    assert entry.forward_steps == 1
    assert [p.name for p in engine.trace_dir.iterdir()] == ["step10_rank0.999.pt.trace.json"]
    await engine.shutdown()


async def test_start_of_another_step_conflicts_and_a_failed_start_leaves_it_idle(engine):
    await engine.start_profile(spec(1))
    with pytest.raises(SessionConflict):
        await engine.start_profile(spec(2))
    assert not await engine.start_profile(spec(1))  # idempotent
    await engine.stop_profile(1, pause=False)
    engine.fail_start = True
    with pytest.raises(RuntimeError, match="refused"):
        await engine.start_profile(spec(2))
    assert engine.status().state in ("idle", "exporting") and engine.status().active_step is None
    await engine.shutdown()


async def test_hold_without_update_expires(store, exporter, tmp_path, model_dir):
    engine = FakeProfilingEngine(store, exporter, tmp_path / "e", model_dir, hold_timeout_s=0.2)
    await engine.stop_profile(None, pause=True)
    assert engine.status().paused
    await asyncio.sleep(0.5)
    assert not engine.status().paused and engine.names() == ["pause", "resume"]
    await engine.shutdown()


async def test_max_duration_watchdog_stops_the_engine_profiler(engine):
    await engine.start_profile(spec(5, max_duration_s=0.1))
    await asyncio.sleep(1.5)
    assert "stop-flushed" in engine.names()
    assert engine.status().state in ("capped", "idle", "exporting")
    outcome = await engine.stop_profile(5, pause=False)
    assert outcome.auto_stopped == "max_duration_s"
    await engine.shutdown()


def test_recording_prefix_names_step_and_tag():
    assert recording_prefix(spec(7)) == "step7"
    tagged = SessionSpec(step=7, steps=[7], options=ProfileOptions(), tag="run-a.1")
    assert recording_prefix(tagged) == "step7-run-a.1"


async def test_requests_report_the_versions_the_engine_ran_while_they_were_in_flight(engine, store):
    with engine.versions_seen() as across:  # in flight across the update
        await engine.stop_profile(None, pause=True)
        with engine.versions_seen() as held:  # sent while paused
            await engine.update_weights(1, str(store.root), resume=True)
    with engine.versions_seen() as after:
        pass
    assert (across, held, after) == ({0, 1}, {1}, {1})
    await engine.shutdown()
