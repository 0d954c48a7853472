"""The application builder used by `serve run|deploy config/serve.yaml` (import path
`serve_app.app:build_app`): validates the args, binds the rollout replicas, the controller and
the ingress replicas (docs/design.md#control-path)."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from pydantic import ValidationError
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from profiling.config import describe_validation_error
from serve_app.config import AppArgs
from serve_app.controller import RolloutController
from serve_app.ingress import auth, settings
from serve_app.ingress.builder import make_ingress
from serve_app.ingress.http_options import serve_http_options
from serve_app.ingress.routes import AppRoutes
from serve_app.replica import RolloutReplica

log = logging.getLogger(__name__)

CONTROL_HEADROOM = 64
"""Calls a deployment takes beyond what generation can fill: room for control calls (and for
generation calls being turned away) that never waits."""
CONTROLLER_MAX_ONGOING = 1024
"""Control calls the controller takes at once: from every ingress and every replica, never generation."""


class _Ingress(AppRoutes):
    """An ingress replica: the HTTP routes. Generation goes to the rollout replicas by the load
    balancer; every control call goes to the controller (docs/design.md#control-path), so any
    number of ingress replicas share one control plane."""

    async def __init__(self, replicas: DeploymentHandle, controller: DeploymentHandle, args: AppArgs):  # type: ignore[misc]  # Serve awaits it
        http = serve_http_options()
        http_host = None if http is None else str(http.host)
        token = settings.configure_for(args, http_host, None if http is None else http.request_timeout_s)
        auth.check_exposure(http_host, token)
        self.replicas = replicas
        self.controller = controller
        self.model_name = args.model_name
        self.request_limits = args.request_limits
        self.engine_options = args.engine_options
        self.num_replicas = args.num_replicas


RolloutIngress = make_ingress(_Ingress, AppRoutes.ROUTES)


def parse_args(args: dict[str, Any]) -> AppArgs:
    """Validate the app's args; the error names every bad key by its dotted path."""
    try:
        return AppArgs.model_validate(args)
    except ValidationError as e:
        raise ValueError(f"invalid app args: {describe_validation_error(e, 'args')}") from None


def build_app(args: dict[str, Any]) -> Application:
    """Ray Serve application builder: `args` is the `args:` block of config/serve.yaml."""
    cfg = parse_args(args)
    for note in cfg.notes():  # accepted keys that do nothing here: said once, never silently
        log.warning(note)
    if cfg.control_token_env is None and cfg.control_token_file is None:
        http = serve_http_options()
        try:
            auth.check_exposure(None if http is None else str(http.host), None)
        except auth.AccessError as e:
            raise ValueError(f"invalid app args: {e}") from None
    placement: dict[str, Any] = (
        {"max_replicas_per_node": cfg.max_replicas_per_node} if cfg.max_replicas_per_node else {}
    )
    limits = cfg.request_limits
    replicas = serve.deployment(
        name="RolloutReplica",
        num_replicas=cfg.num_replicas,
        ray_actor_options={
            "num_cpus": cfg.replica_num_cpus,
            "num_gpus": cfg.replica_num_gpus,
            **({"runtime_env": {"env_vars": cfg.replica_env}} if cfg.replica_env else {}),
        },
        # Above what generation can fill (its own gate admits it: serve_app/admission.py), so a
        # broadcast control call never waits for a generation call to finish.
        max_ongoing_requests=limits.max_ongoing_requests + limits.max_queued_requests + CONTROL_HEADROOM,
        # No bound of Serve's in front of the replicas either: their gate bounds what waits (a
        # router queue of its own would turn bursts of assignment into 503s with room to spare).
        max_queued_requests=-1,
        health_check_period_s=2,
        **placement,
    )(RolloutReplica).bind(cfg)
    controller = serve.deployment(
        name="RolloutController",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0.1},
        max_ongoing_requests=CONTROLLER_MAX_ONGOING,
    )(RolloutController).bind(replicas, cfg, uuid.uuid4().hex)
    ingress = serve.deployment(
        name="RolloutIngress",
        num_replicas=cfg.num_ingress_replicas,
        ray_actor_options={"num_cpus": 0.1},
        # Every generation call the replicas can hold, and room for control: Serve's proxy never
        # queues a control call behind generation in front of an ingress.
        max_ongoing_requests=cfg.num_replicas * (limits.max_ongoing_requests + limits.max_queued_requests)
        + CONTROL_HEADROOM,
    )(RolloutIngress)
    return ingress.bind(replicas, controller, cfg)
