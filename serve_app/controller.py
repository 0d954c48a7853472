"""The app's controller: the one replica that carries out every control call (docs/design.md#control-path).

The ingress replicas (any number of them) take the HTTP routes and forward each control call
here by handle, so the calls of every ingress meet one lock, one desired state, one watchdog and
one record of each step. Generation never reaches this deployment, so no control call queues
behind it. Each call runs to completion whatever happens to the request that asked for it
(serve_app/control/shielded.py), and the desired state is recorded durably
(serve_app/desired_state.py): a controller that restarts carries on where it stopped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

import ray
from prometheus_client import generate_latest
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import ApplicationStatus

from profiling.manifest import StepManifest
from profiling.store import StorageError, TraceStore
from serve_app.api import (
    AbortRequestsResponse,
    ClientPauseMode,
    ClockResponse,
    EngineRpcReport,
    InClusterWeightsRequest,
    IsPausedResponse,
    PauseResponse,
    Readiness,
    ReplicaReport,
    ResetPrefixCacheResponse,
    ResumeResponse,
    ScheduleResponse,
    ScheduleSpec,
    StartProfileRequest,
    StartProfileResponse,
    StatusResponse,
    StepsResponse,
    StopProfileRequest,
    StopProfileResponse,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
)
from serve_app.config import AppArgs
from serve_app.control.client_pause import ClientPauses
from serve_app.control.engine_transfer import ChunkBody, EngineTransfer
from serve_app.control.fleet import Fleet
from serve_app.control.profile_control import ProfileControl
from serve_app.control.server_schedule import ServerSchedule
from serve_app.control.shielded import ShieldedCalls
from serve_app.control.step_records import StepRecords
from serve_app.control.weight_control import WeightControl
from serve_app.desired_state import DesiredState, DesiredStateRecord
from serve_app.ingress.control_listener import ControlListener
from serve_app.ingress.http_options import serve_http_options
from serve_app.metrics import refresh_exports, refresh_fleet
from serve_app.serve_logs import quiet_serve_logs
from serve_app.trace_collection import create_collector

log = logging.getLogger(__name__)

SCRAPE_STATUS_TIMEOUT_S = 3.0
"""How long a scrape waits for the replicas' status: well under Prometheus' default 10 s scrape
timeout, so a slow or dead replica shows as `up 0` instead of failing the whole scrape."""
SCRAPE_STATUS_MAX_AGE_S = 1.0
"""Scrapes within this long of a status broadcast reuse it: many scrapers cost one broadcast."""


class RolloutController:
    """Profile and weight control of every rollout replica, for every ingress replica."""

    async def __init__(self, replicas: DeploymentHandle, args: AppArgs, deployment_id: str):  # type: ignore[misc]  # Serve awaits it
        """`deployment_id`: made by the application builder, new for each deployment of the app:
        the key of its durable desired state."""
        quiet_serve_logs()
        self._app_name = app_name = serve.get_replica_context().app_name
        self._num_replicas = args.num_replicas
        # Created here, so it lives on this node: the one whose save_path the manifests name.
        self._collector = create_collector(app_name, args.save_path) if args.trace_collection == "ray" else None
        self._fleet = Fleet(
            replicas,
            DesiredStateRecord(app_name, deployment_id),
            control_timeout_s=args.control_timeout_s,
            hold_timeout_s=args.hold_timeout_s,
        )
        await self._fleet.load(args.resume_state)
        self.records = StepRecords(
            TraceStore(args.save_path, merge_on_complete=args.merge_on_complete),
            args.min_free_disk_mb,
            args.keep_steps,
        )
        self.profile = ProfileControl(self._fleet, self.records, args)
        self.weights = WeightControl(self._fleet, args)
        self.pauses = ClientPauses(self._fleet, args)
        await self.pauses.recover()
        self.schedule = ServerSchedule(self._fleet, self.profile, args)
        self.transfer = EngineTransfer(self._fleet, self.profile, self.weights, self.schedule, args)
        await self.schedule.load()
        await self.schedule.hold_until_begun()  # before any replica reads the desired state
        self._calls = ShieldedCalls()
        # A restart mid-step resumes it (its watchdog, replicas that missed it, its record), in the
        # background: replicas that are starting wait for this constructor to answer them.
        self.records.background(self._calls.run("recover", self.profile.recover))
        self.records.background(self._calls.run("begin", self.schedule.begin))
        self._listener: ControlListener | None = None
        if (listener := args.control_listener) is not None:
            http = await asyncio.to_thread(serve_http_options)
            self._listener = ControlListener(self, args, listener, None if http is None else http.request_timeout_s)

    # -- /profile/* -----------------------------------------------------------------------------
    async def start_profile(self, req: StartProfileRequest) -> StartProfileResponse:
        self.transfer.refuse_while_open(f"starting step {req.step}")
        return await self._calls.run("start", lambda: self.profile.start(req))

    async def stop_profile(self, req: StopProfileRequest) -> StopProfileResponse:
        return await self._calls.run("stop", lambda: self.profile.stop(req))

    async def set_schedule(self, spec: ScheduleSpec) -> ScheduleResponse:
        return await self._calls.run("set_schedule", lambda: self.schedule.set(spec))

    async def status(self) -> StatusResponse:
        status = await self.profile.status()
        return status.model_copy(update={"schedule": self.schedule.spec})

    async def readiness(self) -> Readiness:
        """Whether every one of num_replicas replicas serves the served weight version."""
        return Readiness.of(await self.profile.status(), self._num_replicas)

    async def clock(self) -> ClockResponse:
        """The app's reference clock: this process's (every replica's offset is measured against it)."""
        return ClockResponse(time_ns=time.time_ns())

    async def steps(self) -> StepsResponse:
        return await self.records.steps()

    async def step(self, k: int) -> StepManifest:
        return await self.records.step(k)

    # -- /weights/* and the in-cluster calls ----------------------------------------------------
    # Every source goes around the app's own schedule, which stops and starts steps when it drives.
    async def update_weights(self, req: UpdateWeightsRequest) -> UpdateWeightsResponse:
        def update(resume: bool) -> Awaitable[UpdateWeightsResponse]:
            return self.weights.update_weights(req.model_copy(update={"resume": resume}))

        self.transfer.refuse_while_open(f"publishing version {req.version}")
        await self.weights.precheck(req.version, req.path)
        return await self._calls.run(
            "update_weights", lambda: self.schedule.around_update(req.version, req.resume, update)
        )

    async def update_weights_in_cluster(
        self, req: InClusterWeightsRequest, refs: list[ray.ObjectRef]
    ) -> UpdateWeightsResponse:
        def update(resume: bool) -> Awaitable[UpdateWeightsResponse]:
            return self.weights.update_weights_in_cluster(req.model_copy(update={"resume": resume}), refs)

        self.transfer.refuse_while_open(f"publishing version {req.version}")
        await self.weights.precheck(req.version, None)
        return await self._calls.run(
            "update_weights", lambda: self.schedule.around_update(req.version, req.resume, update)
        )

    async def engine_rpc(
        self, method: str, args: list[Any], kwargs: dict[str, Any], timeout_s: float | None
    ) -> list[EngineRpcReport]:
        # Not shielded: a trainer's own RPC, which the trainer alone knows how to repeat or undo.
        return await self.weights.engine_rpc(method, args, kwargs, timeout_s)

    # -- the engines' own weight-update group over HTTP (docs/design.md#engine-transfer) -----------
    async def transfer_init(
        self, body: dict[str, Any], rank_offset: int | None, world_size: int | None
    ) -> list[ReplicaReport]:
        """Every live replica's engine joins the trainer's group (`body`: the engine's init fields)."""
        return await self._calls.run("transfer_init", lambda: self.transfer.init(body, rank_offset, world_size))

    async def transfer_begin(self) -> list[ReplicaReport]:
        """Open one weight update through the group: the sync's stop, or its hold alone."""
        return await self._calls.run("transfer_begin", self.transfer.begin)

    async def transfer_send(self, body: ChunkBody, label: str | None) -> list[ReplicaReport]:
        """One chunk of the update into every member's engine."""
        return await self._calls.run("transfer_send", lambda: self.transfer.send(body, label))

    async def transfer_end(self, label: str | None) -> UpdateWeightsResponse:
        """Close the update, publish its version, start the next window."""
        return await self._calls.run("transfer_end", lambda: self.transfer.end(label))

    async def transfer_close(self, body: dict[str, Any]) -> list[ReplicaReport]:
        """Every member's engine leaves the trainer's group."""
        return await self._calls.run("transfer_close", lambda: self.transfer.close(body))

    # -- a client's pause (vLLM's /pause, /resume, /is_paused) ------------------------------------
    async def pause(self, mode: ClientPauseMode) -> PauseResponse:
        return await self._calls.run("pause", lambda: self.pauses.pause(mode))

    async def resume(self) -> ResumeResponse:
        return await self._calls.run("resume", self.pauses.resume)

    async def is_paused(self) -> IsPausedResponse:
        return await self.pauses.is_paused()

    async def abort_requests(self, request_ids: list[str] | None) -> AbortRequestsResponse:
        """End generation requests in flight on every replica, each answering finish_reason abort
        with the tokens sampled so far (vLLM's `/abort_requests`; SGLang's `abort_all_requests`):
        those `request_ids` names (a completion's `id`, or vLLM's request id of one of its
        prompts: docs/http_api.md#request-ids), or every one (None or empty). Nothing is paused:
        new requests are served. Refused (422) when the engine cannot abort, Unavailable (503)
        naming each replica that did not carry it out."""
        return await self._calls.run("abort_requests", lambda: self.pauses.abort(request_ids))

    async def reset_prefix_cache(self, reset_running_requests: bool, reset_external: bool) -> ResetPrefixCacheResponse:
        """Empty every replica's engine prefix cache (a client's call; every weight switch does it
        on its own)."""
        reports = await self._fleet.broadcast("reset_prefix_cache", reset_running_requests, reset_external)
        return ResetPrefixCacheResponse(success=bool(reports) and all(r.ok for r in reports), replicas=reports)

    # -- what replicas and ingresses ask ----------------------------------------------------------
    async def desired_state(self) -> DesiredState:
        """The desired state, for a replica that starts or checks that it converged."""
        return await self._fleet.desired()

    async def weights_refs(self) -> list[ray.ObjectRef]:
        """The object-store ref of the served weights (`[ref]`; empty after this controller restarted)."""
        return self._fleet.weights_refs

    async def metrics(self) -> str:
        """Prometheus text of the control plane, with the replicas' state as of now."""
        try:
            await asyncio.to_thread(refresh_exports, self.records.store)  # reads manifests: off the loop
        except (OSError, StorageError):  # save_path unreadable or a record corrupt: the export series wait
            log.exception("metrics: could not read manifests under %s", self.records.store.root)
        try:
            fleet = await self.profile.recent_status(SCRAPE_STATUS_MAX_AGE_S, timeout_s=SCRAPE_STATUS_TIMEOUT_S)
        except Exception:
            log.exception("metrics: could not read the replicas' status; serving without it")
            fleet = None
        refresh_fleet(fleet)
        return generate_latest().decode()

    async def __del__(self) -> None:
        # The durable record stays for `resume_state` (the next deployment drops it otherwise);
        # the collector goes with the app, and only with it: a controller moved off a drained
        # node leaves it to its successor.
        if self._listener is not None:
            await self._listener.close()
        if self._collector is not None and await _app_is_deleting(self._app_name):
            ray.kill(self._collector)


async def _app_is_deleting(app_name: str) -> bool:
    """Whether Serve is deleting `app_name` (also when its status cannot be read)."""
    try:
        status = await asyncio.to_thread(serve.status)
        app = status.applications.get(app_name)
        return app is None or app.status == ApplicationStatus.DELETING
    except Exception:  # noqa: BLE001 - Serve itself shutting down
        return True
