"""The control plane behind the profile and weight routes: validation, desired state, fan-out,
and the step's session record. One instance lives in the single ingress replica; one lock
serialises control calls so stop -> update -> start sequences never interleave."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from ray.serve.handle import DeploymentHandle

from profiling.config import MAX_STEP
from profiling.manifest import SessionRecord, StepManifest
from profiling.session import SessionSpec
from profiling.store import StorageError, TraceStore
from serve_app.api import (
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
from serve_app.metrics import CONTROL_CALL_ERRORS, CONTROL_ERRORS, CONTROL_SECONDS, observe_exports, observe_stop
from serve_app.weights import WeightsError, resolve_weights_path

log = logging.getLogger(__name__)

START_FAILED = "start failed"
"""Prefix of a replica's error when its profiler refused the options (a caller's choice)."""


class ControlError(Exception):
    """A control call that cannot be carried out; `status` is its HTTP status."""

    def __init__(self, status: int, detail: str, replicas: list[ReplicaReport] | None = None):
        super().__init__(detail)
        self.status, self.detail, self.replicas = status, detail, replicas or []


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

    async def _desired_state(self) -> DesiredState:
        """The desired state; this controller is its only writer, so it is read once."""
        if self._state is None:
            self._state = await self._desired.get()
        return self._state

    async def _publish(self, state: DesiredState) -> None:
        self._state = state
        await self._desired.set(state)

    def _bookkeep(self, fn: Callable[[], None]) -> None:
        """Write session records and manifests after answering, in call order, off the loop."""

        async def run() -> None:
            async with self._books:
                try:
                    await asyncio.to_thread(fn)
                except OSError as e:
                    log.error("could not record profiling bookkeeping under %s: %s", self.store.root, e)

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
                try:
                    self.store.check_writable(self._args.min_free_disk_mb)
                except StorageError as e:
                    raise ControlError(507, str(e)) from e
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

            self._bookkeep(record_start)
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

            self._bookkeep(record_stop)
            self._collect_exports(step, {r.replica_id for r in reports if r.ok and r.files})
            return StopProfileResponse(
                step=step,
                stopped=True,
                replicas=reports,
                manifest=str(self.store.step_dir(step) / "manifest.json"),
                critical_path_s=critical_path_s,
            )

    def _collect_exports(self, step: int, replica_ids: set[str]) -> None:
        """In the background: wait for every replica's export, record those that never finish."""

        async def collect() -> None:
            reports = await broadcast(
                self._replicas, "export_report", step, timeout_s=self._args.export_timeout_s + 5
            )
            lost = replica_ids - {r.replica_id for r in reports if r.files or r.error}

            def record_lost() -> None:
                record = self.store.read_session(step)
                if record is not None and lost:
                    for rid in lost:
                        record.failures.setdefault(rid, "replica died before its trace export finished")
                    self.store.write_session(step, record)
                observe_exports(self.store.refresh_manifest(step))

            self._bookkeep(record_lost)

        self._spawn(collect())

    def _arm_watchdog(self, spec: SessionSpec) -> None:
        """Stop the step after max_duration_s even if no trainer ever calls stop."""
        limit = spec.options.max_duration_s
        if limit is None:
            return

        async def expire() -> None:
            await asyncio.sleep(limit + 1.0)
            log.warning("step %s reached max_duration_s=%s; stopping it", spec.step, limit)
            try:
                await self.stop(StopProfileRequest(step=spec.step), reason="max_duration_s")
            except ControlError:
                pass  # already stopped, or another step is active

        self._watchdog = asyncio.ensure_future(expire())

    # -- /weights/update ------------------------------------------------------------------
    async def update_weights(self, req: UpdateWeightsRequest) -> UpdateWeightsResponse:
        async with self._lock, _timed("update_weights"):
            desired = await self._desired_state()
            if req.version < desired.weight_version:
                raise ControlError(
                    409, f"version {req.version} is older than the served version {desired.weight_version}"
                )
            try:
                path = str(resolve_weights_path(req.path, self._args.weights_dir))
            except WeightsError as e:
                raise ControlError(422, f"path: {e}") from e
            reports = await self._broadcast("update_weights", req.version, path, req.resume)
            ok = [r for r in reports if r.ok]
            if not ok:
                detail = next((r.error for r in reports if r.error), "no replica loaded the weights")
                raise ControlError(422, f"weights not loaded, version {desired.weight_version} keeps serving: {detail}", reports)
            desired.weight_version, desired.weights_path = req.version, path
            desired.paused = not req.resume
            await self._publish(desired)
            return UpdateWeightsResponse(
                version=req.version,
                replicas=reports,
                load_s=max((r.load_s or 0.0) for r in ok),
            )

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
        for k in self.store.steps():
            m = self.store.read_manifest(k)
            if m is not None:
                summaries.append(StepSummary(step=k, steps=m.steps, status=m.status))
        return StepsResponse(save_path=str(self.store.root), steps=summaries)

    def step(self, k: int) -> StepManifest:
        if not 1 <= k <= MAX_STEP or (m := self.store.read_manifest(k)) is None:
            raise ControlError(404, f"no manifest for step {k} under {self.store.root}")
        return m


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
