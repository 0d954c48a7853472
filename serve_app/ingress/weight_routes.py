"""/weights/update: load a new parameter version on every replica."""

from __future__ import annotations

from fastapi import Depends

from serve_app.api import ErrorResponse, UpdateWeightsRequest, UpdateWeightsResponse
from serve_app.control import ControlPlane
from serve_app.ingress.auth import require_control_token


class WeightRoutesMixin:
    control: ControlPlane

    ENDPOINTS = {
        "update_weights": lambda app: app.post(
            "/weights/update",
            dependencies=[Depends(require_control_token)],
            responses={409: {"model": ErrorResponse}, 422: {"model": ErrorResponse}},
            tags=["weights"],
        ),
    }

    async def update_weights(self, body: UpdateWeightsRequest) -> UpdateWeightsResponse:
        """Load `path` as `version` on every replica between engine steps."""
        return await self.control.update_weights(body)
