"""The replica listener: the app's whole HTTP API served by a rollout replica on a port of its
own (docs/design.md#control-path, docs/operations.md#replica-listener).

On Serve's port a generation request crosses Serve's proxy, an ingress replica and two handle
calls before it reaches an engine, and on a small machine that CPU comes out of the engines':
under 1024 clients the app served a third of the tokens vLLM's own server did. Here the
replica's own process takes the request, as vLLM's API server does: the OpenAI routes call the
replica in this process (the ingress's own mixins, through an in-process handle), and the
control routes go to the controller by handle, as from the ingress. The replicas of one node
share the port (SO_REUSEPORT: the kernel spreads new connections over them).
"""

from __future__ import annotations

from fastapi import FastAPI
from ray.serve.handle import DeploymentHandle

from serve_app.config import AppArgs, ListenerOptions
from serve_app.engines.options import EngineOptions
from serve_app.ingress import settings
from serve_app.ingress.builder import CancelOnDisconnect, create_fastapi_app
from serve_app.ingress.listener import InProcess, Listener, bind
from serve_app.ingress.routes import AppRoutes
from serve_app.limits import RequestLimits


class _ReplicaRoutes(AppRoutes):
    def __init__(self, replica: object, controller: DeploymentHandle, args: AppArgs):
        self.replicas = InProcess(replica)  # type: ignore[assignment]  # the handle's call shape
        self.controller = controller
        self.model_name: str = args.model_name
        self.request_limits: RequestLimits = args.request_limits
        self.engine_options: EngineOptions = args.engine_options
        self.num_replicas = 1  # a request's prompts all stay in this replica


def replica_app(replica: object, controller: DeploymentHandle, args: AppArgs) -> FastAPI:
    """The listener's FastAPI app: every route of the ingress, generation answered by `replica`
    in this process, control by `controller`; with the ingress's guards and error handlers, and
    a handler cancelled when its client goes away."""
    app = create_fastapi_app()
    app.add_middleware(CancelOnDisconnect)
    routes = _ReplicaRoutes(replica, controller, args)
    for name, route in AppRoutes.ROUTES.items():
        route(app)(getattr(routes, name))
    return app


class ReplicaListener(Listener):
    """The app's routes on `options` (the app's replica_listener), served on this replica's event
    loop until `close`; shared with the node's other replicas of the app."""

    def __init__(
        self,
        replica: object,
        controller: DeploymentHandle,
        args: AppArgs,
        options: ListenerOptions,
        request_timeout_s: float | None,
    ):
        """`request_timeout_s`: the operator's bound on any request (Serve's
        http_options.request_timeout_s), held here as on Serve's port. ListenerError when the
        port cannot be had."""
        # The replica's process serves no other HTTP routes: the guards read these settings.
        settings.configure_for(args, options.host, request_timeout_s)
        sock = bind(options.host, options.port, "replica_listener", shared=True)
        super().__init__(replica_app(replica, controller, args), sock, "replica listener")
