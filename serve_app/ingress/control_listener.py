"""The control listener: the control routes on a port of their own, served by the controller's
process (docs/design.md#control-path).

Under thousands of generation connections, Serve's proxy and the ingress replicas (one event
loop each) hold a control call among all of them before the controller sees it. This listener
takes the same routes (the ingress's own mixins, so one definition of each) straight to the
controller in the same process: no proxy, no ingress, no handle call, and no generation request
on its event loop.
"""

from __future__ import annotations

from fastapi import FastAPI

from serve_app.config import AppArgs, ListenerOptions
from serve_app.ingress import settings
from serve_app.ingress.builder import create_fastapi_app
from serve_app.ingress.listener import InProcess, Listener, bind
from serve_app.ingress.ops_routes import OpsRoutesMixin
from serve_app.ingress.profile_routes import ProfileRoutesMixin
from serve_app.ingress.weight_routes import WeightRoutesMixin


class _ControlRoutes(ProfileRoutesMixin, WeightRoutesMixin, OpsRoutesMixin):
    def __init__(self, controller: object):
        self.controller = InProcess(controller)  # type: ignore[assignment]  # the handle's call shape


def control_app(controller: object) -> FastAPI:
    """The listener's FastAPI app: the profile, weight and ops routes of the ingress, each
    answered by `controller` in this process, with the ingress's guards and error handlers."""
    app = create_fastapi_app()
    routes = _ControlRoutes(controller)
    for endpoints in (ProfileRoutesMixin.ENDPOINTS, WeightRoutesMixin.ENDPOINTS, OpsRoutesMixin.ENDPOINTS):
        for name, route in endpoints.items():
            route(app)(getattr(routes, name))
    return app


class ControlListener(Listener):
    """The control routes on `options` (the app's control_listener), served on this event loop
    until `close`."""

    def __init__(self, controller: object, args: AppArgs, options: ListenerOptions, request_timeout_s: float | None):
        """`request_timeout_s`: the operator's bound on any request (Serve's
        http_options.request_timeout_s), held here as on Serve's port. ListenerError when the
        port cannot be had."""
        # This process serves no other routes: the guards read these settings.
        settings.configure_for(args, options.host, request_timeout_s)
        sock = bind(options.host, options.port, "control_listener")
        super().__init__(control_app(controller), sock, "control listener")
