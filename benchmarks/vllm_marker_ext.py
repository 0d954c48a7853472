"""The worker extension of benchmarks/vllm_marker_cost.py: the project's `ProfilingWorkerExtension`
plus what the benchmark needs to take the markers away while keeping everything else.

vLLM imports `worker_extension_cls` by its qualified name in its engine-core process, so this is a
module of its own (the benchmark's `__main__` is another module there), imported as
`vllm_marker_ext` with benchmarks/ on that process's `sys.path` (the benchmark puts it on
`PYTHONPATH` as well as its own `sys.path`, which a forked or spawned process inherits).

Methods carry the `marker_cost_` prefix: vLLM refuses extension attributes that clash with the
worker's.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from profiling.backends.torch_profiler import TorchProfilerBackend
from profiling.config import ProfileOptions
from profiling.markers import format_forward_step
from serve_app.engines.vllm.worker import ProfilingWorkerExtension, WorkerProfiler

EXTENSION = "vllm_marker_ext.MarkerCostExtension"
"""The `worker_extension_cls` to give vLLM (benchmarks/ on the engine process's path)."""


class MarkerCostExtension(ProfilingWorkerExtension):
    """`ProfilingWorkerExtension` with a wrapper switch and a recording without markers."""

    _marker_cost_marked: Any
    _marker_cost_plain: TorchProfilerBackend | None

    def marker_cost_wrapper(self, installed: bool) -> None:
        """Install (`installed`) or remove the extension's `execute_model` wrapper: removed, every
        iteration runs vLLM's own `execute_model` (the class's method) as without the extension."""
        worker: Any = self
        if not hasattr(self, "_marker_cost_marked"):
            # `rollout_profiler_attach` set the wrapper as an instance attribute.
            self._marker_cost_marked = worker.__dict__["execute_model"]
            self._marker_cost_plain = None
        if installed:
            worker.execute_model = self._marker_cost_marked
        else:
            worker.__dict__.pop("execute_model", None)

    def marker_cost_plain_start(self, options: dict[str, Any]) -> None:
        """Record with the torch backend and `options`, as a window does, without opening the
        extension's window: the wrapper (if installed) counts passes but marks none."""
        backend = TorchProfilerBackend(ProfileOptions.model_validate(options))
        backend.start()
        self._marker_cost_plain = backend

    def marker_cost_plain_stop(self, out_dir: str) -> int:
        """End the plain recording and export it into `out_dir` before answering (the benchmark
        waits for every export between rounds anyway); returns the trace's bytes."""
        backend, self._marker_cost_plain = self._marker_cost_plain, None
        assert backend is not None, "marker_cost_plain_start first"
        trace = backend.stop()
        out = Path(out_dir)
        try:
            trace.export(out)
            return trace.trace_bytes or 0
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def marker_cost_mark_us(self, options: dict[str, Any], n: int) -> float:
        """Microseconds per empty forward-step range while the torch backend records with
        `options`, over `n` ranges timed on this (the worker's) thread: what a marker adds to each
        engine iteration, free of the load's noise. The recording is dropped unexported."""
        backend = TorchProfilerBackend(ProfileOptions.model_validate(options))
        backend.start()
        try:
            t0 = time.perf_counter()
            for i in range(n):
                with backend.mark(format_forward_step(i, 1, 0)):
                    pass
            return (time.perf_counter() - t0) / n * 1e6
        finally:
            backend.stop()

    def marker_cost_wrapper_us(self, n: int) -> float:
        """Microseconds the wrapper adds to an iteration outside any window (it counts the pass by
        version), over `n` calls of a no-op `execute_model` timed on this thread, with and
        without the wrapper of a fresh `WorkerProfiler` (this worker's counts stay untouched)."""

        class Scheduled:
            total_num_scheduled_tokens = 1

        def noop(scheduler_output: Any) -> None:
            return None

        out, wrapped = Scheduled(), WorkerProfiler(rank=0, version=0).wrap(noop)
        t0 = time.perf_counter()
        for _ in range(n):
            noop(out)
        t1 = time.perf_counter()
        for _ in range(n):
            wrapped(out)
        return ((time.perf_counter() - t1) - (t1 - t0)) / n * 1e6
