"""The application builder used by `serve run|deploy config/serve.yaml` (import path
`serve_app.app:build_app`): validates the args, binds the replicas and the ingress."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from profiling.config import describe_validation_error
from serve_app.config import AppArgs
from serve_app.control import ControlPlane
from serve_app.desired_state import DesiredStateStore
from serve_app.ingress import auth
from serve_app.ingress.builder import make_ingress
from serve_app.ingress.openai_routes import OpenAIRoutesMixin
from serve_app.ingress.ops_routes import OpsRoutesMixin
from serve_app.ingress.profile_routes import ProfileRoutesMixin
from serve_app.ingress.weight_routes import WeightRoutesMixin
from serve_app.replica import RolloutReplica


class _Ingress(ProfileRoutesMixin, WeightRoutesMixin, OpenAIRoutesMixin, OpsRoutesMixin):
    """The single control/ingress replica: HTTP routes in front of the rollout replicas."""

    def __init__(self, replicas: DeploymentHandle, args: AppArgs):
        auth.configure(args.control_token)
        self.replicas = replicas
        self.model_name = args.model_name
        self._desired = DesiredStateStore(serve.get_replica_context().app_name)
        self.control = ControlPlane(replicas, args, self._desired)

    def __del__(self) -> None:
        # Graceful shutdown (serve shutdown, app deleted): the desired state goes with the app.
        self._desired.destroy()


RolloutIngress = make_ingress(
    _Ingress,
    {
        **ProfileRoutesMixin.ENDPOINTS,
        **WeightRoutesMixin.ENDPOINTS,
        **OpenAIRoutesMixin.ENDPOINTS,
        **OpsRoutesMixin.ENDPOINTS,
    },
)


def parse_args(args: dict[str, Any]) -> AppArgs:
    """Validate the app's args; the error names every bad key by its dotted path."""
    try:
        return AppArgs.model_validate(args)
    except ValidationError as e:
        raise ValueError(f"invalid app args: {describe_validation_error(e, 'args')}") from None


def build_app(args: dict[str, Any]) -> Application:
    """Ray Serve application builder: `args` is the `args:` block of config/serve.yaml."""
    cfg = parse_args(args)
    replicas = serve.deployment(
        RolloutReplica,
        name="RolloutReplica",
        num_replicas=cfg.num_replicas,
        ray_actor_options={
            "num_cpus": cfg.replica_num_cpus,
            "num_gpus": cfg.replica_num_gpus,
            **({"runtime_env": {"env_vars": cfg.replica_env}} if cfg.replica_env else {}),
        },
        max_ongoing_requests=256,
        health_check_period_s=2,
    ).bind(cfg)
    ingress = serve.deployment(
        RolloutIngress,
        name="RolloutIngress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0.1},
        max_ongoing_requests=512,
    )
    return ingress.bind(replicas, cfg)
