"""An HTTP listener inside an app process (the controller's, a rollout replica's), beside Serve's
proxy: the socket, the uvicorn server on the process's own event loop, and the in-process
stand-in for a deployment handle that lets the ingress's route mixins call a local object
(docs/design.md#control-path)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from types import SimpleNamespace
from typing import Any

import uvicorn
from fastapi import FastAPI

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5.0
"""How long a closing listener lets the requests under way finish."""
BACKLOG = 4096
"""Connections the kernel queues before the server accepts them: RL rollouts open thousands at once."""


class ListenerError(RuntimeError):
    """A listener cannot listen where the app's args say; the message names the key and the fix."""


def bind(host: str, port: int, key: str, *, shared: bool = False) -> socket.socket:
    """A listening socket on (host, port); ListenerError naming `key` (the args' key of the
    listener) when it cannot. `shared`: with SO_REUSEPORT, so the listeners of several processes
    of one user share the port and the kernel spreads new connections over them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted process rebinds at once
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        raise ListenerError(
            f"the {key.replace('_', ' ')} cannot listen on {host}:{port} ({e.strerror}): pick a free port for "
            f"{key}.port, or an interface of this node for {key}.host"
        ) from None
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The process (a Ray actor) owns its signals; uvicorn takes them where it runs on the main thread.
        yield


class Listener:
    """`app` served on `sock` on the running event loop until `close`."""

    def __init__(self, app: FastAPI, sock: socket.socket, what: str):
        """`what`: the listener's name in the log."""
        self._socket, self._what = sock, what
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN_S),
        )
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        self._task.add_done_callback(self._ended)
        log.info("%s on %s:%d", what, *sock.getsockname()[:2])

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (e := task.exception()) is not None:
            log.error("the %s stopped; its routes still answer on Serve's port", self._what, exc_info=e)

    async def close(self) -> None:
        """Stop listening; the requests under way get uvicorn's graceful shutdown."""
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._task, timeout=GRACEFUL_SHUTDOWN_S + 1)
        self._socket.close()


class LocalStream:
    """An async generator of this process behind a streaming handle call's interface
    (`__anext__`, `cancel`)."""

    def __init__(self, stream: AsyncIterator[Any]):
        self._stream = stream

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> Any:
        return await self._stream.__anext__()

    def cancel(self) -> None:
        """Close the generator (its `finally` aborts what it runs), as a cancelled handle call does."""
        if (close := getattr(self._stream, "aclose", None)) is not None:
            task = asyncio.ensure_future(close())
            task.add_done_callback(_log_close_failure)


def _log_close_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and (e := task.exception()) is not None:
        log.debug("closing a stream failed", exc_info=e)


class InProcess:
    """An object of this process behind the handle interface the route mixins call
    (`handle.method.remote(...)`, `handle.options(stream=True).method.remote(...)`), called
    directly: no serialization, no actor call."""

    def __init__(self, target: object, streaming: bool = False):
        self._target = target
        self._streaming = streaming

    def options(self, *, stream: bool = False) -> InProcess:
        return InProcess(self._target, stream)

    def __getattr__(self, name: str) -> SimpleNamespace:
        method: Callable[..., Any] = getattr(self._target, name)
        if self._streaming:
            return SimpleNamespace(remote=lambda *args, **kwargs: LocalStream(method(*args, **kwargs)))
        return SimpleNamespace(remote=method)
