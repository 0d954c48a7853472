"""Profile control behind `/profile/start`, `/profile/stop` and `/profile/status`: the active
step in the desired state, the start and stop fanned out to every replica, the step's
max_duration_s watchdog, and the export backlog (docs/design.md#status-codes)."""

from __future__ import annotations

import asyncio
import logging
import time

from profiling.manifest import SessionRecord
from profiling.session import SessionSpec
from serve_app.api import (
    StartProfileRequest,
    StartProfileResponse,
    StatusResponse,
    StopProfileRequest,
    StopProfileResponse,
)
from serve_app.config import AppArgs
from serve_app.control.clock_exchange import measure_replicas
from serve_app.control.fleet import Fleet, broadcast
from serve_app.control.step_records import StepRecords
from serve_app.errors import BacklogFull, Conflict, ControlError, Refused, Unavailable
from serve_app.metrics import EXPORTING_STEPS, observe_stop, timed_call

log = logging.getLogger(__name__)


class ProfileControl:
    def __init__(self, fleet: Fleet, records: StepRecords, args: AppArgs):
        self._fleet = fleet
        self._records = records
        self._args = args
        self._watchdog: asyncio.Task[None] | None = None
        self._exporting: set[int] = set()  # stopped steps whose traces are still being written
        self._last_status: tuple[float, int, StatusResponse] | None = None
        """When the last status was read, the fleet's change count then, and the status."""
        EXPORTING_STEPS.set_function(lambda: len(self._exporting))

    async def recover(self) -> None:
        """Take over from a controller that died mid-step (the ingress restarted): re-arm the
        active step's max_duration_s watchdog for the time it has left, so a step nobody stops
        still ends."""
        desired = await self._fleet.desired()
        if desired.active is not None:
            log.info("recovered active step %s from the desired state", desired.active.step)
            self._arm_watchdog(desired.active, since=desired.active_since)
        if desired.paused:  # its hold timer went with the old controller
            await self._fleet.publish(desired)

    # -- /profile/start -------------------------------------------------------------------
    async def start(self, req: StartProfileRequest) -> StartProfileResponse:
        async with self._fleet.lock, timed_call("start"):
            desired = await self._fleet.desired()
            steps = sorted(set(req.steps or [req.step]))
            # Distinct and sorted: consecutive exactly when they span len(steps) numbers.
            if req.step not in steps or steps[-1] - steps[0] + 1 != len(steps):
                raise Refused(f"steps {steps} must be consecutive and include step {req.step}")
            if desired.active is not None and desired.active.step != req.step:
                raise Conflict(f"step {desired.active.step} is being profiled; stop it before starting step {req.step}")
            if desired.active is not None:  # the active step again: idempotent, joins replicas that missed it
                return await self._join(desired.active)
            options = self._args.profiler.merged(**req.model_dump(exclude={"step", "steps", "tag"}, exclude_none=True))
            if problems := self._args.start_limits.problems(options):
                raise Refused("; ".join(problems) + ": ask for less, or raise the app's start_limits")
            self._check_export_backlog(req.step)
            await self._records.prepare(req.step)
            spec = SessionSpec(step=req.step, steps=steps, options=options, tag=req.tag)
            record = SessionRecord(
                step=spec.step, steps=spec.steps, tool=options.tool, tag=spec.tag, options=options, started_at=time.time()
            )
            desired.active, desired.paused = spec, False
            await self._fleet.publish(desired)
            reports = await self._fleet.broadcast("start_profile", spec)
            if conflicts := [r for r in reports if r.conflict]:
                # Roll back: the fleet is not where this start needs it.
                await self._fleet.broadcast("stop_profile", spec.step, False)
                desired.active = None
                await self._fleet.publish(desired)
                raise Conflict(conflicts[0].error or "replica conflict", reports)
            if not any(r.ok for r in reports):
                # Nothing records this step: do not leave the fleet claiming it is active.
                desired.active = None
                await self._fleet.publish(desired)
                record.stopped_at = time.time()
                record.failures = {r.replica_id: r.error or "start failed" for r in reports}
                await self._records.failed_start(spec.step, record)
                detail = f"no replica started step {spec.step}: " + "; ".join(f"{r.replica_id}: {r.error}" for r in reports)
                raise (Refused if any(r.refused for r in reports) else Unavailable)(detail, reports)
            self._records.started(spec.step, record, {r.replica_id for r in reports if r.ok})
            self._records.background(self._measure_clocks(spec.step))
            self._arm_watchdog(spec)
            return StartProfileResponse(step=spec.step, steps=spec.steps, state="profiling", replicas=reports)

    async def _join(self, spec: SessionSpec) -> StartProfileResponse:
        reports = await self._fleet.broadcast("start_profile", spec)
        self._records.started(spec.step, None, {r.replica_id for r in reports if r.ok})
        return StartProfileResponse(step=spec.step, steps=spec.steps, state="already_profiling", replicas=reports)

    def _check_export_backlog(self, step: int) -> None:
        """Refuse a new step while too many earlier steps are still exporting: each unexported
        recording holds its events in replica memory, so profiling faster than traces can be
        written would grow it without bound. The caller retries after a moment (429)."""
        limit = self._args.max_exporting_steps
        if len(self._exporting) >= limit:
            waiting = ", ".join(str(k) for k in sorted(self._exporting))
            raise BacklogFull(
                f"export backlog full: the traces of steps {waiting} are still being written "
                f"(max_exporting_steps={limit}); retry the start of step {step} after Retry-After "
                "seconds, or raise max_exporting_steps if replicas have memory to spare",
                retry_after_s=1,
            )

    def _arm_watchdog(self, spec: SessionSpec, since: float | None = None) -> None:
        """Stop the step after max_duration_s even if no trainer ever calls stop; `since`:
        when the step started (unix seconds), if before now."""
        limit = spec.options.max_duration_s
        if limit is None:
            return
        # One second past the limit: the replicas' own max_duration_s cap closes the recording first.
        delay = limit + 1.0 - (time.time() - since if since is not None else 0.0)

        async def expire() -> None:
            await asyncio.sleep(max(0.0, delay))
            log.warning("step %s reached max_duration_s=%s; stopping it", spec.step, limit)
            try:
                await self.stop(StopProfileRequest(step=spec.step), reason="max_duration_s")
            except ControlError:
                pass  # already stopped, or another step is active

        self._watchdog = asyncio.ensure_future(expire())

    # -- /profile/stop --------------------------------------------------------------------
    async def stop(self, req: StopProfileRequest, reason: str | None = None) -> StopProfileResponse:
        async with self._fleet.lock, timed_call("stop"):
            t0 = time.perf_counter()
            desired = await self._fleet.desired()
            if desired.active is None:
                if req.pause:
                    desired.paused = True
                    await self._fleet.publish(desired)
                    await self._fleet.broadcast("stop_profile", None, True)
                return StopProfileResponse(step=None, stopped=False)
            if desired.active.step != req.step:
                raise Conflict(f"step {req.step} is not being profiled (active step: {desired.active.step})")
            step = desired.active.step
            # Replicas that start from now on must not join this step: publish with the stop.
            after = desired.model_copy(update={"active": None, "paused": req.pause})
            reports, _ = await asyncio.gather(
                self._fleet.broadcast("stop_profile", step, req.pause), self._fleet.publish(after)
            )
            critical_path_s = time.perf_counter() - t0
            observe_stop(critical_path_s, reports)
            if self._watchdog is not None and reason is None:
                self._watchdog.cancel()
            self._watchdog = None
            self._records.stopped(step, time.time(), reason, reports)
            self._records.background(self._measure_clocks(step))
            self._exporting.add(step)
            self._records.background(self._collect_exports(step, {r.replica_id for r in reports if r.ok and r.files}))
            return StopProfileResponse(
                step=step,
                stopped=True,
                replicas=reports,
                manifest=str(self._records.store.step_dir(step) / "manifest.json"),
                critical_path_s=critical_path_s,
            )

    async def _measure_clocks(self, step: int) -> None:
        """Measure every replica's clock against this controller's (the app's reference clock)
        after a start or stop has answered, and record it with the step (docs/analysis.md)."""
        offsets = await measure_replicas(self._fleet.replicas, timeout_s=self._args.control_timeout_s)
        self._records.clocks_measured(step, offsets)

    async def _collect_exports(self, step: int, replica_ids: set[str]) -> None:
        """Wait for every replica's export; record those that failed or never finished."""
        try:
            reports = await broadcast(
                self._fleet.replicas, "export_report", step, timeout_s=self._args.export_timeout_s + 5
            )
        finally:
            self._exporting.discard(step)
        failed = {r.replica_id: r.error for r in reports if r.replica_id in replica_ids and not r.ok and r.error}
        lost = replica_ids - {r.replica_id for r in reports if r.files or r.error}
        failed.update((rid, "replica died before its trace export finished") for rid in lost)
        self._records.exported(step, failed)

    # -- /profile/status ------------------------------------------------------------------
    async def recent_status(self, max_age_s: float, timeout_s: float | None = None) -> StatusResponse:
        """A status at most `max_age_s` old and read since the last start, stop or weight update:
        one broadcast serves every caller in that time."""
        if self._last_status is not None:
            read_at, changes, cached = self._last_status
            if changes == self._fleet.changes and time.monotonic() - read_at <= max_age_s:
                return cached
        return await self.status(timeout_s)

    async def status(self, timeout_s: float | None = None) -> StatusResponse:
        changes = self._fleet.changes  # before the broadcast: a change during it makes this stale
        desired = await self._fleet.desired()
        reports = await self._fleet.broadcast("status", timeout_s=timeout_s)
        response = StatusResponse(
            state="profiling" if desired.active else "idle",
            active_step=desired.active.step if desired.active else None,
            steps=desired.active.steps if desired.active else [],
            weight_version=desired.weight_version,
            paused=desired.paused,
            replicas=reports,
        )
        self._last_status = (time.monotonic(), changes, response)
        return response
