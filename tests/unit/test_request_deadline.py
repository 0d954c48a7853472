"""The operator's request timeout held by the ingress itself (serve_app/ingress/builder.py,
RequestDeadline): Serve's proxy lets a client's `x-request-timeout-seconds` lift or switch off its
own timeout, so the ingress answers 408 at `http_options.request_timeout_s` whatever the header
says. Over a real ASGI app (the ingress's FastAPI app and middleware), without Ray."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from serve_app.ingress import settings
from serve_app.ingress.builder import create_fastapi_app


@pytest.fixture
def configured() -> Iterator[None]:
    before = settings.current()
    yield
    settings.configure(before)


def _app():
    app = create_fastapi_app()

    @app.get("/slow")
    async def slow() -> dict[str, str]:
        await asyncio.sleep(2.0)
        return {"status": "done"}

    @app.get("/quick")
    async def quick() -> dict[str, str]:
        return {"status": "ok"}

    return app


async def _get(path: str, **headers: str) -> tuple[httpx.Response, float]:
    transport = httpx.ASGITransport(app=_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
        t0 = time.monotonic()
        r = await c.get(path, headers=headers)
        return r, time.monotonic() - t0


async def test_a_request_past_the_operator_s_timeout_is_answered_408_whatever_the_header(configured):
    settings.configure(settings.IngressSettings(request_timeout_s=0.3))
    for header in ("0", "3600"):  # "switch the timeout off", "lift it"
        r, took = await _get("/slow", **{"x-request-timeout-seconds": header})
        assert r.status_code == 408 and took < 1.5, (r.status_code, took)
        assert "http_options.request_timeout_s" in r.json()["detail"]
    r, _ = await _get("/quick")
    assert r.status_code == 200


async def test_without_an_operator_s_timeout_nothing_is_cut(configured):
    settings.configure(settings.IngressSettings(request_timeout_s=None))
    r, took = await _get("/slow")
    assert r.status_code == 200 and took >= 2.0
