"""/profile/*: start, stop, status, recorded steps; each carried out by the controller."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from fastapi import Depends
from ray.serve.handle import DeploymentHandle

from profiling.manifest import StepManifest
from serve_app.api import (
    ClockResponse,
    ErrorResponse,
    ScheduleResponse,
    ScheduleSpec,
    StartProfileRequest,
    StartProfileResponse,
    StatusResponse,
    StepsResponse,
    StopProfileRequest,
    StopProfileResponse,
)
from serve_app.ingress.auth import require_control_token

_guard = {"dependencies": [Depends(require_control_token)], "tags": ["profile"]}
_errors = {
    409: {"model": ErrorResponse},
    422: {"model": ErrorResponse},
    429: {"model": ErrorResponse, "description": "Too many earlier steps still exporting; retry after Retry-After."},
    503: {"model": ErrorResponse},
    507: {"model": ErrorResponse},
}
_stop_errors = {409: {"model": ErrorResponse}, 422: {"model": ErrorResponse}}
_unreadable = {
    "model": ErrorResponse,
    "description": "save_path cannot be read, or the step's records could not be written there (names what was lost).",
}


class ProfileRoutesMixin:
    controller: DeploymentHandle

    ENDPOINTS: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "start_profile": lambda app: app.post("/profile/start", responses=_errors, **_guard),
        "stop_profile": lambda app: app.post("/profile/stop", responses=_stop_errors, **_guard),
        "set_schedule": lambda app: app.post("/profile/schedule", responses=_stop_errors, **_guard),
        "profile_status": lambda app: app.get("/profile/status", **_guard),
        "profile_clock": lambda app: app.get("/profile/clock", **_guard),
        "profile_steps": lambda app: app.get("/profile/steps", responses={507: _unreadable}, **_guard),
        "profile_step": lambda app: app.get(
            "/profile/steps/{k}", responses={404: {"model": ErrorResponse}, 507: _unreadable}, **_guard
        ),
    }

    async def start_profile(self, body: StartProfileRequest) -> StartProfileResponse:
        """Start profiling step k on every replica (idempotent for the active step)."""
        return await self.controller.start_profile.remote(body)

    async def stop_profile(self, body: StopProfileRequest) -> StopProfileResponse:
        """Stop profiling step k; answers once recording is closed, traces export after."""
        return await self.controller.stop_profile.remote(body)

    async def set_schedule(self, body: ScheduleSpec) -> ScheduleResponse:
        """Give the app its own step schedule at run time (docs/design.md#who-drives): a framework's
        plugin hands over its `global_profiler` steps; the app then drives them at every version
        published. 409 when it would replace a schedule in effect (the args', or one the run has
        begun on) or a client drives the steps."""
        return await self.controller.set_schedule.remote(body)

    async def profile_status(self) -> StatusResponse:
        """Active step, weight version, and each replica's state."""
        return await self.controller.status.remote()

    async def profile_clock(self) -> ClockResponse:
        """The app's reference clock, for a trainer's clock exchange (docs/analysis.md)."""
        return await self.controller.clock.remote()

    async def profile_steps(self) -> StepsResponse:
        """Every recorded step under save_path with its manifest status."""
        return await self.controller.steps.remote()

    async def profile_step(self, k: int) -> StepManifest:
        """One step's manifest."""
        return await self.controller.step.remote(k)
