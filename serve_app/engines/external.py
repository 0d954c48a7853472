"""Engines that run their own scheduler and their own profiler (vLLM, SGLang).

Such an engine writes its traces into a directory of its own, named by a prefix we give at
start. The shared part lives here:

* `EngineTraceBackend` plugs the engine's profiler into `ProfileSession` (the same state machine,
  guards, caps and manifest entries as the embedded engine): its start/stop call the engine's
  async profile hooks on the replica's event loop, and its export moves the files the engine
  wrote for that recording into `step_<k>/rollout/<replica_id>/`, compressing them there, off
  the critical path.
* `ExternalEngine` owns the control flow every such engine shares: session calls on one control
  thread, the admission hold (pause without an update), weight updates between pause and
  resume, the watchdog. Subclasses fill the `_engine_*` hooks.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import os
import re
import shutil
import time
from abc import abstractmethod
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from profiling.backends.base import ProfilerBackend, RecordedTrace
from profiling.config import ProfileOptions
from profiling.session import ProfileSession, SessionSpec, StopOutcome
from serve_app.engines.base import RolloutEngine
from serve_app.engines.tokenizer import HfTokenizerMixin

log = logging.getLogger(__name__)
T = TypeVar("T")

BackendFactory = Callable[[ProfileOptions], ProfilerBackend]
SessionFactory = Callable[[BackendFactory], ProfileSession]

# Longest we wait for the engine to acknowledge a profiler start or stop. vLLM's stop flushes
# the trace inline, which takes minutes on big models with stack capture on.
_ENGINE_CALL_TIMEOUT_S = 900.0
_WATCHDOG_PERIOD_S = 0.5


def recording_prefix(spec: SessionSpec) -> str:
    """The file-name prefix of one recording: the step, and the tag when there is one.
    Both engines accept `[A-Za-z0-9][A-Za-z0-9._-]*`, which the tag's safe-name check ensures."""
    return f"step{spec.step}" + (f"-{spec.tag}" if spec.tag else "")


