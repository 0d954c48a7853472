"""A profiler that the engine owns (vLLM's, SGLang's), as a `ProfilerBackend` of the session.

Such an engine writes its traces into a directory of its own (the replica's engine trace
directory), naming the files of one recording by a prefix we give at start. `EngineProfiler`
plugs that into `ProfileSession` (the same state machine, guards, caps and manifest entries as
the in-process profilers): its start and stop run the engine's async profiler calls on the
replica's event loop from the engine's control thread, and its export moves the files the engine
wrote for that recording into `step_<k>/rollout/<replica_id>/`, compressing them there, off the
critical path. Subclasses fill `_engine_start` and `_engine_stop`, and `_recorded` where the
recording is not just the files the engine wrote with the prefix.
"""

from __future__ import annotations

import asyncio
import gzip
import re
import shutil
from abc import abstractmethod
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from profiling.backends.base import ProfilerBackend, RecordedTrace
from profiling.session import SessionSpec
from profiling.step_ranges import count_engine_steps

T = TypeVar("T")

ENGINE_CALL_TIMEOUT_S = 900.0
"""Longest the control thread waits for the engine to acknowledge a profiler start or stop.
vLLM's stop flushes the trace inline, which takes minutes on big models with stack capture on."""


def recording_prefix(spec: SessionSpec) -> str:
    """The file-name prefix of one recording: the step, and the tag when there is one.
    Both engines accept `[A-Za-z0-9][A-Za-z0-9._-]*`, which the tag's safe-name check ensures."""
    return f"step{spec.step}" + (f"-{spec.tag}" if spec.tag else "")


class EngineTrace(RecordedTrace):
    """The files an engine wrote for one recording, still in the engine's own directory."""

    def __init__(self, files: list[Path], step_range: str | None):
        self._files = files
        self._step_range = step_range

    def export(self, out_dir: Path) -> list[Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        for src in self._files:
            if self._step_range is not None and self.forward_steps is None and _is_json_trace(src):
                self.forward_steps = count_engine_steps(src, self._step_range)
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


class EngineProfiler(ProfilerBackend):
    """One recording of an engine-owned profiler. Runs on the engine's control thread; the
    engine's calls are coroutines and run on the replica's event loop (`loop`)."""

    counts_forward_steps = True
    step_range: ClassVar[str | None] = None
    """Name prefix of the range that marks one engine step in the engine's Chrome trace
    (`profiling.step_ranges`); None: the engine's traces do not show steps."""

    def __init__(self, spec: SessionSpec, *, trace_dir: Path, loop: asyncio.AbstractEventLoop):
        super().__init__(spec.options)
        self.prefix = recording_prefix(spec)
        self.trace_dir = trace_dir
        self._loop = loop

    @abstractmethod
    async def _engine_start(self) -> None:
        """Start the engine's profiler; its files for this recording must start with `prefix`."""

    @abstractmethod
    async def _engine_stop(self) -> None:
        """Stop the engine's profiler; return once its files are written."""

    def recorded_files(self) -> list[Path]:
        """The files (or directories) the engine wrote for this recording."""
        pattern = re.compile(rf"^{re.escape(self.prefix)}[_.-]")
        return sorted(p for p in self.trace_dir.iterdir() if pattern.match(p.name))

    def _start(self) -> None:
        self._on_loop(self._engine_start())

    def _recorded(self) -> RecordedTrace:
        """The recording just stopped: by default the files the engine wrote with `prefix`."""
        return EngineTrace(self.recorded_files(), self.step_range)

    def _stop(self) -> RecordedTrace:
        self._on_loop(self._engine_stop())
        return self._recorded()

    def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(ENGINE_CALL_TIMEOUT_S)
