"""The control plane behind the profile and weight routes: validation, desired state, fan-out,
and the step's session record. One instance lives in the single ingress replica; one lock
serialises control calls so stop -> update -> start sequences never interleave."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.serve.handle import DeploymentHandle

from profiling.config import MAX_STEP
from profiling.manifest import SessionRecord, StepManifest
from profiling.session import SessionSpec
from profiling.store import StorageError, TraceStore
from serve_app.api import (
    InClusterWeightsRequest,
    ReplicaReport,
    StartProfileRequest,
    StartProfileResponse,
    StatusResponse,
    StepsResponse,
    StepSummary,
    StopProfileRequest,
    StopProfileResponse,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
)
from serve_app.config import AppArgs
from serve_app.desired_state import DesiredState, DesiredStateStore
from serve_app.fanout import broadcast
from serve_app.metrics import (
    CONTROL_CALL_ERRORS,
    CONTROL_ERRORS,
    CONTROL_SECONDS,
    EXPORTING_STEPS,
    observe_exports,
    observe_stop,
)
from serve_app.weights import WeightsError, resolve_weights_path

log = logging.getLogger(__name__)

START_FAILED = "start failed"
"""Prefix of a replica's error when its profiler refused the options (a caller's choice)."""


class ControlError(Exception):
    """A control call that cannot be carried out; `status` is its HTTP status."""

    def __init__(
        self,
        status: int,
        detail: str,
        replicas: list[ReplicaReport] | None = None,
        *,
        retry_after_s: int | None = None,
    ):
        super().__init__(detail)
        self.status, self.detail, self.replicas = status, detail, replicas or []
        self.retry_after_s = retry_after_s

    def __reduce__(self):
        # Crosses Ray (handle calls) intact: the default pickling would pass only `detail`.
        return (type(self), (self.status, self.detail, self.replicas), {"retry_after_s": self.retry_after_s})


class ControlPlane:
    def __init__(self, replicas: DeploymentHandle, args: AppArgs, desired: DesiredStateStore):
        self._replicas = replicas
        self._args = args
        self._desired = desired
        self.store = TraceStore(args.save_path, merge_on_complete=args.merge_on_complete)
        self._lock = asyncio.Lock()
        self._books = asyncio.Lock()  # FIFO: session/manifest writes happen in call order
        self._state: DesiredState | None = None
        self._known: set[str] = set()
        self._watchdog: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._exporting: set[int] = set()  # stopped steps whose traces are still being written
        EXPORTING_STEPS.set_function(lambda: len(self._exporting))
        self._unrecorded: dict[int, _Unrecorded] = {}
        """Steps whose records could not be written under save_path (served as 507)."""

    async def _desired_state(self) -> DesiredState:
        """The desired state; this controller is its only writer, so it is read once."""
        if self._state is None:
            self._state = await self._desired.get()
        return self._state

    async def _publish(self, state: DesiredState) -> None:
        if state.active is not None and state.active_since is None:
            # A step (re)starting: its start time travels with it, for a controller that
            # restarts mid-step, and an earlier run of the same step number no longer counts.
            state.active_since = time.time()
            self._unrecorded.pop(state.active.step, None)
        elif state.active is None:
            state.active_since = None
        self._state = state
        await self._desired.set(state)

    async def recover(self) -> None:
        """Take over from a controller that died mid-step (the ingress restarted): read the
        desired state, and re-arm the active step's max_duration_s watchdog for the time it
        has left, so a step nobody stops still ends."""
        desired = await self._desired_state()
        if desired.active is not None:
            log.info("recovered active step %s from the desired state", desired.active.step)
            self._arm_watchdog(desired.active, since=desired.active_since)

    def _bookkeep(self, step: int, fn: Callable[[], None], lost: dict[str, str] | None = None) -> None:
        """Write `step`'s session record and manifest after answering, in call order, off the
        loop. `lost`: replica id -> why its trace is missing, which the write records; if the
        write fails (save_path unwritable or full), it is kept here for GET /profile/steps/{k}."""

        async def run() -> None:
            async with self._books:
                try:
                    await asyncio.to_thread(fn)
                except OSError as e:
                    log.error("could not record step %s under %s: %s", step, self.store.root, e)
                    unrecorded = self._unrecorded.setdefault(step, _Unrecorded(error=str(e)))
                    unrecorded.error = str(e)
                    unrecorded.lost.update(lost or {})

        self._spawn(run())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _broadcast(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> list[ReplicaReport]:
        reports = await broadcast(
            self._replicas,
            method,
            *args,
            timeout_s=timeout_s or self._args.control_timeout_s,
            expected=self._known,
            **kwargs,
        )
        self._known = {r.replica_id for r in reports if r.ok or r.conflict}
        if any(not r.ok for r in reports):
            CONTROL_ERRORS.labels(method).inc(sum(not r.ok for r in reports))
        return reports

    # -- /profile/start -------------------------------------------------------------------
    async def start(self, req: StartProfileRequest) -> StartProfileResponse:
        async with self._lock, _timed("start"):
            desired = await self._desired_state()
            steps = sorted(set(req.steps or [req.step]))
            if req.step not in steps or steps != list(range(steps[0], steps[-1] + 1)):
                raise ControlError(422, f"steps {steps} must be consecutive and include step {req.step}")
            if desired.active is not None and desired.active.step != req.step:
                raise ControlError(
                    409, f"step {desired.active.step} is being profiled; stop it before starting step {req.step}"
                )
            already = desired.active is not None
            if already:
                spec = desired.active
            else:
                self._check_export_backlog(req.step)
                try:
                    self.store.check_writable(self._args.min_free_disk_mb)
                    moved = self.store.set_aside(req.step)
                except StorageError as e:
                    raise ControlError(507, str(e)) from e
                except OSError as e:
                    raise ControlError(507, f"cannot move step {req.step}'s earlier traces aside: {e}") from e
                if moved is not None:
                    log.warning("step %s was recorded before under save_path; moved that run to %s", req.step, moved)
                options = self._args.profiler.merged(
                    **req.model_dump(exclude={"step", "steps", "tag"}, exclude_none=True)
                )
                spec = SessionSpec(step=req.step, steps=steps, options=options, tag=req.tag)
                fresh = SessionRecord(
                    step=spec.step, steps=spec.steps, tool=options.tool, tag=spec.tag,
                    options=options, started_at=time.time(),
                )
                desired.active, desired.paused = spec, False
                await self._publish(desired)
            reports = await self._broadcast("start_profile", spec)
            conflicts = [r for r in reports if r.conflict]
            if conflicts and not already:
                # Roll back: the fleet is not where this start needs it.
                await self._broadcast("stop_profile", spec.step, False)
                desired.active = None
                await self._publish(desired)
                raise ControlError(409, conflicts[0].error or "replica conflict", reports)
            if not already and not any(r.ok for r in reports):
                # Nothing records this step: do not leave the fleet claiming it is active.
                desired.active = None
                await self._publish(desired)
                fresh.stopped_at = time.time()
                fresh.failures = {r.replica_id: r.error or START_FAILED for r in reports}
                async with self._books:
                    self.store.write_session(spec.step, fresh)
                    self.store.refresh_manifest(spec.step)
                refused = any((r.error or "").startswith(START_FAILED) for r in reports)
                detail = "; ".join(f"{r.replica_id}: {r.error}" for r in reports)
                raise ControlError(422 if refused else 503, f"no replica started step {spec.step}: {detail}", reports)
            joined = {r.replica_id for r in reports if r.ok}

            def record_start() -> None:
                record = self.store.read_session(spec.step) if already else fresh
                if record is not None:
                    record.replicas = sorted({*record.replicas, *joined})
                    self.store.write_session(spec.step, record)

            self._bookkeep(spec.step, record_start)
            if not already:
                self._arm_watchdog(spec)
            return StartProfileResponse(
                step=spec.step,
                steps=spec.steps,
                state="already_profiling" if already else "profiling",
                replicas=reports,
            )

    # -- /profile/stop --------------------------------------------------------------------
    async def stop(self, req: StopProfileRequest, reason: str | None = None) -> StopProfileResponse:
        async with self._lock, _timed("stop"):
            t0 = time.perf_counter()
            desired = await self._desired_state()
            if desired.active is None:
                if req.pause:
                    desired.paused = True
                    await self._publish(desired)
                    await self._broadcast("stop_profile", None, True)
                return StopProfileResponse(step=None, stopped=False)
            if desired.active.step != req.step:
                raise ControlError(409, f"step {req.step} is not being profiled (active step: {desired.active.step})")
            step = desired.active.step
            # Replicas that start from now on must not join this step: publish with the stop.
            after = desired.model_copy(update={"active": None, "paused": req.pause})
            reports, _ = await asyncio.gather(
                self._broadcast("stop_profile", step, req.pause), self._publish(after)
            )
            critical_path_s = time.perf_counter() - t0
            observe_stop(critical_path_s, reports)
            if self._watchdog is not None and reason is None:
                self._watchdog.cancel()
            self._watchdog = None
            stopped_at = time.time()

            def record_stop() -> None:
                record = self.store.read_session(step)
                if record is not None:
                    record.stopped_at = stopped_at
                    record.auto_stopped = reason
                    for r in reports:
                        if not r.ok:
                            record.failures[r.replica_id] = r.error or "stop failed"
                    for rid in set(record.replicas) - {r.replica_id for r in reports}:
                        record.failures[rid] = "replica died or was removed before the stop"
                    self.store.write_session(step, record)
                self.store.refresh_manifest(step)

            self._bookkeep(step, record_stop, {r.replica_id: r.error or "stop failed" for r in reports if not r.ok})
            self._exporting.add(step)
            self._collect_exports(step, {r.replica_id for r in reports if r.ok and r.files})
            return StopProfileResponse(
                step=step,
                stopped=True,
                replicas=reports,
                manifest=str(self.store.step_dir(step) / "manifest.json"),
                critical_path_s=critical_path_s,
            )

    def _collect_exports(self, step: int, replica_ids: set[str]) -> None:
        """In the background: wait for every replica's export; record those that failed or never finished."""

        async def collect() -> None:
            try:
                reports = await broadcast(
                    self._replicas, "export_report", step, timeout_s=self._args.export_timeout_s + 5
                )
            finally:
                self._exporting.discard(step)
            failed = {r.replica_id: r.error for r in reports if r.replica_id in replica_ids and not r.ok and r.error}
            lost = replica_ids - {r.replica_id for r in reports if r.files or r.error}
            failed.update((rid, "replica died before its trace export finished") for rid in lost)

            def record_lost() -> None:
                record = self.store.read_session(step)
                if record is not None and failed:
                    for rid, why in failed.items():
                        record.failures.setdefault(rid, why)
                    self.store.write_session(step, record)
                observe_exports(self.store.refresh_manifest(step))

            self._bookkeep(step, record_lost, failed)

        self._spawn(collect())

    def _check_export_backlog(self, step: int) -> None:
        """Refuse a new step while too many earlier steps are still exporting: each unexported
        recording holds its events in replica memory, so profiling faster than traces can be
        written would grow it without bound. The caller retries after a moment (429)."""
        limit = self._args.max_exporting_steps
        if len(self._exporting) >= limit:
            waiting = ", ".join(str(k) for k in sorted(self._exporting))
            raise ControlError(
                429,
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

    # -- /weights/update ------------------------------------------------------------------
    async def update_weights(self, req: UpdateWeightsRequest) -> UpdateWeightsResponse:
        """Load the weights at `req.path` (inside weights_dir) as `req.version` on every replica."""
        async with self._lock, _timed("update_weights"):
            desired = await self._check_version(req.version)
            try:
                path = str(resolve_weights_path(req.path, self._args.weights_dir))
            except WeightsError as e:
                raise ControlError(422, f"path: {e}") from e
            reports = await self._broadcast("update_weights", req.version, path, req.resume)
            return await self._weights_loaded(desired, req.version, req.resume, reports, path=path)

    async def update_weights_in_cluster(
        self, req: InClusterWeightsRequest, refs: list[ray.ObjectRef]
    ) -> UpdateWeightsResponse:
        """Load the state dict behind `refs[0]` (put in the object store by a trainer in the same
        Ray cluster) as `req.version` on every replica, on every node, without a shared disk."""
        async with self._lock, _timed("update_weights"):
            desired = await self._check_version(req.version)
            if len(refs) != 1 or not isinstance(refs[0], ray.ObjectRef):
                raise ControlError(422, "refs: pass [ray.put(state_dict)], a list holding one ObjectRef")
            reports = await self._broadcast("update_weights_in_cluster", req.version, refs, req.resume)
            return await self._weights_loaded(desired, req.version, req.resume, reports, refs=refs)

    async def _check_version(self, version: int) -> DesiredState:
        desired = await self._desired_state()
        if version < desired.weight_version:
            raise ControlError(409, f"version {version} is older than the served version {desired.weight_version}")
        return desired

    async def _weights_loaded(
        self,
        desired: DesiredState,
        version: int,
        resume: bool,
        reports: list[ReplicaReport],
        *,
        path: str | None = None,
        refs: list[ray.ObjectRef] | None = None,
    ) -> UpdateWeightsResponse:
        """Publish the new served version once any replica loaded it (else 422, old one serves)."""
        ok = [r for r in reports if r.ok]
        if not ok:
            detail = next((r.error for r in reports if r.error), "no replica loaded the weights")
            raise ControlError(422, f"weights not loaded, version {desired.weight_version} keeps serving: {detail}", reports)
        if refs is not None:  # before the state that points at them: joiners read both
            await self._desired.set_weights_refs(refs)
        desired.weight_version, desired.weights_path = version, path
        desired.weights_in_object_store = refs is not None
        desired.paused = not resume
        await self._publish(desired)
        return UpdateWeightsResponse(version=version, replicas=reports, load_s=max((r.load_s or 0.0) for r in ok))

    # -- reads ----------------------------------------------------------------------------
    async def status(self, timeout_s: float | None = None) -> StatusResponse:
        desired = await self._desired_state()
        reports = await self._broadcast("status", timeout_s=timeout_s)
        return StatusResponse(
            state="profiling" if desired.active else "idle",
            active_step=desired.active.step if desired.active else None,
            steps=desired.active.steps if desired.active else [],
            weight_version=desired.weight_version,
            paused=desired.paused,
            replicas=reports,
        )

    def steps(self) -> StepsResponse:
        summaries = []
        try:
            for k in self.store.steps():
                m = self.store.read_manifest(k)
                if m is not None:
                    summaries.append(StepSummary(step=k, steps=m.steps, status=m.status))
        except OSError as e:
            raise ControlError(507, f"save_path {self.store.root} cannot be read ({e}); check the disk it is on") from e
        return StepsResponse(save_path=str(self.store.root), steps=summaries)

    def step(self, k: int) -> StepManifest:
        """Step k's manifest; 507 naming what was lost if its records could not be written."""
        if not 1 <= k <= MAX_STEP:
            raise ControlError(404, f"no manifest for step {k}: steps are 1..{MAX_STEP}")
        if (unrecorded := self._unrecorded.get(k)) is not None:
            lost = "; ".join(f"{rid} ({why})" for rid, why in sorted(unrecorded.lost.items()))
            raise ControlError(
                507,
                f"step {k} could not be recorded under save_path {self.store.root} ({unrecorded.error}): "
                f"its manifest is missing or out of date; replicas whose traces are lost: {lost or 'none reported'}. "
                "Make save_path writable, with min_free_disk_mb free, before profiling again",
            )
        try:
            m = self.store.read_manifest(k)
        except OSError as e:
            raise ControlError(507, f"step {k}'s manifest cannot be read under {self.store.root} ({e})") from e
        if m is None:
            raise ControlError(404, f"no manifest for step {k} under {self.store.root}")
        return m


@dataclass
class _Unrecorded:
    """A step whose records could not be written: the last write error, and the replicas whose
    traces are lost (replica id -> why)."""

    error: str
    lost: dict[str, str] = field(default_factory=dict)


class _timed:
    """Observe a control call's latency in CONTROL_SECONDS and its error status in CONTROL_CALL_ERRORS."""

    def __init__(self, call: str):
        self._call = call

    async def __aenter__(self) -> None:
        self._t0 = time.perf_counter()

    async def __aexit__(self, *exc) -> None:
        CONTROL_SECONDS.labels(self._call).observe(time.perf_counter() - self._t0)
        if isinstance(exc[1], ControlError):
            CONTROL_CALL_ERRORS.labels(self._call, str(exc[1].status)).inc()