class EngineTrace(RecordedTrace):
    """The files an engine wrote for one recording, still in the engine's own directory."""

    def __init__(self, files: list[Path], count_forward_steps: Callable[[Path], int] | None = None):
        self._files = files
        self._count = count_forward_steps

    def export(self, out_dir: Path) -> list[Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        for src in self._files:
            if self._count is not None and self.forward_steps is None and _is_json_trace(src):
                self.forward_steps = self._count(src)
            paths.append(_move_compressed(src, out_dir))
        if not paths:
            raise FileNotFoundError("the engine wrote no trace file for this recording")
        return paths


def _is_json_trace(path: Path) -> bool:
    return path.name.endswith((".json", ".json.gz"))


def _move_compressed(src: Path, out_dir: Path) -> Path:
    """Move `src` into `out_dir`; plain JSON traces are gzipped on the way (the engine wrote
    them uncompressed to keep its stop short)."""
    if src.name.endswith(".json"):
        dst = out_dir / f"{src.name}.gz"
        tmp = out_dir / f".{dst.name}.tmp"
        with src.open("rb") as fin, gzip.open(tmp, "wb", compresslevel=3) as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
        tmp.replace(dst)
        src.unlink()
        return dst
    dst = out_dir / src.name
    shutil.move(src, dst)
    return dst


class EngineTraceBackend(ProfilerBackend):
    """`ProfileSession`'s backend for an engine-owned profiler. Runs on the control thread;
    the engine's hooks are coroutines and run on the replica's event loop."""

    def __init__(self, options: ProfileOptions, engine: ExternalEngine):
        super().__init__(options)
        self._engine = engine
        self.prefix: str | None = None

    def _start(self) -> None:
        spec = self._engine.starting_spec
        assert spec is not None, "the session starts a backend only inside start_profile"
        self.prefix = recording_prefix(spec)
        self._engine.call_on_loop(self._engine._engine_start_profile(self.prefix, self.options))

    def _stop(self) -> RecordedTrace:
        assert self.prefix is not None
        self._engine.call_on_loop(self._engine._engine_stop_profile())
        return EngineTrace(self._engine.trace_files(self.prefix), self._engine.count_forward_steps)


class ExternalEngine(HfTokenizerMixin, RolloutEngine):
    """Control flow shared by engines with their own scheduler and profiler.

    Ordering: profiling calls run one at a time on the control thread (the session is not
    thread-safe); `stop(pause)`, `update_weights` and `start` are serialised by `_control`, so an
    update never overlaps the engine's trace flush of the stop before it.
    """

    step_range: str | None = None
    """A line of the engine's Chrome trace that marks one engine step (Kineto writes one field
    per line), e.g. '"name": "run_batch"'; None: the engine's traces do not show steps."""

    def __init__(self, *, session_factory: SessionFactory, trace_dir: Path, hold_timeout_s: float, model_dir: Path):
        self._load_tokenizer(model_dir)
        self.trace_dir = trace_dir
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        self._session = session_factory(lambda options: EngineTraceBackend(options, self))
        self._hold_timeout_s = hold_timeout_s
        self._control_thread = ThreadPoolExecutor(1, thread_name_prefix="profile-control")
        self._control = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._held = False
        self._hold_timer: asyncio.TimerHandle | None = None
        self._watchdog: asyncio.Task | None = None
        self.starting_spec: SessionSpec | None = None
        self.weight_version = 0
        self._engine_paused = False
        # Requests in flight -> the weight versions the engine ran while each was in flight.
        self._in_flight: dict[int, set[int]] = {}

    # -- engine hooks ------------------------------------------------------------------------
    @abstractmethod
    async def _engine_start_profile(self, prefix: str, options: ProfileOptions) -> None:
        """Start the engine's profiler; its files for this recording must start with `prefix`."""

    @abstractmethod
    async def _engine_stop_profile(self) -> None:
        """Stop the engine's profiler; return once its files are written."""

    @abstractmethod
    async def _engine_pause(self) -> None:
        """Stop scheduling engine steps; in-flight requests wait (they are not aborted)."""

    @abstractmethod
    async def _engine_resume(self) -> None: ...

    @abstractmethod
    async def _engine_load_weights(self, path: Path, version: int) -> None:
        """Load `path` (a safetensors file or directory) while paused; reset prefix caches."""

    def count_forward_steps(self, trace: Path) -> int:
        """Engine steps recorded in one of the engine's trace files (0 when unknown): the
        `step_range` annotations, read line by line (traces can be large)."""
        if self.step_range is None:
            return 0
        opener = gzip.open if trace.name.endswith(".gz") else open
        count, annotation = 0, False
        with opener(trace, "rt") as f:
            for line in f:
                if '"cat":' in line:
                    annotation = '"user_annotation"' in line
                elif annotation and self.step_range in line:
                    count += 1
        return count

    @contextlib.contextmanager
    def versions_seen(self) -> Iterator[set[int]]:
        """Around one request: the weight versions the engine ran while it was in flight (the
        engines report no per-token version; a request held across an update ran only with
        the new weights, one in flight across it with both)."""
        seen: set[int] = set() if self._engine_paused else {self.weight_version}
        key = id(seen)
        self._in_flight[key] = seen
        try:
            yield seen
        finally:
            del self._in_flight[key]

    # -- plumbing ----------------------------------------------------------------------------
    def call_on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the replica's event loop from the control thread and wait for it."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(_ENGINE_CALL_TIMEOUT_S)

    async def _on_control_thread(self, fn: Callable[[], T]) -> T:
        self._loop = asyncio.get_running_loop()
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch_deadline())
        return await self._loop.run_in_executor(self._control_thread, fn)

    async def _watch_deadline(self) -> None:
        """`max_duration_s`: the engine's profiler has no time cap of its own."""
        while True:
            await asyncio.sleep(_WATCHDOG_PERIOD_S)
            if self._session.state == "profiling":
                try:
                    await self._on_control_thread(self._session.check_deadline)
                except Exception:  # noqa: BLE001 - a failed cap is logged; stop will retry
                    log.exception("capping the recording at max_duration_s failed")

    def staged_weights(self, path: Path) -> Path:
        """A directory holding exactly the safetensors files of `path`: engines load every
        safetensors file of a directory, and the trainer's weights directory holds several
        versions side by side. Staged next to this replica's trace directory."""
        if path.is_dir():
            return path
        staging = self.trace_dir.with_name(f"{self.trace_dir.name}.weights")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        os.symlink(path.resolve(), staging / "model.safetensors")
        return staging

    def trace_files(self, prefix: str) -> list[Path]:
        """The files the engine wrote for the recording named `prefix`."""
        pattern = re.compile(rf"^{re.escape(prefix)}[_.-]")
        return sorted(p for p in self.trace_dir.iterdir() if p.is_file() and pattern.match(p.name))

    async def _pause_engine(self) -> None:
        await self._engine_pause()
        self._engine_paused = True

    async def _resume_engine(self) -> None:
        await self._engine_resume()
        self._engine_paused = False
        for seen in self._in_flight.values():
            seen.add(self.weight_version)

    async def _hold(self) -> None:
        """Admit no engine step until the next start or resuming update, or the hold timeout."""
        if not self._held:
            await self._pause_engine()
            self._held = True
        if self._hold_timer is not None:
            self._hold_timer.cancel()
        self._hold_timer = asyncio.get_running_loop().call_later(
            self._hold_timeout_s, lambda: asyncio.ensure_future(self._hold_expired())
        )

    async def _hold_expired(self) -> None:
        async with self._control:
            if self._held:
                log.warning("admission hold expired without a weight update or start; resuming")
                await self._release()

    async def _release(self) -> None:
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        if self._held:
            await self._resume_engine()
            self._held = False

    # -- RolloutEngine: profiling and weights -------------------------------------------------
    async def start_profile(self, spec: SessionSpec) -> bool:
        async with self._control:
            self.starting_spec = spec
            try:
                return await self._on_control_thread(lambda: self._session.start(spec, self.weight_version))
            finally:
                self.starting_spec = None
                await self._release()  # a start always ends an admission hold

    async def stop_profile(self, step: int | None, pause: bool) -> StopOutcome:
        loop = asyncio.get_running_loop()
        await self._control.acquire()
        try:
            if pause:
                await self._hold()
        except BaseException:
            self._control.release()
            raise
        acked: asyncio.Future[StopOutcome] = loop.create_future()

        def ack(outcome: StopOutcome) -> None:
            loop.call_soon_threadsafe(lambda: acked.done() or acked.set_result(outcome))

        # Paused, no engine step can enter the window any more: answer before the engine's
        # trace flush. Not paused, the window closes only when the engine's stop returns.
        on_closed = ack if pause else None
        done = asyncio.ensure_future(
            self._on_control_thread(
                lambda: self._session.stop(step, on_closed) if step is not None else StopOutcome(step=None, stopped=False)
            )
        )
        done.add_done_callback(lambda _: self._control.release())
        await asyncio.wait([acked, done], return_when=asyncio.FIRST_COMPLETED)
        return acked.result() if acked.done() else done.result()

    async def update_weights(self, version: int, path: str | None, resume: bool) -> float:
        t0 = time.perf_counter()
        async with self._control:
            if path is not None and version != self.weight_version:
                was_held = self._held
                if not was_held:
                    await self._pause_engine()
                try:
                    await self._engine_load_weights(Path(path), version)
                except BaseException:
                    if not was_held:  # keep serving the old weights; the load error is the answer
                        try:
                            await self._resume_engine()
                        except Exception:  # noqa: BLE001 - logged, the load error is raised
                            log.exception("resuming the engine after a failed weight load failed")
                    raise
                self.weight_version = version
                if not was_held:
                    await self._resume_engine()
            if resume:
                await self._release()
            else:  # hold for the /profile/start that follows: nothing runs unprofiled on `version`
                await self._hold()
        return time.perf_counter() - t0

    @property
    def paused(self) -> bool:
        return self._held

    async def _close_control(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        if self._hold_timer is not None:
            self._hold_timer.cancel()
        self._control_thread.shutdown(wait=False)
