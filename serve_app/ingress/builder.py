"""Build the ingress deployment class from mixins and their endpoint maps (the pattern of Ray
Serve LLM's `make_fastapi_ingress`), with error handlers that keep every answer a clean 4xx."""

from __future__ import annotations

import math
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve

from serve_app.api import ErrorResponse
from serve_app.errors import ControlError

EndpointMap = dict[str, Callable[[FastAPI], Callable]]


def create_fastapi_app() -> FastAPI:
    app = FastAPI(
        title="Rollout profiler",
        description="Ray Serve rollout replicas with version-keyed profile routes.",
    )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for e in exc.errors():
            where = ".".join(str(p) for p in e["loc"] if p != "body") or "body"
            problems.append(f"{where}: {e['msg']}")
        return JSONResponse(status_code=422, content={"detail": "; ".join(problems), "errors": _plain(exc.errors())})

    @app.exception_handler(ControlError)
    async def _control(_: Request, exc: ControlError) -> JSONResponse:
        body = ErrorResponse(detail=exc.detail, replicas=exc.replicas)
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
        return JSONResponse(status_code=exc.status, content=body.model_dump(mode="json"), headers=headers)

    return app


def _plain(errors: object) -> object:
    """Validation errors as JSON-safe data (their `ctx` may hold exception objects)."""
    if isinstance(errors, dict):
        return {k: _plain(v) for k, v in errors.items() if k != "url"}
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
