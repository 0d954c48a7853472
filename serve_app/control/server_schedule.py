"""The app's own step schedule (its args' `global_profiler`, or one a framework's plugin gives it
with `POST /profile/schedule`): the server drives the profiled steps at every version change it
sees, whichever route brought it, for frameworks that never call /profile/*
(docs/design.md#who-drives).

It makes the calls this project's trainer client makes (docs/design.md#sync-order), from the
same `StepSchedule`: at the update that publishes version k, it stops the window ending at k
with the hold, loads the weights, and starts the window beginning at k+1 before generation
resumes. A client's /profile/start or /profile/stop takes the driving over for good: from then
on this schedule does nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Literal

from profiling.schedule import StepSchedule
from serve_app.api import (
    ScheduleActions,
    ScheduleResponse,
    ScheduleSpec,
    StartProfileRequest,
    StopProfileRequest,
    UpdateWeightsResponse,
)
from serve_app.config import AppArgs
from serve_app.control.fleet import Fleet
from serve_app.control.profile_control import ProfileControl
from serve_app.desired_state import DesiredState
from serve_app.errors import BacklogFull, Conflict, ControlError

log = logging.getLogger(__name__)

BEGIN_POLL_S = 0.5
"""How often the first window's start looks for the replicas while they start."""

Update = Callable[[bool], Awaitable[UpdateWeightsResponse]]
"""A weight update of any source, given whether it resumes generation when it is done."""


