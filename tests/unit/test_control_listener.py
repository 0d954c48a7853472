"""The control listener (serve_app/ingress/control_listener.py) on its own, over real uvicorn and
HTTP on loopback: the ingress's control routes, guards and error handlers, answered in process by
a fake controller (a stand-in named as such; tests/integration/test_control_path.py drives the
real one under load). Also its config rule and a port it cannot take."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serve_app.api import StartProfileRequest, StartProfileResponse
from serve_app.app import parse_args
from serve_app.errors import Conflict
from serve_app.ingress import settings
from serve_app.ingress.control_listener import ControlListener
from serve_app.ingress.listener import ListenerError, bind
from serve_app.net import free_port

TOKEN = "a-control-token-of-24-chars"


class FakeController:
    """Stands in for RolloutController: records the starts it is handed, refuses step 9 as the
    controller refuses a start while another step is active."""

    def __init__(self) -> None:
        self.starts: list[StartProfileRequest] = []

    async def start_profile(self, req: StartProfileRequest) -> StartProfileResponse:
        if req.step == 9:
            raise Conflict("step 8 is being profiled; stop it before starting step 9")
        self.starts.append(req)
        return StartProfileResponse(step=req.step, steps=[req.step], state="profiling", replicas=[])


@pytest.fixture(autouse=True)
def _own_settings() -> Iterator[None]:
    """A listener sets this process's ingress settings: the next test gets the ones it had."""
    before = settings.current()
    yield
    settings.configure(before)


def _args(tmp_path: Path, port: int, **more: object):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    return parse_args({"control_token_file": str(token), "control_listener": {"port": port}, **more})


def test_the_listener_serves_the_control_routes_with_the_ingress_guards(tmp_path):
    port = free_port()
    fake = FakeController()

    async def scenario() -> dict[str, tuple[int, str]]:
        args = _args(tmp_path, port)
        assert args.control_listener is not None
        listener = ControlListener(fake, args, args.control_listener, request_timeout_s=None)
        answers: dict[str, tuple[int, str]] = {}
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
                auth = {"Authorization": f"Bearer {TOKEN}"}
                for name, call in {
                    "health": c.get("/health"),
                    "no token": c.post("/profile/start", json={"step": 1}),
                    "start": c.post("/profile/start", json={"step": 3}, headers=auth),
                    "conflict": c.post("/profile/start", json={"step": 9}, headers=auth),
                    "invalid": c.post("/profile/start", json={"step": "x"}, headers=auth),
                    "other host": c.get("/health", headers={"Host": "attacker.example"}),
                    "generation": c.post("/v1/completions", json={"prompt": "hi"}),
                }.items():
                    r = await call
                    answers[name] = (r.status_code, r.text)
        finally:
            await listener.close()
        return answers

    answers = asyncio.run(scenario())
    assert answers["health"] == (200, '{"status":"ok"}')
    assert answers["no token"][0] == 401 and "Bearer" in answers["no token"][1]
    assert answers["start"][0] == 200 and [r.step for r in fake.starts] == [3]
    assert answers["conflict"][0] == 409 and "stop it before starting step 9" in answers["conflict"][1]
    assert answers["invalid"][0] == 422 and "step:" in answers["invalid"][1]
    assert answers["other host"][0] == 403, "a loopback listener must refuse other Host names (DNS rebinding)"
    assert answers["generation"][0] == 404, "generation has no route on the control listener"
    with pytest.raises(httpx.ConnectError):  # closed: the port is given back
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_a_port_in_use_is_refused_naming_the_key():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ListenerError, match=rf"127\.0\.0\.1:{port} .*control_listener\.port"):
            bind("127.0.0.1", port, "control_listener")


def test_a_listener_beyond_loopback_needs_a_token(tmp_path):
    with pytest.raises(ValueError, match=r"control_listener\.host is '0\.0\.0\.0', beyond loopback.*control_token_env"):
        parse_args({"control_listener": {"host": "0.0.0.0", "port": 8001}})
    assert _args(tmp_path, 8001, control_listener={"host": "0.0.0.0", "port": 8001}).control_listener is not None
    with pytest.raises(ValueError, match=r"control_listener\.port"):
        parse_args({"control_listener": {"port": 0}})
