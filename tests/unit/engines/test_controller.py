"""The control policy every engine shares (serve_app/engines/controller.py), against
FakeProfilingEngine: the real controller around a FAKE adapter whose FAKE profiler writes files
the way vLLM does, and which records the order of the calls it gets. The real engines are tested
in tests/integration."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

import pytest
from support.engines import replica_sessions
from support.traces import trace_events

from profiling.session import SessionConflict, SessionSpec
from profiling.store import TraceStore
from serve_app.config import AppArgs
from serve_app.engines.adapter import EngineAdapter
from serve_app.engines.controller import EngineController
from serve_app.engines.engine_profiler import EngineProfiler, recording_prefix
from serve_app.engines.generation import GenerateDelta, GenerateRequest, SamplingSpec
from serve_app.engines.options import Capability
from serve_app.engines.registry import ENGINE_OPTIONS
from serve_app.engines.vllm.options import VllmOptions
from serve_app.engines.weight_control import AdoptRefused

FLUSH_S = 0.3


class FakeProfiler(EngineProfiler):
    """A fake engine-owned profiler: it 'flushes' for FLUSH_S at stop and writes a vLLM-named trace."""

    step_range = "execute_context_"

    def __init__(self, spec: SessionSpec, engine: FakeProfilingEngine):
        assert engine.loop is not None
        super().__init__(spec, trace_dir=engine.trace_dir, loop=engine.loop)
        self._engine = engine

    async def _engine_start(self) -> None:
        if self._engine.fail_start:
            raise RuntimeError("the fake profiler refused to start")
        self._engine.log("start")

    async def _engine_stop(self) -> None:
        await asyncio.sleep(FLUSH_S)
        trace = {
            "traceEvents": [{"ph": "X", "cat": "user_annotation", "name": "execute_context_0(1)", "ts": 1, "dur": 1}]
        }
        (self.trace_dir / f"{self.prefix}_rank0.123.pt.trace.json").write_text(json.dumps(trace, indent=1))
        (self.trace_dir / f"{self.prefix}_rank0.profiler_out.txt").write_text("table")
        (self.trace_dir / f"{self.prefix}0_rank0.999.pt.trace.json").write_text("{}")  # another step's
        self._engine.log("stop-flushed")


class FakeProfilingOptions(VllmOptions):
    """The FAKE engine's options: vLLM's option rules, and the capabilities its adapter implements."""

    engine = "fake-profiling"
    implementation = f"{__name__}:FakeProfilingAdapter"
    capabilities = frozenset({Capability.GENERATE, Capability.PROFILE, Capability.PAUSE, Capability.LOAD_PATH})


@pytest.fixture(autouse=True)
def fake_engines_registered(monkeypatch):
    for options in (FakeProfilingOptions, FakeVersionedOptions):
        monkeypatch.setitem(ENGINE_OPTIONS, options.engine, options)


class FakeProfilingAdapter(EngineAdapter):
    """The FAKE adapter: it logs each call into its controller's `calls`."""

    host: FakeProfilingEngine

    def open(self, args: AppArgs, model_dir: Path) -> None:
        self.host.trace_dir.mkdir(parents=True, exist_ok=True)

    def stream(self, request: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        raise NotImplementedError

    def profiler(self, spec: SessionSpec) -> FakeProfiler:
        return FakeProfiler(spec, self.host)

    async def pause(self) -> None:
        self.host.log("pause")

    async def resume(self) -> None:
        self.host.log("resume")

    async def read_weights(self, path: Path) -> Path:
        return path

    async def load_weights(self, weights: Path, version: int) -> None:
        await asyncio.sleep(self.host.load_s)
        self.host.loaded.append((weights, version))
        self.host.log("load")

    def healthy(self) -> bool:
        return True

    async def close(self) -> None:
        pass


class FakeProfilingEngine(EngineController):
    """The real controller around the fake adapter; vLLM's option rules apply to it."""

    options: type[FakeProfilingOptions] = FakeProfilingOptions
    adapter_class: type[FakeProfilingAdapter] = FakeProfilingAdapter

    def __init__(self, store: TraceStore, exporter, trace_dir: Path, model_dir: Path, hold_timeout_s: float = 5.0):
        self.calls: list[tuple[str, float]] = []
        self.loaded: list[tuple[Path, int]] = []
        self.fail_start = False
        self.load_s = 0.0
        """How long a weight load takes (a large checkpoint)."""
        super().__init__(
            self.adapter_class,
            args=AppArgs(engine=self.options.engine, hold_timeout_s=hold_timeout_s),
            model_dir=model_dir,
            session_factory=replica_sessions(store, exporter, "fake0"),
            trace_dir=trace_dir,
        )

    @property
    def checkpoint(self) -> str:
        """A checkpoint of the served model, which the controller's header check accepts."""
        return str(self.model_dir / "model.safetensors")

    def log(self, what: str) -> None:
        self.calls.append((what, time.monotonic()))

    def names(self) -> list[str]:
        return [c for c, _ in self.calls]


@pytest.fixture
def engine(store, exporter, tmp_path, model_dir):
    return FakeProfilingEngine(store, exporter, tmp_path / "engine" / "fake0", model_dir)


async def test_stop_with_pause_answers_before_the_engine_flush_and_update_waits_for_it(engine, store, spec):
    assert await engine.start_profile(spec(3))
    t0 = time.monotonic()
    outcome = await engine.stop_profile(3, pause=True)
    answered = time.monotonic() - t0
    assert outcome.stopped and outcome.step == 3
    assert answered < FLUSH_S / 2, f"the stop waited for the flush ({answered:.2f} s)"
    await engine.update_weights(1, engine.checkpoint, resume=False)
    assert engine.names() == ["start", "pause", "stop-flushed", "load"]
    assert engine.status().paused and engine.weight_version == 1
    assert await engine.start_profile(spec(4))
    assert engine.names()[-2:] == ["start", "resume"] and not engine.status().paused
    await engine.stop_profile(4, pause=False)
    await engine.shutdown()


async def test_stop_without_pause_answers_after_the_flush(engine, spec):
    await engine.start_profile(spec(2))
    t0 = time.monotonic()
    await engine.stop_profile(2, pause=False)
    assert time.monotonic() - t0 >= FLUSH_S
    assert "pause" not in engine.names()
    await engine.shutdown()


async def test_export_moves_only_this_recordings_files_gzipped_and_counts_steps(engine, store, spec):
    await engine.start_profile(spec(1, max_forward_steps=5))
    await engine.stop_profile(1, pause=False)
    entry = await engine.wait_exported(1, 10)
    assert entry is not None and entry.status == "ok", entry
    assert sorted(entry.files) == [
        "rollout/fake0/step1_rank0.123.pt.trace.json.gz",
        "rollout/fake0/step1_rank0.profiler_out.txt",
    ]
    assert trace_events(store.step_dir(1) / entry.files[0])[0]["name"].startswith("execute_context_")
    assert entry.forward_steps == 1
    assert [p.name for p in engine.trace_dir.iterdir()] == ["step10_rank0.999.pt.trace.json"]
    await engine.shutdown()


async def test_start_of_another_step_conflicts_and_a_failed_start_leaves_it_idle(engine, spec):
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


async def test_a_load_longer_than_the_hold_timeout_keeps_the_hold_until_after_it(store, exporter, tmp_path, model_dir):
    """stop(pause) -> update(resume=false) whose load outlasts hold_timeout_s: the hold covers the
    load and then a full hold_timeout_s more, for the start that follows; an expiry that fell due
    during the load (it waited for the control lock) does not end it."""
    engine = FakeProfilingEngine(store, exporter, tmp_path / "e", model_dir, hold_timeout_s=0.4)
    engine.load_s = 1.0
    await engine.stop_profile(None, pause=True)
    await engine.update_weights(1, engine.checkpoint, resume=False)
    done = time.monotonic()
    assert engine.weight_version == 1 and engine.status().paused, "the hold expired during the load"
    await asyncio.sleep(0.2)
    assert engine.status().paused, "the deadline did not restart at the end of the load"
    await asyncio.sleep(0.5)
    assert not engine.status().paused, "the hold outlived hold_timeout_s after the load"
    resumed = next(t for c, t in engine.calls if c == "resume")
    assert resumed - done == pytest.approx(0.4, abs=0.15)
    assert engine.names() == ["pause", "load", "resume"]
    await engine.shutdown()


async def test_a_repeated_update_of_the_served_version_does_not_stretch_the_hold(store, exporter, tmp_path, model_dir):
    engine = FakeProfilingEngine(store, exporter, tmp_path / "e", model_dir, hold_timeout_s=0.4)
    await engine.stop_profile(None, pause=True)
    for _ in range(3):  # nothing to load: the hold keeps the deadline it began with
        await engine.update_weights(0, engine.checkpoint, resume=False)
        await asyncio.sleep(0.15)
    assert not engine.status().paused
    await engine.shutdown()


async def test_max_duration_watchdog_stops_the_engine_profiler(engine, spec):
    await engine.start_profile(spec(5, max_duration_s=0.1))
    await asyncio.sleep(1.5)
    assert "stop-flushed" in engine.names()
    assert engine.status().state in ("capped", "idle", "exporting")
    outcome = await engine.stop_profile(5, pause=False)
    assert outcome.auto_stopped == "max_duration_s"
    await engine.shutdown()


def test_recording_prefix_names_step_and_tag(spec):
    assert recording_prefix(spec(7)) == "step7"
    tagged = spec(7, tag="run-a.1")
    assert recording_prefix(tagged) == "step7-run-a.1"


async def test_an_update_that_keeps_the_hold_never_reopens_admission_in_between(engine, store):
    """update(resume=false) with no hold before it (the sync entering a window without a stop):
    the engine is paused for the load and stays paused until the start; reopening admission
    between the load and the hold would let engine steps run unprofiled on the new weights."""
    await engine.update_weights(1, engine.checkpoint, resume=False)
    assert engine.names() == ["pause", "load"]
    assert engine.status().paused and engine.weight_version == 1
    await engine.update_weights(2, engine.checkpoint, resume=True)
    assert engine.names() == ["pause", "load", "load", "resume"] and not engine.status().paused
    await engine.update_weights(3, engine.checkpoint, resume=True)
    assert engine.names()[-3:] == ["pause", "load", "resume"]
    await engine.shutdown()


async def test_the_window_s_requests_and_the_sync_s_hold_reach_the_step_s_entry(engine, store, spec):
    async def answer(request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        await asyncio.sleep(0.05)
        yield GenerateDelta(token_ids=[7] * 3, weight_version=0, finish_reason="length")

    async def drain(request: GenerateRequest) -> None:
        async for _ in engine.generate(request):
            pass

    engine.adapter.stream = answer  # type: ignore[method-assign]
    assert await engine.start_profile(spec(3))
    request = GenerateRequest(prompt_token_ids=[1, 2], sampling=SamplingSpec(max_tokens=3))
    await asyncio.gather(*(drain(request) for _ in range(4)))
    await engine.stop_profile(3, pause=True)
    await engine.update_weights(1, engine.checkpoint, resume=False)
    await asyncio.sleep(0.2)  # held for the sync
    assert await engine.start_profile(spec(4))
    await engine.stop_profile(4, pause=False)
    entry = next(e for e in store.read_entries(3) if e.replica_id == "fake0")
    assert entry.requests is not None
    assert (entry.requests.requests, entry.requests.prompt_tokens, entry.requests.output_tokens) == (4, 8, 12)
    assert entry.requests.weight_versions == {0: 4} and entry.requests.generating_s > 0.04
    assert entry.sync_held_s is not None and 0.2 <= entry.sync_held_s < 5
    later = next(e for e in store.read_entries(4) if e.replica_id == "fake0")
    assert later.sync_held_s is None  # its stop did not pause
    await engine.shutdown()


async def test_a_hold_counts_as_held_time_and_its_release_as_generating_again(engine, store, spec):
    async def answer(request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        await asyncio.sleep(0.3)
        yield GenerateDelta(token_ids=[7], weight_version=engine.weight_version, finish_reason="length")

    async def drain(request: GenerateRequest) -> None:
        async for _ in engine.generate(request):
            pass

    engine.adapter.stream = answer  # type: ignore[method-assign]
    request = GenerateRequest(prompt_token_ids=[1, 2], sampling=SamplingSpec(max_tokens=1))
    assert await engine.start_profile(spec(3))
    await engine.update_weights(0, None, resume=False)  # a hold inside the window, no load
    await asyncio.sleep(0.3)
    await engine.update_weights(0, None, resume=True)
    await engine.stop_profile(3, pause=True)
    await engine.update_weights(1, engine.checkpoint, resume=False)
    assert await engine.start_profile(spec(4))  # ends the sync's hold
    await drain(request)
    await engine.stop_profile(4, pause=False)
    await engine.wait_exported(4, 10)
    held = next(e for e in store.read_entries(3) if e.replica_id == "fake0").requests
    assert held is not None and held.held_s >= 0.25
    after = next(e for e in store.read_entries(4) if e.replica_id == "fake0").requests
    assert after is not None and after.generating_s >= 0.25 and after.held_s < 0.1
    await engine.shutdown()


class FakeVersionedOptions(FakeProfilingOptions):
    engine = "fake-versioned"
    implementation = f"{__name__}:FakeVersionedAdapter"
    capabilities = FakeProfilingOptions.capabilities | {Capability.ADOPT_EXTERNAL, Capability.RECEIVE_COLLECTIVE}


class FakeVersionedAdapter(FakeProfilingAdapter):
    """A FAKE adapter that reports a weight version of its own (as vLLM does) and stages a fake
    collective transfer: its controller's `reported` is what the trainer's own transfer set."""

    host: FakeVersionedEngine

    async def reported_version(self) -> int | None:
        return self.host.reported

    async def adopted(self, version: int) -> None:
        pass

    async def receive_weights(self, transfer, first_rank, world_size, timeout_s) -> None:
        self.host.staged = Path(self.host.checkpoint)

    async def staged_weights(self) -> Path:
        assert self.host.staged is not None
        return self.host.staged

    async def drop_staged(self) -> None:
        self.host.staged = None

    async def weights_snapshot(self) -> dict:
        return {}


class FakeVersionedEngine(FakeProfilingEngine):
    options = FakeVersionedOptions
    adapter_class = FakeVersionedAdapter
    reported: int | None = None
    staged: Path | None = None


@pytest.fixture
def versioned(store, exporter, tmp_path, model_dir):
    return FakeVersionedEngine(store, exporter, tmp_path / "engine" / "fake0", model_dir)


async def test_adopt_does_a_loads_bookkeeping_without_loading_and_keeps_the_hold(versioned):
    versioned.reported = 1
    await versioned.adopt_weights(1, resume=False)
    assert versioned.weight_version == 1 and versioned.loaded == [] and versioned.status().paused
    assert "load" not in versioned.names()
    versioned.reported = 2
    await versioned.adopt_weights(2, resume=True)
    assert versioned.weight_version == 2 and not versioned.status().paused
    await versioned.shutdown()


async def test_adopt_of_a_version_the_engine_does_not_report_names_it(versioned):
    versioned.reported = 3
    with pytest.raises(ValueError, match="the engine reports weight version 3, not 4"):
        await versioned.adopt_weights(4, resume=True)
    assert versioned.weight_version == 0
    await versioned.shutdown()


async def test_adopt_on_an_engine_without_a_version_of_its_own_is_refused(engine):
    with pytest.raises(AdoptRefused, match=r"keeps no weight version of its own.*source path or collective"):
        await engine.adopt_weights(1, resume=True)
    assert engine.weight_version == 0
    await engine.shutdown()


async def test_staged_weights_load_like_a_path_and_are_dropped_after(versioned):
    await versioned.receive_weights(None, 1, 2, 5.0)  # type: ignore[arg-type]  # the fake reads no transfer
    await versioned.load_staged(1, resume=True)
    assert versioned.loaded == [(Path(versioned.checkpoint), 1)] and versioned.staged is None
    assert versioned.names() == ["pause", "load", "resume"]
    await versioned.receive_weights(None, 1, 2, 5.0)  # type: ignore[arg-type]
    await versioned.drop_staged()
    assert versioned.staged is None and versioned.weight_version == 1
    await versioned.shutdown()
