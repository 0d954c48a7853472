"""Profile control behind `/profile/start`, `/profile/stop` and `/profile/status`: the active
step in the desired state, the start and stop fanned out to every replica, the step's
max_duration_s watchdog, and the export backlog (docs/design.md#status-codes)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from profiling.manifest import Driver, SessionRecord
from profiling.session import SessionSpec
from serve_app.api import (
    Outcome,
    ReplicaReport,
    StartProfileRequest,
    StartProfileResponse,
    StatusResponse,
    StopProfileRequest,
    StopProfileResponse,
)
from serve_app.config import AppArgs
from serve_app.control.capabilities import require
from serve_app.control.clock_exchange import measure_replicas
from serve_app.control.fleet import Fleet, broadcast
from serve_app.control.step_records import StepRecords
from serve_app.desired_state import DesiredState
from serve_app.engines.options import Capability
from serve_app.errors import BacklogFull, Conflict, ControlError, Refused, Unavailable
from serve_app.metrics import EXPORTING_STEPS, observe_stop, timed_call

log = logging.getLogger(__name__)


class ProfileControl:
    def __init__(self, fleet: Fleet, records: StepRecords, args: AppArgs):
        self._fleet = fleet
        self._records = records
        self._args = args
        self._watchdog: asyncio.Future[None] | None = None
        self._watched: int | None = None
        """The step the watchdog is armed for."""
        self._last_stop: tuple[StopProfileRequest, StopProfileResponse] | None = None
        """The last stop a caller made that stopped a step, and its answer: a repeat gets it again."""
        self._exporting: set[int] = set()  # stopped steps whose traces are still being written
        self._last_status: tuple[float, int, StatusResponse] | None = None
        """When the last status was read, the fleet's change count then, and the status."""
        EXPORTING_STEPS.set_function(lambda: len(self._exporting))

    async def recover(self) -> None:
        """Take over from a controller that died mid-step: re-arm the active step's
        max_duration_s watchdog for the time it has left (a step nobody stops still ends), bring
        in replicas that a start cut short never reached and write its session record if that
        start did not, and re-arm a hold's deadline (its timer went with the old controller)."""
        async with self._fleet.lock:
            desired = await self._fleet.desired()
            if desired.active is not None:
                log.info("recovered active step %s from the desired state", desired.active.step)
                await self._join(desired.active, since=desired.active_since)
            if desired.paused:
                await self._fleet.publish(desired)

    # -- /profile/start -------------------------------------------------------------------
    async def start(self, req: StartProfileRequest, driver: Driver = "client") -> StartProfileResponse:
        """Start `req.step` (the active one again: idempotent). `driver`: who asks, a client's
        call or the app's own schedule; a client's takes the driving over for good."""
        require(self._args, Capability.PROFILE)
        async with self._fleet.lock, timed_call("start"):
            desired = await self._fleet.desired()
            taking_over = driver == "client" and desired.driver != "client"
            desired.driver = "client" if desired.driver == "client" else driver
            steps = sorted(set(req.steps or [req.step]))
            # Distinct and sorted: consecutive exactly when they span len(steps) numbers.
            if req.step not in steps or steps[-1] - steps[0] + 1 != len(steps):
                raise Refused(f"steps {steps} must be consecutive and include step {req.step}")
            if taking_over:  # recorded before anything can refuse: the client drives from now on
                await self._fleet.publish(desired)
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
            record = self._session_record(spec, None)
            record.driver = driver
            desired.active, desired.paused = spec, False
            await self._fleet.publish(desired)
            self._arm_watchdog(spec)  # with the publish: whatever happens next, the step ends
            reports = await self._fleet.broadcast("start_profile", spec)
            if conflicts := [r for r in reports if r.outcome is Outcome.CONFLICT]:
                # Roll back: the fleet is not where this start needs it.
                await self._fleet.broadcast("stop_profile", spec.step, False)
                self._disarm_watchdog()
                desired.active = None
                await self._fleet.publish(desired)
                raise Conflict(conflicts[0].error or "replica conflict", reports)
            if not any(r.ok for r in reports):
                # Nothing records this step: do not leave the fleet claiming it is active.
                self._disarm_watchdog()
                desired.active = None
                await self._fleet.publish(desired)
                record.stopped_at = time.time()
                record.failures = {r.replica_id: r.error or "start failed" for r in reports}
                await self._records.failed_start(spec.step, record)
                failures = "; ".join(f"{r.replica_id}: {r.error}" for r in reports)
                detail = f"no replica started step {spec.step}: {failures}"
                refused = any(r.outcome is Outcome.REFUSED for r in reports)
                raise (Refused if refused else Unavailable)(detail, reports)
            self._records.started(spec.step, record, {r.replica_id for r in reports if r.ok})
            self._records.background(self._measure_clocks(spec.step))
            return StartProfileResponse(step=spec.step, steps=spec.steps, state="profiling", replicas=reports)

    async def _join(self, spec: SessionSpec, since: float | None = None) -> StartProfileResponse:
        """The active step again: replicas that missed it join, and what a start cut short left
        undone (the watchdog, the session record) is done now. `since`: when the step started,
        for a controller that restarted."""
        if since is None:
            since = (await self._fleet.desired()).active_since
        if self._watched != spec.step:
            self._arm_watchdog(spec, since=since)
        reports = await self._fleet.broadcast("start_profile", spec)
        self._records.started(
            spec.step, None, {r.replica_id for r in reports if r.ok}, if_missing=self._session_record(spec, since)
        )
        return StartProfileResponse(step=spec.step, steps=spec.steps, state="already_profiling", replicas=reports)

    @staticmethod
    def _session_record(spec: SessionSpec, started_at: float | None) -> SessionRecord:
        return SessionRecord(
            step=spec.step,
            steps=spec.steps,
            tool=spec.options.tool,
            tag=spec.tag,
            options=spec.options,
            started_at=started_at if started_at is not None else time.time(),
        )

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
        self._disarm_watchdog()
        limit = spec.options.max_duration_s
        if limit is None:
            return
        # One second past the limit: the replicas' own max_duration_s cap closes the recording first.
        delay = limit + 1.0 - (time.time() - since if since is not None else 0.0)

        async def expire() -> None:
            await asyncio.sleep(max(0.0, delay))
            log.warning("step %s reached max_duration_s=%s; stopping it", spec.step, limit)
            with contextlib.suppress(ControlError):  # already stopped, or another step is active
                await self.stop(StopProfileRequest(step=spec.step), reason="max_duration_s", driver=None)

        self._watchdog, self._watched = asyncio.ensure_future(expire()), spec.step

    def _disarm_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._watchdog = self._watched = None

    # -- /profile/stop --------------------------------------------------------------------
    async def stop(
        self, req: StopProfileRequest, reason: str | None = None, driver: Driver | None = "client"
    ) -> StopProfileResponse:
        """Stop `req.step`. `reason`: why the app stops it itself (its watchdog); `driver`: who
        asks (None: the app's watchdog, which drives nothing); a client's call takes the
        driving over for good."""
        require(self._args, Capability.PROFILE)
        if req.pause:
            require(self._args, Capability.PAUSE, "pause: true")
        async with self._fleet.lock, timed_call("stop"):
            t0 = time.perf_counter()
            desired = await self._fleet.desired()
            if driver == "client" and desired.driver != "client":
                desired.driver = "client"
                await self._fleet.publish(desired)
            if desired.active is None and self._last_stop is not None and self._last_stop[0] == req:
                # A repeat of the stop that stopped this step (its caller timed out or retried): its
                # answer again, and nothing else (a hold it asked for may have ended since, by design).
                return self._last_stop[1]
            if desired.active is None:
                if req.pause:
                    await self._hold(desired)
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
            if reason is None:  # the watchdog's own stop must not cancel the task running it
                self._disarm_watchdog()
            else:
                self._watchdog = self._watched = None
            self._records.stopped(step, time.time(), reason, reports)
            self._records.background(self._measure_clocks(step))
            self._exporting.add(step)
            self._records.background(self._collect_exports(step, {r.replica_id for r in reports if r.ok and r.files}))
            response = StopProfileResponse(
                step=step,
                stopped=True,
                replicas=reports,
                manifest=str(self._records.store.step_dir(step) / "manifest.json"),
                critical_path_s=critical_path_s,
            )
            self._last_stop = (req, response) if reason is None else None
            return response

    async def hold(self) -> list[ReplicaReport]:
        """Hold admission of engine steps on every replica without stopping anything (a stop's
        `pause` alone): until the next start or resuming update, or hold_timeout_s."""
        require(self._args, Capability.PAUSE, "holding generation")
        async with self._fleet.lock:
            return await self._hold(await self._fleet.desired())

    async def _hold(self, desired: DesiredState) -> list[ReplicaReport]:
        desired.paused = True
        await self._fleet.publish(desired)
        return await self._fleet.broadcast("stop_profile", None, True)

    async def _measure_clocks(self, step: int) -> None:
        """Measure every replica's clock against this controller's (the app's reference clock)
        after a start or stop has answered, and record it with the step (docs/analysis.md)."""
        offsets = await measure_replicas(self._fleet.replicas, timeout_s=self._args.control_timeout_s)
        self._records.clocks_measured(step, offsets)

    async def _collect_exports(self, step: int, replica_ids: set[str]) -> None:
        """Wait for every replica's export; record those that failed or never finished."""
        try:
            # Around Fleet.broadcast on purpose: this runs in the background, outside the fleet's
            # lock, for up to export_timeout_s, and Fleet.broadcast would overwrite the replicas the
            # locked control calls expect with what was live when it began (a replica removed
            # since would fail the next call) and count export failures as control errors; they
            # are recorded with the step instead.
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
            driver=desired.driver,
            replicas=reports,
            control_timeout_s=self._args.control_timeout_s,
        )
        self._last_status = (time.monotonic(), changes, response)
        return response
