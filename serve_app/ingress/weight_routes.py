"""/weights/update: load a new parameter version on every replica; and its in-cluster form,
reached through the app's DeploymentHandle instead of HTTP."""

from __future__ import annotations

import ray
from fastapi import Depends
from pydantic import ValidationError

from profiling.config import describe_validation_error
from serve_app.api import ErrorResponse, InClusterWeightsRequest, UpdateWeightsRequest, UpdateWeightsResponse
from serve_app.control.weight_control import WeightControl
from serve_app.errors import Refused
from serve_app.ingress.auth import require_control_token


class WeightRoutesMixin:
    weight_control: WeightControl

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
        return await self.weight_control.update_weights(body)

    async def update_weights_in_cluster(
        self, version: int, refs: list[ray.ObjectRef], resume: bool = True
    ) -> UpdateWeightsResponse:
        """Not an HTTP route: a trainer in the same Ray cluster calls it through
        `serve.get_app_handle(app)` with `[ray.put(state_dict)]`, and every replica, on every
        node, fetches the weights from the object store (trainer/in_cluster.py wraps it)."""
        try:
            req = InClusterWeightsRequest(version=version, resume=resume)
        except ValidationError as e:
            raise Refused(describe_validation_error(e)) from None
        return await self.weight_control.update_weights_in_cluster(req, refs)
