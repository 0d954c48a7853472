"""Build the ingress deployment class from mixins and their endpoint maps (the pattern of Ray
Serve LLM's `make_fastapi_ingress`), with the guards every route shares (a loopback Host, a
bounded body) and error handlers that keep every answer a clean status with a cause: no bare
500, no server path, no remote traceback (those go to the log)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve

from serve_app.api import ErrorResponse
from serve_app.errors import ControlError
from serve_app.ingress.auth import require_loopback_host
from serve_app.ingress.settings import current

log = logging.getLogger(__name__)
EndpointMap = dict[str, Callable[[FastAPI], Callable]]
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def create_fastapi_app() -> FastAPI:
    app = FastAPI(
        title="Rollout profiler",
        description="Ray Serve rollout replicas with version-keyed profile routes.",
        dependencies=[Depends(require_loopback_host)],
    )
    app.add_middleware(BodySizeLimit)
    app.add_middleware(RequestDeadline)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for e in exc.errors():
            where = ".".join(str(p) for p in e["loc"] if p != "body") or "body"
            problems.append(f"{where}: {e['msg']}")
        return JSONResponse(status_code=422, content={"detail": "; ".join(problems), "errors": _plain(exc.errors())})

    @app.exception_handler(ControlError)
    async def _control(_: Request, exc: ControlError) -> JSONResponse:
        redact = current().redact
        if exc.status >= 500:
            log.warning("answered %s: %s", exc.status, exc.detail)
        replicas = [r.model_copy(update={"error": redact(r.error)}) if r.error else r for r in exc.replicas]
        body = ErrorResponse(detail=redact(exc.detail), replicas=replicas)
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
        return JSONResponse(status_code=exc.status, content=body.model_dump(mode="json"), headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Ray's errors carry the remote traceback in their text: its first line is the cause.
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        cause = str(getattr(exc, "cause", None) or exc).strip().splitlines()
        detail = f"{type(exc).__name__}: {cause[0] if cause else ''}"
        body = ErrorResponse(
            detail=f"the app failed this request ({current().redact(detail)}); the ingress log has the rest"
        )
        return JSONResponse(status_code=500, content=body.model_dump(mode="json"))

    return app


class BodySizeLimit:
    """Answers 413 to a request body larger than request_limits.max_body_bytes, from its
    Content-Length or as it arrives, before anything parses it."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = current().max_body_bytes
        if scope["type"] != "http" or limit is None:
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _too_large(send, limit)
            return
        received = 0

        async def bounded() -> Message:
            # A body without Content-Length is counted as it arrives; FastAPI passes an
            # HTTPException raised while it reads the body on as it is.
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                raise HTTPException(status_code=413, detail=_too_large_detail(limit))
            return message

        await self.app(scope, bounded, send)


class RequestDeadline:
    """Answers 408 to a request still running after the operator's request_timeout_s (Serve's
    `http_options`), whatever `x-request-timeout-seconds` the client sent: the proxy lets that
    header lift or switch off its own timeout. A control call cut off this way still runs to
    its end (serve_app/control/shielded.py); its repeat gets its outcome."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = current().request_timeout_s
        if scope["type"] != "http" or limit is None:
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            async with asyncio.timeout(limit):
                await self.app(scope, receive, tracked)
        except TimeoutError:
            if started:  # a stream already under way ends here
                return
            body = ErrorResponse(
                detail=f"request over the app's request timeout of {limit:g}s (http_options.request_timeout_s); "
                "a control call keeps running and its repeat answers with its outcome"
            )
            await _send_json(send, 408, body.model_dump_json().encode())


class CancelOnDisconnect:
    """Cancels a request's handler when its client goes away before the answer is sent, as
    Serve's proxy does on Serve's port (uvicorn alone lets it run): a generation nobody waits for
    stops, and its sequences are aborted in the engine. Used by the listeners, which have no
    proxy in front (serve_app/ingress/listener.py)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # After the body, one watcher reads the connection (a second reader would race it) and
        # hands the app what it read: only a disconnect can come then.
        after_body: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        watcher: asyncio.Task[None] | None = None
        answered = gone = False

        async def watch() -> None:
            nonlocal gone
            message = await receive()
            after_body.set_result(message)
            if message["type"] == "http.disconnect" and not answered and not handler.done():
                gone = True
                handler.cancel()

        async def watched_receive() -> Message:
            nonlocal watcher
            if watcher is not None:
                return await asyncio.shield(after_body)
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                watcher = asyncio.create_task(watch())
            return message

        async def watched_send(message: Message) -> None:
            nonlocal answered
            answered = answered or (message["type"] == "http.response.body" and not message.get("more_body", False))
            await send(message)

        handler: asyncio.Task[None] = asyncio.ensure_future(self.app(scope, watched_receive, watched_send))
        try:
            await handler  # a cancellation of this request's task reaches the handler too
        except asyncio.CancelledError:
            if not gone:
                raise
        finally:
            if watcher is not None:
                watcher.cancel()


def _too_large_detail(limit: int) -> str:
    return f"request body over {limit} bytes (request_limits.max_body_bytes)"


async def _too_large(send: Send, limit: int) -> None:
    await _send_json(send, 413, json.dumps({"detail": _too_large_detail(limit), "replicas": []}).encode())


async def _send_json(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


HIDDEN = "<hidden>"
"""What a 422 answer echoes in place of a secret."""


def _plain(errors: object) -> object:
    """Validation errors as JSON-safe data (their `ctx` may hold exception objects), with no
    collective transfer's `secret` echoed: neither inside an input nor as an error's input."""
    if isinstance(errors, dict):
        secret_input = tuple(errors.get("loc") or ())[-1:] == ("secret",)
        return {
            k: HIDDEN if k == "secret" or (secret_input and k == "input") else _plain(v)
            for k, v in errors.items()
            if k != "url"
        }
    if isinstance(errors, (list, tuple)):
        return [_plain(v) for v in errors]
    if isinstance(errors, float) and not math.isfinite(errors):
        return str(errors)  # JSON has no NaN/Infinity: echoing the input as-is would be a 500
    if isinstance(errors, (str, int, float, bool)) or errors is None:
        return errors
    return str(errors)


def make_ingress(cls: type, endpoint_map: EndpointMap, app: FastAPI | None = None) -> type:
    """Decorate the methods named in `endpoint_map` as routes and wrap `cls` with serve.ingress."""
    app = app or create_fastapi_app()
    routes = {name: factory(app)(getattr(cls, name)) for name, factory in endpoint_map.items()}
    routed = type(cls.__name__, (cls,), routes)
    routed.__qualname__ = cls.__qualname__
    return serve.ingress(app)(routed)
