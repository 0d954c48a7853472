"""/health and /metrics."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response


class OpsRoutesMixin:
    ENDPOINTS = {
        "health": lambda app: app.get("/health", tags=["ops"]),
        "metrics": lambda app: app.get("/metrics", tags=["ops"]),
    }

    async def health(self) -> dict[str, str]:
        """Liveness of the ingress."""
        return {"status": "ok"}

    async def metrics(self) -> Response:
        """Prometheus text exposition."""
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
