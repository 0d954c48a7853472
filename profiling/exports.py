"""The background exports of one process's traces and their entries' bookkeeping: which step's
export is pending, the annotations that arrive before or after it writes the entry, and the trace
sizes learnt from them (profiling/session.py drives it from the model thread)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Executor, Future
from pathlib import Path

from profiling.backends import ProfilerBackend, RecordedTrace
from profiling.config import ProfileOptions
from profiling.manifest import ClockSync, ManifestEntry
from profiling.memory import release_freed_memory
from profiling.store import TraceStore
from profiling.trace_budget import MIB, StepSizeEstimate, budget_bytes, json_bytes_over

_KEEP_EXPORTS = 16


class Exports:
    """The exports of one process's windows, by step; safe to call from any thread."""

    def __init__(self, store: TraceStore, exporter: Executor):
        self._store = store
        self._exporter = exporter
        self._lock = threading.Lock()
        self._exports: dict[int, Future[ManifestEntry]] = {}
        self._annotations: dict[int, dict[str, object]] = {}
        # Step -> the entry its export wrote: set under the lock in the same breath as the write,
        # so an annotation is applied either by the export or after it, never lost in between.
        self._written: dict[int, ManifestEntry] = {}
        self.step_sizes = StepSizeEstimate()
        """What a forward step costs in trace bytes, learnt from the exported traces."""

    @property
    def pending_count(self) -> int:
        """Exports not done yet."""
        with self._lock:
            return sum(not f.done() for f in self._exports.values())

    def annotate(self, step: int, **fields: object) -> None:
        """Add fields to `step`'s entry, whether its export is still running or already done."""
        with self._lock:
            self._annotations.setdefault(step, {}).update(fields)
            written = self._written.get(step)
            if written is None:
                return  # the export applies the annotations when it writes the entry
            # every annotation so far: the export's entry does not hold the later ones
            entry = written.model_copy(update=self._annotations[step])
            self._store.write_entry(step, entry)
        self._store.refresh_manifest(step)

    def wait(self, step: int, timeout: float | None = None) -> ManifestEntry | None:
        """The final entry of `step` once its export is done (None: this process has none)."""
        with self._lock:
            fut = self._exports.get(step)
        return fut.result(timeout) if fut else None

    def restart(self, step: int) -> None:
        """`step` is recorded again: it starts from no annotations."""
        with self._lock:
            self._annotations.pop(step, None)
            self._written.pop(step, None)

    def pending(self, step: int) -> Future[ManifestEntry]:
        """Register `step`'s export before it starts, so whoever waits for it finds it."""
        pending: Future[ManifestEntry] = Future()
        with self._lock:
            self._exports[step] = pending
            # Keep the last few steps' results (late export reports); forget older ones.
            for old in [k for k, f in self._exports.items() if f.done()][:-_KEEP_EXPORTS]:
                del self._exports[old]
                self._annotations.pop(old, None)
                self._written.pop(old, None)
        return pending

    def finish(
        self,
        step: int,
        options: ProfileOptions,
        backend: ProfilerBackend,
        entry: ManifestEntry,
        pending: Future[ManifestEntry],
    ) -> None:
        """Finalize the profiler (on the calling thread, the model's) and export its trace in the
        background; `pending` gets the final entry."""
        clock = backend.sample_clock("stop")
        if clock is not None:
            entry.clock = (entry.clock or ClockSync()).model_copy(update={"stop": clock})
        t0 = time.perf_counter()
        trace: RecordedTrace | None = None
        try:
            trace = backend.stop()
        except Exception as e:  # noqa: BLE001 - recorded in the entry: the step stays accounted for
            entry.status, entry.error = "error", f"profiler stop failed: {e!r}"
        entry.finalize_s = time.perf_counter() - t0
        fut = self._exporter.submit(self._export, step, options, entry.model_copy(deep=True), trace)
        fut.add_done_callback(lambda f: _resolve(pending, f))

    def _export(
        self, step: int, options: ProfileOptions, entry: ManifestEntry, trace: RecordedTrace | None
    ) -> ManifestEntry:
        t0 = time.perf_counter()
        try:
            if trace is None:  # the profiler's stop failed: nothing to write, the error is recorded
                raise RuntimeError(entry.error)
            paths = trace.export(self._store.entry_dir(step, entry))
            release_freed_memory()  # the recording's events were just freed
            entry.files = [self._store.relative(step, p) for p in paths]
            entry.bytes = sum(p.stat().st_size for p in paths)
            if trace.forward_steps is not None:
                entry.forward_steps = trace.forward_steps
                entry.forward_steps_in_window = trace.forward_steps_in_window
            if trace.weight_versions is not None:
                entry.weight_versions = trace.weight_versions
            entry.auto_stopped = entry.auto_stopped or trace.auto_stopped
            self._account_budget(options, entry, trace, paths)
        except Exception as e:  # noqa: BLE001 - any export failure is recorded, not raised
            entry.status, entry.files = "error", []
            entry.error = entry.error or f"trace export failed: {e!r}"
        entry.exporting = False
        entry.export_s = time.perf_counter() - t0
        try:
            with self._lock:
                self._written[step] = entry
                entry = entry.model_copy(update=self._annotations.get(step, {}))
                self._store.write_entry(step, entry)
            self._store.refresh_manifest(step)
        except OSError as e:
            entry.status, entry.error = "error", f"could not record the trace: {e}"
        return entry

    def _account_budget(
        self, options: ProfileOptions, entry: ManifestEntry, trace: RecordedTrace, paths: list[Path]
    ) -> None:
        """Record the trace's size against `max_trace_mb` in its entry, and learn from it what a
        forward step costs (for the next window's early stop)."""
        if trace.trace_bytes is not None:
            entry.trace_mb = round(trace.trace_bytes / MIB, 3)
            self.step_sizes.learn(options, trace.trace_bytes, entry.forward_steps)
        if trace.cut is not None and trace.cut.events_dropped:
            entry.truncated, entry.forward_steps_kept = True, trace.cut.forward_steps_kept
        elif trace.trace_bytes is None and (budget := budget_bytes(options)) is not None:
            # An engine-owned trace: written by the engine, not ours to cut; flagged instead.
            entry.over_budget = json_bytes_over(paths, budget)


def _resolve(pending: Future[ManifestEntry], done: Future[ManifestEntry]) -> None:
    if done.exception() is not None:
        pending.set_exception(done.exception())
    else:
        pending.set_result(done.result())
