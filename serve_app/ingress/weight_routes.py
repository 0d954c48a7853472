"""/weights/update: publish a new parameter version on every replica; and the in-cluster calls
reached through the app's DeploymentHandle instead of HTTP (weights through the object store,
the engines' own RPC)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import ray
from fastapi import Depends
from pydantic import ValidationError
from ray.serve.handle import DeploymentHandle

from profiling.config import describe_validation_error
from serve_app.api import (
    EngineRpcReport,
    ErrorResponse,
    InClusterWeightsRequest,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
)
from serve_app.errors import Refused
from serve_app.ingress.auth import require_control_token


class WeightRoutesMixin:
    controller: DeploymentHandle

    ENDPOINTS: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "update_weights": lambda app: app.post(
            "/weights/update",
            dependencies=[Depends(require_control_token)],
            responses={409: {"model": ErrorResponse}, 422: {"model": ErrorResponse}},
            tags=["weights"],
        ),
    }

    async def update_weights(self, body: UpdateWeightsRequest) -> UpdateWeightsResponse:
        """Publish `version` on every replica between engine steps, from its `source`: the file at
        `path`, a collective broadcast from the trainer's publishing rank, or the trainer's own
        transfer (external: every replica's engine must report `version`)."""
        return await self.controller.update_weights.remote(body)

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
        return await self.controller.update_weights_in_cluster.remote(req, refs)

    async def engine_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> list[EngineRpcReport]:
        """Not an HTTP route: a trainer in the same Ray cluster moving weights itself calls
        `await serve.get_app_handle(app).engine_rpc.remote(method, args, kwargs)`, which runs
        `method(*args, **kwargs)` of every replica's engine (vLLM: a method of its AsyncLLM, such as
        `collective_rpc` with a worker method), concurrently, within `timeout_s` (default the app's
        control_timeout_s). Returns one EngineRpcReport per replica: `ok`, `error`, and `result`
        (what the method returned); 503 when no replica ran it. An argument that differs per
        replica (a rank offset) comes as `PerReplica(values={replica_id: value})`. Then
        `/weights/update` with source external publishes the version (docs/design.md#weight-transfer)."""
        return await self.controller.engine_rpc.remote(method, list(args), dict(kwargs or {}), timeout_s)
