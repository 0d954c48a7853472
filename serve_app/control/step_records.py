"""The controller's records of each step under save_path: the session record (`session.json`)
and the manifest derived from it (docs/design.md#manifest), plus the steps listing.

Every disk read and write runs off the event loop. The writes that follow a start or stop run
after the call has answered, in call order; a step whose records could not be written (save_path
unwritable or full) is remembered here, with the replicas whose traces are lost, and served as
507 by `GET /profile/steps/{k}`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from profiling.clock_exchange import tightest
from profiling.config import MAX_STEP
from profiling.manifest import ClockOffset, SessionRecord, StepManifest
from profiling.store import StorageError, TraceStore
from serve_app.api import ReplicaReport, StepsResponse, StepSummary
from serve_app.errors import InsufficientStorage, NotFound
from serve_app.metrics import observe_exports

log = logging.getLogger(__name__)


@dataclass
class _Unrecorded:
    """A step whose records could not be written: the last write error, and the replicas whose
    traces are lost (replica id -> why)."""

    error: str
    lost: dict[str, str] = field(default_factory=dict)


class StepRecords:
    def __init__(self, store: TraceStore, min_free_disk_mb: float, keep_steps: int | None = None):
        self.store = store
        self._min_free_disk_mb = min_free_disk_mb
        self._keep_steps = keep_steps
        self._books = asyncio.Lock()  # FIFO: session/manifest writes happen in call order
        self._unrecorded: dict[int, _Unrecorded] = {}
        # Step -> how many times it was prepared: a late write of an earlier run of the same step
        # number (moved aside by the new run's start) must not land in, or fail, the new run.
        self._runs: dict[int, int] = {}
        self._background: set[asyncio.Future[None]] = set()

    def background(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` after the call answers, keeping it referenced until it is done."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- a start --------------------------------------------------------------------------------
    async def prepare(self, step: int) -> None:
        """Before a fresh start of `step`: save_path must be writable with min_free_disk_mb
        free (else 507), an earlier run of the same step number is moved aside, and with
        keep_steps the oldest step directories beyond it are removed."""

        def prepare() -> tuple[Path | None, list[str]]:
            self.store.check_writable(self._min_free_disk_mb)
            moved = self.store.set_aside(step)
            removed = self.store.prune(self._keep_steps - 1) if self._keep_steps is not None else []
            return moved, removed

        try:
            async with self._books:  # after the writes already queued for an earlier run
                self._runs[step] = self._runs.get(step, 0) + 1
                moved, removed = await asyncio.to_thread(prepare)
        except StorageError as e:
            raise InsufficientStorage(str(e)) from e
        except OSError as e:
            raise InsufficientStorage(f"cannot make room for step {step} under save_path: {e}") from e
        if moved is not None:
            log.warning("step %s was recorded before under save_path; moved that run to %s", step, moved)
        if removed:
            log.warning("keep_steps=%s: removed %s from save_path", self._keep_steps, ", ".join(removed))
        self._unrecorded.pop(step, None)  # an earlier run of this step number no longer counts

    async def failed_start(self, step: int, record: SessionRecord) -> None:
        """Record a start that no replica carried out, before the call answers."""

        def write() -> None:
            self.store.write_session(step, record)
            self.store.refresh_manifest(step)

        async with self._books:
            await asyncio.to_thread(write)

    def started(
        self, step: int, fresh: SessionRecord | None, joined: set[str], *, if_missing: SessionRecord | None = None
    ) -> None:
        """After a start: the replicas that joined `step` (`fresh`: a new step's record;
        `if_missing`: the record to write if the step has none, a start having been cut short)."""

        def write() -> None:
            record = fresh or self.store.read_session(step) or if_missing
            if record is not None:
                record.replicas = sorted({*record.replicas, *joined})
                self.store.write_session(step, record)

        self._after(step, write)

    # -- a stop ---------------------------------------------------------------------------------
    def stopped(self, step: int, stopped_at: float, reason: str | None, reports: list[ReplicaReport]) -> None:
        """After a stop: when, why if the app stopped it itself, and which replicas failed or vanished."""
        failed = {r.replica_id: r.error or "stop failed" for r in reports if not r.ok}

        def write() -> None:
            record = self.store.read_session(step)
            if record is not None:
                record.stopped_at = stopped_at
                record.auto_stopped = reason
                record.failures.update(failed)
                for rid in set(record.replicas) - {r.replica_id for r in reports}:
                    record.failures[rid] = "replica died or was removed before the stop"
                self.store.write_session(step, record)
            self.store.refresh_manifest(step)

        self._after(step, write, failed)

    def clocks_measured(self, step: int, offsets: dict[str, ClockOffset]) -> None:
        """After a clock exchange with the replicas: each one's offset against the controller's
        clock, the tightest measured for the step so far kept."""

        def write() -> None:
            record = self.store.read_session(step)
            if record is None or not offsets:
                return
            for rid, offset in offsets.items():
                record.clock_offsets[rid] = tightest(record.clock_offsets.get(rid), offset) or offset
            self.store.write_session(step, record)
            self.store.refresh_manifest(step)

        self._after(step, write)

    def exported(self, step: int, failed: dict[str, str]) -> None:
        """After every replica's export of `step` finished or was given up: the traces lost."""

        def write() -> None:
            record = self.store.read_session(step)
            if record is not None and failed:
                for rid, why in failed.items():
                    record.failures.setdefault(rid, why)
                self.store.write_session(step, record)
            observe_exports(self.store.refresh_manifest(step))

        self._after(step, write, failed)

    def _after(self, step: int, write: Callable[[], None], lost: dict[str, str] | None = None) -> None:
        """Run `write` after answering, in call order, off the loop. `lost`: replica id -> why its
        trace is missing; if the write fails, it is kept for GET /profile/steps/{k}."""

        run_of = self._runs.get(step, 0)

        async def run() -> None:
            async with self._books:
                if self._runs.get(step, 0) != run_of:
                    log.info("step %s started again: a write for its earlier run is dropped", step)
                    return
                try:
                    await asyncio.to_thread(write)
                except (OSError, StorageError) as e:  # unwritable, full, or a corrupt record
                    log.error("could not record step %s under %s: %s", step, self.store.root, e)
                    unrecorded = self._unrecorded.setdefault(step, _Unrecorded(error=str(e)))
                    unrecorded.error = str(e)
                    unrecorded.lost.update(lost or {})

        self.background(run())

    # -- reads ----------------------------------------------------------------------------------
    async def steps(self) -> StepsResponse:
        """Every step under save_path with its manifest's status."""

        def read() -> list[StepSummary]:
            return [
                StepSummary(step=k, steps=m.steps, status=m.status)
                for k in self.store.steps()
                if (m := self.store.read_manifest(k)) is not None
            ]

        try:
            summaries = await asyncio.to_thread(read)
        except StorageError as e:  # a corrupt manifest: its message names the step
            raise InsufficientStorage(str(e)) from e
        except OSError as e:
            raise InsufficientStorage(f"save_path cannot be read ({e}); check the disk it is on") from e
        return StepsResponse(save_path=str(self.store.root), steps=summaries)

    async def step(self, k: int) -> StepManifest:
        """Step k's manifest; 507 naming what was lost if its records could not be written."""
        if not 1 <= k <= MAX_STEP:
            raise NotFound(f"no manifest for step {k}: steps are 1..{MAX_STEP}")
        if (unrecorded := self._unrecorded.get(k)) is not None:
            lost = "; ".join(f"{rid} ({why})" for rid, why in sorted(unrecorded.lost.items()))
            raise InsufficientStorage(
                f"step {k} could not be recorded under save_path ({unrecorded.error}): "
                f"its manifest is missing or out of date; replicas whose traces are lost: {lost or 'none reported'}. "
                "Make save_path writable, with min_free_disk_mb free, before profiling again",
            )
        try:
            m = await asyncio.to_thread(self.store.read_manifest, k)
        except StorageError as e:  # a corrupt manifest: its message names the step
            raise InsufficientStorage(str(e)) from e
        except OSError as e:
            raise InsufficientStorage(f"step {k}'s manifest cannot be read ({e})") from e
        if m is None:
            raise NotFound(f"no manifest for step {k} under save_path")
        return m
