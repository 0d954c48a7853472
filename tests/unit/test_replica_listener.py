"""The replica listener's pieces on their own, over real uvicorn and HTTP on loopback
(tests/integration/test_replica_listener.py runs it in real replicas): a port its processes
share, a handler cancelled when its client goes away, the in-process handle's streams, and the
config's rules for it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from serve_app.app import parse_args
from serve_app.ingress.builder import CancelOnDisconnect
from serve_app.ingress.listener import InProcess, Listener, ListenerError, bind
from serve_app.net import free_port


def test_listeners_of_one_app_share_their_port_and_others_are_refused():
    port = free_port()
    first = bind("127.0.0.1", port, "replica_listener", shared=True)
    second = bind("127.0.0.1", port, "replica_listener", shared=True)  # the node's next replica
    try:
        with pytest.raises(ListenerError, match=rf"127\.0\.0\.1:{port} .*control_listener\.port"):
            bind("127.0.0.1", port, "control_listener")  # not shared: refused while they hold it
    finally:
        first.close()
        second.close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(ListenerError, match=r"pick a free port for replica_listener\.port"):
            bind("127.0.0.1", taken.getsockname()[1], "replica_listener", shared=True)


def test_both_processes_get_connections_on_the_shared_port():
    """Two listeners on one port (as two replicas of a node): new connections reach both."""
    port = free_port()

    def answering(name: str) -> FastAPI:
        app = FastAPI()
        app.get("/who")(lambda: name)
        return app

    async def scenario() -> set[str]:
        listeners = [
            Listener(answering(name), bind("127.0.0.1", port, "replica_listener", shared=True), name)
            for name in ("a", "b")
        ]
        try:
            seen = set()
            for _ in range(40):  # a new connection each
                async with httpx.AsyncClient(timeout=5) as c:
                    seen.add((await c.get(f"http://127.0.0.1:{port}/who")).json())
            return seen
        finally:
            for listener in listeners:
                await listener.close()

    assert asyncio.run(scenario()) == {"a", "b"}


def _held_app(started: asyncio.Event, cancelled: asyncio.Event, answer_after_s: float | None) -> FastAPI:
    app = FastAPI()
    app.add_middleware(CancelOnDisconnect)

    @app.post("/work")
    async def work(body: dict) -> dict:
        started.set()
        try:
            await asyncio.sleep(3600 if answer_after_s is None else answer_after_s)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return {"got": body}

    return app


def test_a_client_that_goes_away_cancels_the_handler():
    port = free_port()

    async def scenario() -> bool:
        started, cancelled = asyncio.Event(), asyncio.Event()
        listener = Listener(_held_app(started, cancelled, None), bind("127.0.0.1", port, "replica_listener"), "test")
        try:
            async with httpx.AsyncClient(timeout=30) as c:
                request = asyncio.create_task(c.post(f"http://127.0.0.1:{port}/work", json={"x": 1}))
                await asyncio.wait_for(started.wait(), 5)
                request.cancel()  # the client goes away: its connection closes
                with contextlib.suppress(asyncio.CancelledError):
                    await request
            await asyncio.wait_for(cancelled.wait(), 5)
            return cancelled.is_set()
        finally:
            await listener.close()

    assert asyncio.run(scenario())


def test_a_client_that_waits_gets_its_answer_and_nothing_is_cancelled():
    port = free_port()

    async def scenario() -> tuple[int, dict, bool]:
        started, cancelled = asyncio.Event(), asyncio.Event()
        listener = Listener(_held_app(started, cancelled, 0.2), bind("127.0.0.1", port, "replica_listener"), "test")
        try:
            async with httpx.AsyncClient(timeout=30) as c:
                r = await c.post(f"http://127.0.0.1:{port}/work", json={"x": [1, 2]})
            await asyncio.sleep(0.2)
            return r.status_code, r.json(), cancelled.is_set()
        finally:
            await listener.close()

    assert asyncio.run(scenario()) == (200, {"got": {"x": [1, 2]}}, False)


class _Streams:
    """Stands in for a replica's streaming method: records whether its generator was closed."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def pieces(self, n: int) -> AsyncIterator[int]:
        try:
            for i in range(n):
                yield i
                await asyncio.sleep(0)
        finally:
            self.closed.set()


def test_in_process_streams_iterate_and_a_cancel_closes_the_generator():
    async def scenario() -> tuple[list[int], int, bool]:
        target = _Streams()
        handle = InProcess(target).options(stream=True)
        whole = [x async for x in handle.pieces.remote(3)]
        target.closed.clear()
        stream = handle.pieces.remote(100)
        first = await stream.__anext__()
        stream.cancel()
        await asyncio.wait_for(target.closed.wait(), 2)
        return whole, first, target.closed.is_set()

    assert asyncio.run(scenario()) == ([0, 1, 2], 0, True)


def test_the_replica_listener_beyond_loopback_needs_a_token_and_its_own_port(tmp_path):
    with pytest.raises(ValueError, match=r"replica_listener\.host is '0\.0\.0\.0', beyond loopback.*control_token"):
        parse_args({"replica_listener": {"host": "0.0.0.0", "port": 8002}})
    token = tmp_path / "token"
    token.write_text("a-control-token-of-24-chars")
    assert parse_args(
        {"control_token_file": str(token), "replica_listener": {"host": "0.0.0.0", "port": 8002}}
    ).replica_listener
    with pytest.raises(ValueError, match=r"control_listener\.port and replica_listener\.port are both 8001"):
        parse_args({"control_listener": {"port": 8001}, "replica_listener": {"port": 8001}})
