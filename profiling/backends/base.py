"""The abstract profiler: public start/stop own the state and guards; subclasses fill the hooks."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

from profiling.config import ProfileOptions
from profiling.manifest import AutoStop, ClockSample, TraceDialect
from profiling.trace_budget import TraceCut


class ProfilerStateError(RuntimeError):
    """start() while recording, or stop() while not recording."""


class RecordedTrace(ABC):
    """A finished recording that can be written to disk later, off the critical path."""

    forward_steps: int | None = None
    """Engine steps found in the trace by `export`, for tools that cannot count them live."""
    forward_steps_in_window: int | None = None
    """With `forward_steps`: the engine steps run from the recording's start to its stop,
    recorded or not (None: the engine does not count those it did not record)."""
    trace_bytes: int | None = None
    """Size of the trace's JSON as exported, before compression and any cut (None: the export
    does not measure it)."""
    cut: TraceCut | None = None
    """Set by an export that cut the trace to its budget (`max_trace_mb`)."""
    weight_versions: list[int] | None = None
    """The weight versions of the recorded engine steps, in order, for tools that count them
    outside this process (None: the session's own count stands)."""
    auto_stopped: AutoStop | None = None
    """Set when the recording ended itself before its stop (a cap applied where it ran)."""

    @abstractmethod
    def export(self, out_dir: Path) -> list[Path]:
        """Write the trace files into `out_dir` and return their paths."""


class ProfilerBackend(ABC):
    """One recording at a time. Must be started and stopped on the thread that runs the model
    (torch.profiler records per thread, and stopping it from another thread crashes)."""

    trace_files: tuple[str, ...] = ()
    """File names a recording exports, known before it starts (the manifest lists them early)."""
    trace_dialect: TraceDialect = TraceDialect()
    """How this profiler's traces name forward passes (written into the entry): this project's
    markers, unless an engine's own profiler records."""
    counts_forward_steps: ClassVar[bool] = False
    """True: the engine counts its forward steps itself (its trace's counts replace the
    session's, which sees none); False: the session counts them (`forward_step`)."""

    def __init__(self, options: ProfileOptions):
        self.options = options
        self._recording = False

    @property
    def recording(self) -> bool:
        return self._recording

    def start(self) -> None:
        if self._recording:
            raise ProfilerStateError("profiler is already recording")
        self._start()
        self._recording = True

    def stop(self) -> RecordedTrace:
        """Stop recording (the profiler's finalize runs here) and return the unexported trace."""
        if not self._recording:
            raise ProfilerStateError("profiler is not recording")
        self._recording = False
        return self._stop()

    @contextlib.contextmanager
    def mark(self, name: str) -> Iterator[None]:
        """A named range in the trace (a no-op when the tool has no ranges)."""
        yield

    def sample_clock(self, at: str) -> ClockSample | None:
        """Record a clock marker named after `at` while recording (None: this tool has no
        timestamps of its own to align)."""
        return None

    @abstractmethod
    def _start(self) -> None: ...

    @abstractmethod
    def _stop(self) -> RecordedTrace: ...