class ServerSchedule:
    """The steps of `global_profiler`, started and stopped by the app itself."""

    def __init__(self, fleet: Fleet, profile: ProfileControl, args: AppArgs):
        cfg = args.global_profiler
        # verl's block may name no steps, or tool: null (off): then the app drives nothing.
        self._from_args = (
            ScheduleSpec(steps=cfg.steps or [], profile_continuous_steps=cfg.profile_continuous_steps)
            if cfg and cfg.drives
            else None
        )
        self._spec: ScheduleSpec | None = self._from_args
        self._schedule = _schedule_of(self._spec)
        self._fleet = fleet
        self._profile = profile
        self._args = args
        self._sync = asyncio.Lock()
        """One update's stop -> load -> start at a time."""

    @property
    def spec(self) -> ScheduleSpec | None:
        """The schedule the app drives by (None: none)."""
        return self._spec

    async def load(self) -> None:
        """At the controller's start: a schedule a request gave this deployment before (the
        controller restarted) is its schedule again."""
        if self._from_args is None and (given := (await self._fleet.desired()).schedule) is not None:
            self._use(given)

    async def set(self, spec: ScheduleSpec) -> ScheduleResponse:
        """Drive by `spec` from now on (`POST /profile/schedule`): a framework's plugin hands the
        app its own `global_profiler` at run time. The same schedule again changes nothing. Refused
        (409) when it differs from the args' schedule, when a client drives the steps, and once a
        schedule has moved a step or the served version (the run has begun on it). On a fresh
        deployment whose schedule profiles step 1, answers once step 1 started, under the hold,
        as at a deployment with the schedule in its args."""
        async with self._sync:
            desired = await self._fleet.desired()
            given_by = self._check_settable(spec, desired)
            if self._spec != spec:
                async with self._fleet.lock:
                    desired = await self._fleet.desired()
                    desired.schedule = spec
                    await self._fleet.publish(desired)
                self._use(spec)
        await self.hold_until_begun()
        await self.begin()
        desired = await self._fleet.desired()
        return ScheduleResponse(
            schedule=spec,
            given_by=given_by,
            driver=desired.driver,
            active_step=desired.active.step if desired.active else None,
            weight_version=desired.weight_version,
        )

    def _check_settable(self, spec: ScheduleSpec, desired: DesiredState) -> Literal["args", "request"]:
        """Where the schedule in effect after `set(spec)` comes from; Conflict when `spec` cannot
        replace the one in effect."""
        if self._from_args is not None:
            if spec != self._from_args:
                raise Conflict(
                    f"the app's args give its schedule (global_profiler steps {self._from_args.steps}, "
                    f"profile_continuous_steps {self._from_args.profile_continuous_steps}), and a request "
                    f"asks for steps {spec.steps}, profile_continuous_steps {spec.profile_continuous_steps}: "
                    "give the schedule in one place, remove global_profiler from the app's args or make both agree"
                )
            return "args"
        if desired.driver == "client":
            raise Conflict(
                "a client drives the steps (it called /profile/start or /profile/stop), so the app runs no "
                "schedule of its own: drive the steps from one side (docs/design.md#who-drives)"
            )
        begun = desired.driver is not None or desired.weight_version != 0 or desired.active is not None
        if self._spec is not None and spec != self._spec and begun:
            raise Conflict(
                f"the app drives by steps {self._spec.steps} (profile_continuous_steps "
                f"{self._spec.profile_continuous_steps}) and the run has begun on them (weight version "
                f"{desired.weight_version}): a schedule is changed only before its first step or version; "
                "deploy the app anew for a new schedule"
            )
        return "request"

    def _use(self, spec: ScheduleSpec) -> None:
        self._spec = spec
        self._schedule = _schedule_of(spec)

    async def driving(self) -> bool:
        """Whether the app drives the steps: it has a schedule and no client took over."""
        return self._schedule is not None and (await self._fleet.desired()).driver != "client"

    def _first_window(self) -> int | None:
        return None if self._schedule is None else self._schedule.begin()

    async def hold_until_begun(self) -> None:
        """At a fresh deployment whose schedule profiles step 1: hold generation (the sync's
        hold, bounded by hold_timeout_s) until `begin` starts it, so no forward pass on the
        initial weights runs before step 1's window. Replicas that start read the hold."""
        desired = await self._fleet.desired()
        fresh = desired.driver is None and desired.weight_version == 0 and desired.active is None
        if self._first_window() is None or not fresh or desired.paused:
            return
        async with self._fleet.lock:
            desired.paused = True
            await self._fleet.publish(desired)

    async def begin(self) -> None:
        """Start the first window (step 1, on the initial weights) once every replica runs; in
        the background of the controller's start. Nothing when a client drives meanwhile."""
        label = self._first_window()
        if label is None:
            return
        last_log = time.monotonic()
        while True:
            desired = await self._fleet.desired()
            if desired.driver is not None or desired.weight_version != 0 or desired.active is not None:
                return  # begun already (a restarted controller), or a client drives
            running = [r for r in await self._fleet.broadcast("status") if r.ok]
            if len(running) >= self._args.num_replicas:
                break
            if time.monotonic() - last_log > 30:
                last_log = time.monotonic()
                log.info(
                    "global_profiler: %s of %s replicas running; step 1 starts when all are",
                    len(running),
                    self._args.num_replicas,
                )
            await asyncio.sleep(BEGIN_POLL_S)
        async with self._sync:
            if await self.driving() and (await self._fleet.desired()).active is None:
                await self._start(label)  # a failure is logged there

    async def around_update(self, version: int, resume: bool, update: Update) -> UpdateWeightsResponse:
        """Run a weight update publishing `version` (`resume`: what its caller asked), with the
        schedule's stop before it and start after it when the app drives."""
        if not await self.driving():
            return await update(resume)
        async with self._sync:
            if version <= (await self._fleet.desired()).weight_version:
                return await update(resume)  # a repeat or a stale version: its own answer, no step moves
            actions = ScheduleActions(stopped_step=await self._stop_ending(version))
            try:
                response = await update(resume and self._starting(version, await self._fleet.desired()) is None)
            except BaseException:
                if actions.stopped_step is not None:  # not published: generation goes on, on the old version
                    await self.release()
                raise
            response.schedule = await self._start_beginning(version, actions)
            return response

    async def stop_ending(self, version: int) -> int | None:
        """When the app drives: stop the window that publishing `version` ends, with the hold
        (the first half of `around_update`, for an update that arrives in several calls); the
        step stopped, or None."""
        if not await self.driving():
            return None
        async with self._sync:
            return await self._stop_ending(version)

    async def start_beginning(self, version: int, actions: ScheduleActions) -> ScheduleActions | None:
        """When the app drives: after `version` was published, start the window beginning at
        `version` + 1 (it ends the hold); `actions` with what was started, or why not. None: the
        app does not drive (nothing started, the hold stays)."""
        if not await self.driving():
            return None
        async with self._sync:
            return await self._start_beginning(version, actions)

    async def _stop_ending(self, version: int) -> int | None:
        assert self._schedule is not None  # driving() says so
        desired = await self._fleet.desired()
        active = desired.active.steps if desired.active is not None else None
        plan = self._schedule.on_publish(version, active)
        if plan.stop_step is None:
            return None
        await self._profile.stop(StopProfileRequest(step=plan.stop_step, pause=True), driver="server")
        return plan.stop_step

    def _starting(self, version: int, desired: DesiredState) -> int | None:
        """The window the publication of `version` starts, as things stand."""
        assert self._schedule is not None
        active = desired.active.steps if desired.active is not None else None
        return self._schedule.on_publish(version, active).start_step

    async def _start_beginning(self, version: int, actions: ScheduleActions) -> ScheduleActions:
        label = self._starting(version, await self._fleet.desired())
        if label is not None:
            actions.error = await self._start(label)
            actions.started_step = None if actions.error else label
        return actions

    async def _start(self, label: int) -> str | None:
        """Start the window labelled `label` (it ends the hold); None, or why it did not start,
        after which the hold is ended anyway (generation must not wait for a window that will
        not come). A full export backlog is waited out for up to control_timeout_s."""
        assert self._schedule is not None
        steps = list(self._schedule.window_steps(label))
        req = StartProfileRequest(step=label, steps=steps if len(steps) > 1 else None)
        deadline = time.monotonic() + self._args.control_timeout_s
        while True:
            try:
                await self._profile.start(req, driver="server")
                return None
            except BacklogFull as e:
                wait_s = e.retry_after_s or 1
                if time.monotonic() + wait_s > deadline:
                    why = f"step {label} did not start: {e}"
                    break
                await asyncio.sleep(wait_s)
            except ControlError as e:
                why = f"step {label} did not start: {e}"
                break
        log.warning("global_profiler: %s", why)
        await self.release()
        return why

    async def release(self) -> None:
        """End the sync's hold on every replica and in the desired state."""
        async with self._fleet.lock:
            desired = await self._fleet.desired()
            desired.paused = False
            await self._fleet.publish(desired)
            await self._fleet.broadcast("release_hold")


def _schedule_of(spec: ScheduleSpec | None) -> StepSchedule | None:
    return None if spec is None else StepSchedule(spec.steps, spec.profile_continuous_steps)
