"""The control listener: the control routes on a port of their own, served by the controller's
process (docs/design.md#control-path).

Under thousands of generation connections, Serve's proxy and the ingress replicas (one event
loop each) hold a control call among all of them before the controller sees it. This listener
takes the same routes (the ingress's own mixins, so one definition of each) straight to the
controller in the same process: no proxy, no ingress, no handle call, and no generation request
on its event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import uvicorn
from fastapi import FastAPI

from serve_app.config import AppArgs, ControlListenerOptions
from serve_app.ingress import settings
from serve_app.ingress.builder import create_fastapi_app
from serve_app.ingress.ops_routes import OpsRoutesMixin
from serve_app.ingress.profile_routes import ProfileRoutesMixin
from serve_app.ingress.weight_routes import WeightRoutesMixin

log = logging.getLogger(__name__)


class ControlListenerError(RuntimeError):
    """The control listener cannot listen where the app's args say; the message names the fix."""


class _InProcess:
    """The controller behind the handle interface the route mixins call (`x.method.remote(...)`),
    called directly: the listener runs in the controller's own process and event loop."""

    def __init__(self, controller: object):
        self._controller = controller

    def __getattr__(self, name: str) -> SimpleNamespace:
        method: Callable[..., Any] = getattr(self._controller, name)
        return SimpleNamespace(remote=method)


class _ControlRoutes(ProfileRoutesMixin, WeightRoutesMixin, OpsRoutesMixin):
    def __init__(self, controller: object):
        self.controller = _InProcess(controller)  # type: ignore[assignment]  # the handle's call shape


def control_app(controller: object) -> FastAPI:
    """The listener's FastAPI app: the profile, weight and ops routes of the ingress, each
    answered by `controller` in this process, with the ingress's guards and error handlers."""
    app = create_fastapi_app()
    routes = _ControlRoutes(controller)
    for endpoints in (ProfileRoutesMixin.ENDPOINTS, WeightRoutesMixin.ENDPOINTS, OpsRoutesMixin.ENDPOINTS):
        for name, route in endpoints.items():
            route(app)(getattr(routes, name))
    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); ControlListenerError naming the cause and the fix."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted controller rebinds at once
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ControlListenerError(
            f"the control listener cannot listen on {host}:{port} ({e.strerror}): pick a free port for "
            "control_listener.port, or an interface of the controller's node for control_listener.host"
        ) from None
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The replica's process owns its signals (uvicorn takes them where it runs on the main thread).
        yield


class ControlListener:
    """The control routes on `options` (the app's control_listener), served on this event loop
    until `close`."""

    def __init__(
        self, controller: object, args: AppArgs, options: ControlListenerOptions, request_timeout_s: float | None
    ):
        """`request_timeout_s`: the operator's bound on any request (Serve's
        http_options.request_timeout_s), held here as on Serve's port."""
        # This process serves no other routes: the guards read these settings.
        settings.configure_for(args, options.host, request_timeout_s)
        self._socket = bind(options.host, options.port)
        config = uvicorn.Config(control_app(controller), log_level="warning", access_log=False, lifespan="off")
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._socket]))
        self._task.add_done_callback(self._ended)
        log.info("control listener on %s:%d", options.host, options.port)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (e := task.exception()) is not None:
            log.error("the control listener stopped; control calls still reach Serve's port", exc_info=e)

    async def close(self) -> None:
        """Stop listening; calls under way get uvicorn's graceful shutdown."""
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._task, timeout=5)
        self._socket.close()
