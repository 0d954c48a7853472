"""/health, /ready and /metrics."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ClassVar

from prometheus_client import CONTENT_TYPE_LATEST
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.responses import JSONResponse, Response

from serve_app.api import Readiness
from serve_app.ingress.settings import current

log = logging.getLogger(__name__)


class OpsRoutesMixin:
    controller: DeploymentHandle

    ENDPOINTS: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "health": lambda app: app.get("/health", tags=["ops"]),
        "ready": lambda app: app.get(
            "/ready",
            response_model=Readiness,
            responses={
                503: {
                    "model": Readiness,
                    "description": "Not every replica serves yet (each named), or the controller does not answer "
                    "({detail}: it is restarting).",
                }
            },
            tags=["ops"],
        ),
        "metrics": lambda app: app.get("/metrics", tags=["ops"]),
    }

    async def health(self) -> dict[str, str]:
        """Liveness of this ingress replica (answered here, never queued behind generation)."""
        return {"status": "ok"}

    async def ready(self) -> JSONResponse:
        """Readiness, for probes (Docker's HEALTHCHECK, Kubernetes' readinessProbe): 200 once
        every one of num_replicas replicas answers on the served weight version; 503 before
        then, and while a replica is down or loading the served version, naming each. A sync's
        hold does not make it 503 (docs/operations.md#readiness)."""
        try:
            readiness: Readiness = await self.controller.readiness.remote()
        except (RayActorError, ActorUnavailableError, DeploymentUnavailableError) as e:  # restarting: not ready
            log.warning("readiness: the app's controller did not answer (%s)", type(e).__name__)
            return JSONResponse({"detail": "the app's controller did not answer: it may be restarting"}, 503)
        # A replica's error may name a server path: redacted, as in every answer.
        readiness.waiting_for = [current().redact(line) for line in readiness.waiting_for]
        return JSONResponse(readiness.model_dump(), status_code=200 if readiness.ready else 503)

    async def metrics(self) -> Response:
        """Prometheus text exposition of the control plane (the controller's), with the replicas'
        state as of now."""
        return Response(await self.controller.metrics.remote(), media_type=CONTENT_TYPE_LATEST)
