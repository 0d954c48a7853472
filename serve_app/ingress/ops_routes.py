"""/health and /metrics."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from profiling.store import StorageError
from serve_app.control.profile_control import ProfileControl
from serve_app.control.step_records import StepRecords
from serve_app.metrics import refresh_exports, refresh_fleet

log = logging.getLogger(__name__)

SCRAPE_STATUS_TIMEOUT_S = 3.0
"""How long a scrape waits for the replicas' status: well under Prometheus' default 10 s scrape
timeout, so a slow or dead replica shows as `up 0` instead of failing the whole scrape."""
SCRAPE_STATUS_MAX_AGE_S = 1.0
"""Scrapes within this long of a status broadcast reuse it: many scrapers cost one broadcast."""


class OpsRoutesMixin:
    profile_control: ProfileControl
    records: StepRecords

    ENDPOINTS = {
        "health": lambda app: app.get("/health", tags=["ops"]),
        "metrics": lambda app: app.get("/metrics", tags=["ops"]),
    }

    async def health(self) -> dict[str, str]:
        """Liveness of the ingress."""
        return {"status": "ok"}

    async def metrics(self) -> Response:
        """Prometheus text exposition of the control plane, with the replicas' state as of now."""
        try:
            await asyncio.to_thread(refresh_exports, self.records.store)  # reads manifests: off the loop
        except (OSError, StorageError):  # save_path unreadable or a record corrupt: the export series wait
            log.exception("metrics: could not read manifests under %s", self.records.store.root)
        try:
            fleet = await self.profile_control.recent_status(SCRAPE_STATUS_MAX_AGE_S, timeout_s=SCRAPE_STATUS_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the counters and histograms must still be served
            log.exception("metrics: could not read the replicas' status; serving without it")
            fleet = None
        refresh_fleet(fleet)
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
