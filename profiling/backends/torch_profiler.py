"""torch.profiler backend: Chrome traces, exported after stop so stop stays cheap."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from isal import igzip
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile, record_function

from profiling.backends.base import ProfilerBackend, RecordedTrace
from profiling.backends.chrome_names import repair_names
from profiling.backends.forked import ForkUnavailable, run_forked
from profiling.config import ProfileOptions
from profiling.manifest import ClockSample
from profiling.trace_budget import MIB, TraceCut, cut_trace

log = logging.getLogger(__name__)

TRACE_FILE = "trace.pt.trace.json.gz"
GZIP_LEVEL = 1
"""ISA-L's level 1 (`isal.igzip`): torch's own `.gz` export compresses with zlib at level 9, many
times slower for a trace only ~25% smaller, and export speed bounds how fast steps can be
profiled back to back. On a real trace here ISA-L level 1 ran at 710 MB/s against zlib level 1's
232 MB/s, at the same ratio (11.3)."""
EXPORT_TIMEOUT_S = 3600.0
"""Longest a trace's export may take in its child before the child is killed and the export
recorded as failed (a child that hangs must not hold the export queue forever)."""
_ACTIVITIES = {"cpu": ProfilerActivity.CPU, "cuda": ProfilerActivity.CUDA}
QUIET_KINETO_ENV = {"KINETO_LOG_LEVEL": "6"}
"""Environment defaults that keep Kineto's (torch.profiler's engine's) probe lines out of stderr:
it prints `USDT:... SyncActivityProfilerHandler.cpp:...] profiler_start` (and `profiler_stop`) at
every recording's start and stop, at its level USDT (5), above ERROR (4), where torch leaves
Kineto. Level 6 hides them, and Kineto's own ERROR lines with them (a recording that fails still
shows: its manifest entry is not ok). Kineto reads the variable when it initialises (a process's
first profiler start): set it with `os.environ.setdefault` (a KINETO_LOG_LEVEL already set wins)
in the process, and in the environment of the processes it starts."""


def _trace_only(options: ProfileOptions) -> _ExperimentalConfig | None:
    """Kineto's `trace_only`: the stop (on the model's thread, holding the GIL) skips building
    Python event objects that only `events()` reads, which this backend never calls: about 40%
    of a CPU recording's stop. None where this torch has no such option, and with stacks, which
    need those objects (torch turns the option off with a warning at every start)."""
    if options.with_stack:
        return None
    try:
        return _ExperimentalConfig(trace_only=True)
    except TypeError:
        return None


def quiet_kineto_env() -> None:
    """Set QUIET_KINETO_ENV's defaults in this process's environment (and so in the processes it
    starts from now on); a value already set wins."""
    for key, value in QUIET_KINETO_ENV.items():
        os.environ.setdefault(key, value)


KINETO_THREAD_LINE = b"External init callback must run in same thread as registerClient"
"""What Kineto prints, with `fprintf(stderr, "ERROR: ...")` and whatever its log level, when it
initialises on a thread other than the one that loaded torch (see init_kineto)."""


@contextlib.contextmanager
def _stderr_without(line: bytes) -> Iterator[None]:
    """While inside, pass this process's stderr (file descriptor 2, which C++ writes to) through a
    pipe whose reader drops the lines holding `line` and forwards every other line, in order.
    Unfiltered where descriptor 2 cannot be duplicated."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    read_end, write_end = os.pipe()
    reader = threading.Thread(target=_forward_lines, args=(read_end, saved, line), daemon=True)
    reader.start()
    sys.stderr.flush()
    os.dup2(write_end, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(write_end)
        # A process forked meanwhile holds the pipe open until it exits: the reader then goes on
        # forwarding without this thread waiting for it.
        reader.join(timeout=2.0)


def _forward_lines(read_end: int, out: int, dropped: bytes) -> None:
    """Copy lines from `read_end` to `out` until the pipe closes, leaving out those that hold
    `dropped`; then close both."""
    with os.fdopen(read_end, "rb") as pipe, os.fdopen(out, "wb", buffering=0) as sink:
        for text in pipe:
            if dropped not in text:
                sink.write(text)


@functools.cache
def init_kineto() -> None:
    """Initialise Kineto in this process with an empty recording (about 1 s on CPU, once per
    process); TorchProfilerBackend's first start calls it, and a process may call it earlier, on
    any thread, so that the first profiled step's start does not pay it.

    Loading torch registers its client with Kineto on the loading thread; Kineto initialises at
    the first profiler start and, when that start is on another thread (a Serve replica's
    user-code thread, while Ray loaded torch on its own; the trainer's model thread), prints
    `ERROR: External init callback must run in same thread as registerClient` to stderr,
    unfiltered by KINETO_LOG_LEVEL: harmless (torch's client has nothing to initialise), but it
    reads as a failure. That line alone is dropped from stderr while Kineto initialises."""
    if torch.autograd.kineto_available():
        with _stderr_without(KINETO_THREAD_LINE), profile(activities=[ProfilerActivity.CPU]):
            pass


class TorchRecordedTrace(RecordedTrace):
    def __init__(self, prof: profile, options: ProfileOptions):
        self._prof: profile | None = prof
        self._options = options

    def export(self, out_dir: Path) -> list[Path]:
        """Write the trace, in a child forked from this process where it can be
        (profiling/backends/forked.py: torch's export holds the GIL, which the model's thread
        needs meanwhile), else here."""
        out_dir.mkdir(parents=True, exist_ok=True)
        prof, self._prof = self._prof, None
        assert prof is not None, "a recording is exported once"
        try:
            try:
                written = run_forked(lambda: _write(prof, out_dir, self._options), EXPORT_TIMEOUT_S)
            except ForkUnavailable:  # nothing lost: the recording is still here
                written = _write(prof, out_dir, self._options)
        finally:
            # Written once: free the recorded events now. `profile` holds bound methods of
            # itself (a reference cycle), so dropping it alone leaves the events to a full
            # garbage collection, which a large process like a Serve replica rarely runs:
            # dead recordings piled up, hundreds of MB each.
            prof.profiler = None
        if written["repaired_names"]:
            log.warning(
                "the trace in %s had %d event names torch.profiler wrote as invalid JSON (frames of "
                "code freed while recording, seen with with_stack); they were escaped",
                out_dir.name,
                written["repaired_names"],
            )
        self.trace_bytes = written["trace_bytes"]
        self.cut = None if written["cut"] is None else TraceCut(**written["cut"])
        return [out_dir / TRACE_FILE]


def _write(prof: profile, out_dir: Path, options: ProfileOptions) -> dict[str, Any]:
    """Export `prof`'s trace as out_dir/TRACE_FILE, gzipped, cut to `options.max_trace_mb`;
    its JSON size, cut and count of event names repaired (profiling/backends/chrome_names.py),
    as plain data."""
    path = out_dir / TRACE_FILE
    plain, packed = out_dir / f".{TRACE_FILE}.tmp.json", out_dir / f".{TRACE_FILE}.tmp.gz"
    cut: TraceCut | None = None
    try:
        prof.export_chrome_trace(str(plain))
        repaired = repair_names(plain)
        trace_bytes = plain.stat().st_size
        limit = options.max_trace_mb
        with igzip.open(packed, "wb", compresslevel=GZIP_LEVEL) as dst:
            if limit is not None and trace_bytes > limit * MIB:
                cut = cut_trace(plain, dst, limit)
            else:
                with open(plain, "rb") as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
        packed.replace(path)
    finally:
        plain.unlink(missing_ok=True)
        packed.unlink(missing_ok=True)
    return {
        "trace_bytes": trace_bytes,
        "cut": None if cut is None else dataclasses.asdict(cut),
        "repaired_names": repaired,
    }


class TorchProfilerBackend(ProfilerBackend):
    trace_files = (TRACE_FILE,)
    _prof: profile | None  # set by _start, cleared by _stop

    def _start(self) -> None:
        if "cuda" in self.options.activities and not torch.cuda.is_available():
            raise RuntimeError("activities include 'cuda' but torch sees no CUDA device; use activities: [cpu]")
        init_kineto()
        self._prof = profile(
            activities=[_ACTIVITIES[a] for a in self.options.activities],
            record_shapes=self.options.record_shapes,
            with_stack=self.options.with_stack,
            profile_memory=self.options.with_memory,
            experimental_config=_trace_only(self.options),
        )
        self._prof.start()

    def _stop(self) -> RecordedTrace:
        prof, self._prof = self._prof, None
        assert prof is not None  # stop() only calls _stop after a successful _start
        prof.stop()
        return TorchRecordedTrace(prof, self.options)

    @contextlib.contextmanager
    def mark(self, name: str) -> Iterator[None]:
        with record_function(name):
            yield

    def sample_clock(self, at: str) -> ClockSample | None:
        """An empty range bracketed by wall-clock readings: its timestamps in the trace are the
        profiler's clock at that instant, so the merge measures the trace-to-wall-clock offset
        instead of assuming Kineto's clock is `time.time_ns()`."""
        name = f"clock_sync {at} pid={os.getpid()}"
        before = time.time_ns()
        with record_function(name):
            pass
        return ClockSample(marker=name, wall_before_ns=before, wall_after_ns=time.time_ns())
