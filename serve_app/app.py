"""The application builder used by `serve run|deploy config/serve.yaml` (import path
`serve_app.app:build_app`): validates the args, binds the replicas and the ingress."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from pydantic import ValidationError
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import ApplicationStatus

from profiling.config import describe_validation_error
from profiling.store import TraceStore
from serve_app.config import AppArgs
from serve_app.control.fleet import Fleet
from serve_app.control.profile_control import ProfileControl
from serve_app.control.step_records import StepRecords
from serve_app.control.weight_control import WeightControl
from serve_app.desired_state import DesiredStateStore
from serve_app.ingress import auth, settings
from serve_app.ingress.builder import make_ingress
from serve_app.ingress.openai_routes import OpenAIRoutesMixin
from serve_app.ingress.ops_routes import OpsRoutesMixin
from serve_app.ingress.profile_routes import ProfileRoutesMixin
from serve_app.ingress.weight_routes import WeightRoutesMixin
from serve_app.redact import app_redactor
from serve_app.replica import RolloutReplica
from serve_app.trace_collection import create_collector

log = logging.getLogger(__name__)


class _Ingress(ProfileRoutesMixin, WeightRoutesMixin, OpenAIRoutesMixin, OpsRoutesMixin):
    """The single control/ingress replica: HTTP routes in front of the rollout replicas."""

    async def __init__(self, replicas: DeploymentHandle, args: AppArgs):  # type: ignore[misc]  # Serve awaits it
        token = args.read_control_token()
        http_host = serve_http_host()
        auth.check_exposure(http_host, token)
        settings.configure(
            settings.IngressSettings(
                access=settings.Access(token=token, loopback_only=http_host is not None and auth.is_loopback(http_host)),
                max_body_bytes=args.request_limits.max_body_bytes,
                redact=app_redactor(args),
            )
        )
        self.replicas = replicas
        self.model_name = args.model_name
        self.request_limits = args.request_limits
        self.engine_options = args.engine_options
        self.num_replicas = args.num_replicas
        self._app_name = app_name = serve.get_replica_context().app_name
        self._desired = DesiredStateStore(app_name)
        # Created here, so it lives on this node: the one whose save_path the manifests name.
        self._collector = create_collector(app_name, args.save_path) if args.trace_collection == "ray" else None
        fleet = Fleet(
            replicas, self._desired, control_timeout_s=args.control_timeout_s, hold_timeout_s=args.hold_timeout_s
        )
        self.records = StepRecords(
            TraceStore(args.save_path, merge_on_complete=args.merge_on_complete),
            args.min_free_disk_mb,
            args.keep_steps,
        )
        self.profile_control = ProfileControl(fleet, self.records, args)
        self.weight_control = WeightControl(fleet, args)
        await self.profile_control.recover()  # a restart mid-step resumes it (and its watchdog)

    async def __del__(self) -> None:
        # Graceful shutdown. The app's actors go with the app, but only with it: an ingress
        # moved off a drained node, while the replicas keep their weights and their step, must
        # leave the desired state to its successor.
        if not await _app_is_deleting(self._app_name):
            log.info("ingress stopping while app %s lives on: keeping its desired state", self._app_name)
            return
        self._desired.destroy()
        if self._collector is not None:
            ray.kill(self._collector)


async def _app_is_deleting(app_name: str) -> bool:
    """Whether Serve is deleting `app_name` (also when its status cannot be read: a stale
    desired state inherited by the next app of that name would be the worse mistake)."""
    try:
        status = await asyncio.to_thread(serve.status)
        app = status.applications.get(app_name)
        return app is None or app.status == ApplicationStatus.DELETING
    except Exception:  # noqa: BLE001 - Serve itself shutting down
        return True


RolloutIngress = make_ingress(
    _Ingress,
    {
        **ProfileRoutesMixin.ENDPOINTS,
        **WeightRoutesMixin.ENDPOINTS,
        **OpenAIRoutesMixin.ENDPOINTS,
        **OpsRoutesMixin.ENDPOINTS,
    },
)


def serve_http_host() -> str | None:
    """The host Serve's HTTP proxies bind, when a Serve controller is reachable from here (the
    builder of `serve run config.yaml` and `serve deploy` runs where it is; None elsewhere)."""
    if not ray.is_initialized():
        return None
    from ray.serve.context import _get_global_client  # no public API reads the HTTP options

    try:
        client = _get_global_client(raise_if_no_controller_running=False)
    except Exception:  # noqa: BLE001 - no controller to ask: the ingress checks again when it starts
        return None
    return None if client is None else str(client.http_config.host)


def parse_args(args: dict[str, Any]) -> AppArgs:
    """Validate the app's args; the error names every bad key by its dotted path."""
    try:
        return AppArgs.model_validate(args)
    except ValidationError as e:
        raise ValueError(f"invalid app args: {describe_validation_error(e, 'args')}") from None


def build_app(args: dict[str, Any]) -> Application:
    """Ray Serve application builder: `args` is the `args:` block of config/serve.yaml."""
    cfg = parse_args(args)
    if cfg.control_token_env is None and cfg.control_token_file is None:
        try:
            auth.check_exposure(serve_http_host(), None)
        except auth.AccessError as e:
            raise ValueError(f"invalid app args: {e}") from None
    placement: dict[str, Any] = (
        {"max_replicas_per_node": cfg.max_replicas_per_node} if cfg.max_replicas_per_node else {}
    )
    replicas = serve.deployment(
        name="RolloutReplica",
        num_replicas=cfg.num_replicas,
        ray_actor_options={
            "num_cpus": cfg.replica_num_cpus,
            "num_gpus": cfg.replica_num_gpus,
            **({"runtime_env": {"env_vars": cfg.replica_env}} if cfg.replica_env else {}),
        },
        max_ongoing_requests=cfg.request_limits.max_ongoing_requests,
        max_queued_requests=cfg.request_limits.max_queued_requests,
        health_check_period_s=2,
        **placement,
    )(RolloutReplica).bind(cfg)
    ingress = serve.deployment(
        name="RolloutIngress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0.1},
        max_ongoing_requests=512,
    )(RolloutIngress)
    return ingress.bind(replicas, cfg)
