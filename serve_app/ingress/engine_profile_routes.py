"""vLLM's and SGLang's `/start_profile` and `/stop_profile`, mapped onto the app's version-keyed
windows (docs/design.md#who-drives): a start profiles the step the served weights generate, a
stop ends the active one. They are a client's profiling calls, so they take the driving over
from the app's own schedule, like /profile/start and /profile/stop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from fastapi import Depends
from fastapi.responses import PlainTextResponse
from ray.serve.handle import DeploymentHandle

from serve_app.api import ErrorResponse, StopProfileRequest
from serve_app.desired_state import DesiredState
from serve_app.engine_profile_api import START_TEXT, STOP_TEXT, EngineStartProfile
from serve_app.ingress.auth import require_control_token
from serve_app.ingress.get_or_post import get_or_post

_route = {  # GET and POST: SGLang takes both, vLLM POST
    "dependencies": [Depends(require_control_token)],
    "response_class": PlainTextResponse,
    "tags": ["vllm", "sglang"],
}


class EngineProfileRoutesMixin:
    controller: DeploymentHandle

    ENDPOINTS: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "engine_start_profile": lambda app: get_or_post(
            app,
            "/start_profile",
            responses={
                409: {"model": ErrorResponse, "description": "Another step is being profiled."},
                422: {"model": ErrorResponse, "description": "A field the app cannot honour, named."},
            },
            **_route,
        ),
        "engine_stop_profile": lambda app: get_or_post(
            app, "/stop_profile", responses={409: {"model": ErrorResponse}}, **_route
        ),
    }

    async def engine_start_profile(self, body: EngineStartProfile | None = None) -> PlainTextResponse:
        """Start profiling the step that the served weights generate (version v served: step
        v+1) on every replica, as /profile/start does; the step already being profiled: nothing
        changes. vLLM's `max_iterations` and SGLang's `num_steps` bound its forward passes."""
        desired: DesiredState = await self.controller.desired_state.remote()
        await self.controller.start_profile.remote((body or EngineStartProfile()).start(desired.weight_version))
        return PlainTextResponse(START_TEXT)

    async def engine_stop_profile(self) -> PlainTextResponse:
        """Stop the step being profiled (none: nothing to do); its traces export after."""
        desired: DesiredState = await self.controller.desired_state.remote()
        if desired.active is not None:
            await self.controller.stop_profile.remote(StopProfileRequest(step=desired.active.step))
        return PlainTextResponse(STOP_TEXT)
