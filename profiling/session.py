"""The per-process profiling session state machine.

    idle --start(k)--> profiling(k) --cap--> capped(k) --stop(k)--> idle (+ export in background)
                           |------------------stop(k)----------------^

* start(k) while profiling/capped k is idempotent; start(j != k) is a conflict.
* stop when idle is a no-op; stop(j != k) is a conflict.
* cap: after `max_forward_steps` engine steps or `max_duration_s`, or when one more step would
  overfill the trace budget `max_trace_mb` (estimated from earlier traces), recording ends and
  the trace is exported, but step k stays active until stopped, so the trainer's stop(k) still
  matches.
* `exporting` is reported when idle while traces are still being written.

Every method except `status`/`wait_exported` must run on the thread that runs the model.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import Literal

from pydantic import BaseModel, Field

from profiling.backends import ProfilerBackend, create_backend
from profiling.config import ProfileOptions
from profiling.exports import Exports
from profiling.manifest import AutoStop, ClockSync, ManifestEntry
from profiling.markers import format_forward_step, format_weight_update
from profiling.store import TraceStore
from profiling.version_windows import VersionWindows

SessionState = Literal["idle", "profiling", "capped", "exporting"]


class SessionConflict(RuntimeError):
    """A start or stop that names a different step than the active one."""


class SessionSpec(BaseModel):
    """What to record: the window label, its steps, options, and whether we join late."""

    step: int = Field(ge=1)
    steps: list[int]
    options: ProfileOptions
    tag: str | None = None
    late_start: bool = False


BackendFactory = Callable[[SessionSpec], ProfilerBackend]
"""Makes the profiler backend of one recording."""


def in_process_backend(spec: SessionSpec) -> ProfilerBackend:
    """The in-process profiler that `spec.options.tool` names (torch, npu, nsys)."""
    return create_backend(spec.options)


class StopOutcome(BaseModel):
    step: int | None
    stopped: bool
    files: list[str] = Field(default_factory=list)
    forward_steps: int = 0
    weight_version: int | None = None
    auto_stopped: str | None = None


class ProfileSession:
    """One process's profiling state, its backend, and its trace entry."""

    def __init__(
        self,
        *,
        store: TraceStore,
        entry_identity: ManifestEntry,
        exporter: Executor,
        backend_factory: BackendFactory = in_process_backend,
    ):
        self._store = store
        self._identity = entry_identity
        self._backend_factory = backend_factory
        self._state: Literal["idle", "profiling", "capped"] = "idle"
        self._spec: SessionSpec | None = None
        self._backend: ProfilerBackend | None = None
        self._entry: ManifestEntry | None = None
        self._deadline: float | None = None
        self._steps_after_cap = 0
        self._exports = Exports(store, exporter)
        self._versions = VersionWindows()

    # -- read from any thread ----------------------------------------------------------------
    @property
    def active_step(self) -> int | None:
        return self._spec.step if self._spec else None

    @property
    def state(self) -> SessionState:
        if self._state == "idle" and self.exports_pending:
            return "exporting"
        return self._state

    @property
    def exports_pending(self) -> int:
        return self._exports.pending_count

    @property
    def forward_steps(self) -> int:
        return self._entry.forward_steps if self._entry else 0

    def recorded_by_version(self) -> dict[int, int]:
        """Forward steps recorded (`forward_step` while recording), by weight version."""
        return self._versions.recorded_by_version()

    def step_started_on(self, version: int) -> int | None:
        """The window that started on weights `version` and recorded them alone: closed, and no
        weight load fell inside it (None: there is none)."""
        return self._versions.step_started_on(version, self.active_step)

    def annotate(self, step: int, **fields: object) -> None:
        """Add fields to `step`'s entry (e.g. the sync cost known only after the stop), whether
        its export is still running or already done."""
        self._exports.annotate(step, **fields)

    def wait_exported(self, step: int, timeout: float | None = None) -> ManifestEntry | None:
        """The final entry of `step` once its export is done (None: this process has none)."""
        return self._exports.wait(step, timeout)

    # -- model thread --------------------------------------------------------------------------
    def start(self, spec: SessionSpec, weight_version: int) -> bool:
        """Start recording `spec.step`. Returns False if that step was already active."""
        if self._spec is not None:
            if self._spec.step == spec.step:
                return False
            raise SessionConflict(
                f"step {self._spec.step} is being profiled; stop it before starting step {spec.step}"
            )
        backend = self._backend_factory(spec)
        out_dir = self._store.entry_dir(spec.step, self._identity)
        entry = self._identity.model_copy(
            update={
                "pid": os.getpid(),
                "exporting": True,
                "files": [self._store.relative(spec.step, out_dir / f) for f in backend.trace_files],
                "weight_version": weight_version,
                "weight_versions": [weight_version],
                "started_at": time.time(),
                "late_start": spec.late_start,
                "trace_dialect": backend.trace_dialect,
            }
        )
        backend.start()
        try:
            clock = backend.sample_clock("start")
            entry.clock = ClockSync(start=clock) if clock else None
            self._store.write_entry(spec.step, entry)
        except BaseException:
            backend.stop()
            raise
        self._exports.restart(spec.step)
        self._spec, self._backend, self._entry, self._state = spec, backend, entry, "profiling"
        self._steps_after_cap = 0
        self._versions.started(spec.step, weight_version)
        limit = spec.options.max_duration_s
        self._deadline = time.monotonic() + limit if limit else None
        return True

    def stop(self, step: int, on_closed: Callable[[StopOutcome], None] | None = None) -> StopOutcome:
        """Close the window, call `on_closed` (the acknowledgement), then finalize the profiler
        and hand the export to the background. `on_closed` runs before the finalize, so the
        caller is answered as soon as no further forward pass can be recorded."""
        if self._spec is None:
            outcome = StopOutcome(step=None, stopped=False)
            if on_closed:
                on_closed(outcome)
            return outcome
        if self._spec.step != step:
            raise SessionConflict(f"step {step} is not being profiled (active step: {self._spec.step})")
        assert self._entry is not None and self._backend is not None
        was_recording = self._state == "profiling"
        counted_here = not self._backend.counts_forward_steps
        if was_recording:
            self._entry.stopped_at = time.time()
            if counted_here:
                self._entry.forward_steps_in_window = self._entry.forward_steps
        outcome = StopOutcome(
            step=step,
            stopped=True,
            files=self._entry.files,
            forward_steps=self._entry.forward_steps,
            weight_version=self._entry.weight_version,
            auto_stopped=self._entry.auto_stopped,
        )
        spec, backend, entry = self._spec, self._backend, self._entry
        self._spec = self._backend = self._entry = None
        self._deadline = None
        self._state = "idle"
        # Registered before the acknowledgement: whoever asks for the export next must wait
        # for it, not find nothing because the finalize has not started yet.
        pending = self._exports.pending(step) if was_recording else None
        if on_closed:
            on_closed(outcome)
        if pending is not None:
            assert backend is not None
            self._exports.finish(spec.step, spec.options, backend, entry, pending)
        else:  # capped: the steps run since the cap are known now (an engine's own count ended at it)
            ran = entry.forward_steps + self._steps_after_cap if counted_here else None
            self._exports.annotate(step, forward_steps_in_window=ran)
        return outcome

    @contextlib.contextmanager
    def forward_step(self, weight_version: int) -> Iterator[None]:
        """Wrap one engine step: a trace range naming the step and weight version, counted (after
        a cap, only counted)."""
        if self._state == "capped":
            self._steps_after_cap += 1
        if self._state != "profiling":
            yield
            return
        assert self._backend is not None and self._entry is not None and self._spec is not None
        n = self._entry.forward_steps
        with self._backend.mark(format_forward_step(n, self._spec.step, weight_version)):
            yield
        self._versions.count(self._entry, weight_version)
        limit = self._spec.options.max_forward_steps
        if limit is not None and n + 1 >= limit:
            self._cap("max_forward_steps")
        elif self._exports.step_sizes.next_step_overflows(self._spec.options, n + 1):
            self._cap("max_trace_mb")
        else:
            self.check_deadline()

    def note_weight_load(self) -> None:
        """The engine loads new weights now: the active window (if any) spans two versions."""
        self._versions.weight_load(self.active_step)

    def mark_weight_update(self, version: int, apply: Callable[[], None]) -> None:
        """Run `apply` (the weight swap) inside a trace range, if recording."""
        if self._state == "profiling":
            assert self._backend is not None
            with self._backend.mark(format_weight_update(version)):
                apply()
        else:
            apply()

    def check_deadline(self) -> None:
        """Cap the recording once `max_duration_s` has passed (call it from the model loop)."""
        if self._state == "profiling" and self._deadline is not None and time.monotonic() >= self._deadline:
            self._cap("max_duration_s")

    # -- internals -----------------------------------------------------------------------------
    def _cap(self, reason: AutoStop) -> None:
        assert self._entry is not None and self._spec is not None and self._backend is not None
        self._entry.auto_stopped = reason
        self._entry.stopped_at = time.time()
        self._state = "capped"
        step = self._spec.step
        self._exports.finish(step, self._spec.options, self._backend, self._entry, self._exports.pending(step))
