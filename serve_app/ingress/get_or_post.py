"""A route that SGLang serves for GET and POST alike (`/start_profile`, `/flush_cache`, ...)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI


def get_or_post(app: FastAPI, path: str, **options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator that routes a handler at `path` for GET and for POST, as two routes: one
    route of both methods would give both one OpenAPI operation id (FastAPI names it by the
    route's first method, which set order picks per process)."""

    def register(handler: Callable[..., Any]) -> Callable[..., Any]:
        app.get(path, **options)(handler)
        return app.post(path, **options)(handler)

    return register
