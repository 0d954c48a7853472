"""nsys backend: a CUDA profiler capture range for Nsight Systems.

The process must run under `nsys profile --capture-range=cudaProfilerApi` (add
`--capture-range-end=repeat` to capture more than one window per process). Start and stop call
`torch.cuda.profiler.start()/stop()` (cudaProfilerStart/Stop), so nsys records exactly the window;
`mark` opens NVTX ranges (`torch.cuda.nvtx.range_push/pop`), which nsys shows with `--trace=nvtx`.

nsys writes the report (`.nsys-rep`) itself, where its `-o/--output` says, when the capture range
ends or the process exits. This backend writes no trace: `trace_files` is empty and `export` writes
`nsys_capture.json`, a note of the capture window and where the report goes, so the step
directory still says what happened.

Tested only against fake torch.cuda functions on CPU (tests/unit/test_nsys_backend.py), never
under nsys on an NVIDIA GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from profiling.analysis.events import CAPTURE_NOTE_SUFFIX
from profiling.backends.base import ProfilerBackend, RecordedTrace
from profiling.store import atomic_write_text

NOTE_FILE = CAPTURE_NOTE_SUFFIX
NEEDS_CUDA = (
    "tool 'nsys' needs a CUDA device and must run under `nsys profile --capture-range=cudaProfilerApi`"
)
REPORT_WHERE = (
    "nsys writes the report (.nsys-rep) itself, not into this directory: at the path given by "
    "`nsys profile -o/--output` (default report<N>.nsys-rep in the directory nsys was started in); "
    "for a Ray actor started with runtime_env nsight, under /tmp/ray/session_latest/logs/nsight/ "
    "on its node. It is finalized when the capture range ends (--capture-range-end=stop|repeat) "
    "or when the process exits."
)


class NsysCapture(RecordedTrace):
    """One closed capture window; exporting it writes the note."""

    def __init__(self, started_at: float, stopped_at: float, ranges: int):
        self.started_at, self.stopped_at, self.ranges = started_at, stopped_at, ranges

    def export(self, out_dir: Path) -> list[Path]:
        note = {
            "tool": "nsys",
            "trace_written_here": False,
            "report": REPORT_WHERE,
            "capture": {
                "api": "cudaProfilerStart/cudaProfilerStop (torch.cuda.profiler.start/stop)",
                "started_at": self.started_at,
                "stopped_at": self.stopped_at,
                "duration_s": self.stopped_at - self.started_at,
                "nvtx_ranges": self.ranges,
            },
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "run_under": "nsys profile --capture-range=cudaProfilerApi --capture-range-end=repeat "
            "--trace=cuda,nvtx <command>",
        }
        path = out_dir / NOTE_FILE
        atomic_write_text(path, json.dumps(note, indent=2) + "\n")
        return [path]


class NsysProfilerBackend(ProfilerBackend):
    """Opens and closes an nsys capture range; the recording itself is nsys's."""

    trace_files = ()  # nsys writes the report; export only writes the note

    def _start(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(NEEDS_CUDA)
        self._ranges = 0
        self._started_at = time.time()
        torch.cuda.profiler.start()

    def _stop(self) -> RecordedTrace:
        torch.cuda.synchronize()  # kernels launched in the window finish inside it
        torch.cuda.profiler.stop()
        return NsysCapture(self._started_at, time.time(), self._ranges)

    @contextlib.contextmanager
    def mark(self, name: str) -> Iterator[None]:
        torch.cuda.nvtx.range_push(name)
        self._ranges += 1
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()
