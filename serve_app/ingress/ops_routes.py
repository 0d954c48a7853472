"""/health and /metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from prometheus_client import CONTENT_TYPE_LATEST
from ray.serve.handle import DeploymentHandle
from starlette.responses import Response


class OpsRoutesMixin:
    controller: DeploymentHandle

    ENDPOINTS: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "health": lambda app: app.get("/health", tags=["ops"]),
        "metrics": lambda app: app.get("/metrics", tags=["ops"]),
    }

    async def health(self) -> dict[str, str]:
        """Liveness of this ingress replica (answered here, never queued behind generation)."""
        return {"status": "ok"}

    async def metrics(self) -> Response:
        """Prometheus text exposition of the control plane (the controller's), with the replicas'
        state as of now."""
        return Response(await self.controller.metrics.remote(), media_type=CONTENT_TYPE_LATEST)
