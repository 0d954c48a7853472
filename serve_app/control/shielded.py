"""Control calls that run to completion whatever happens to the request that asked for them.

Serve cancels a handler when its HTTP client disconnects or times out (`x-request-timeout-seconds`
lets any client pick that time), and the cancellation travels down the handle calls it made. A
start cancelled after publishing the desired state but before arming its watchdog, or an update
cancelled between two broadcasts, would leave the fleet half changed. So each control call runs
as a task of its own that the caller only waits for: a cancelled caller stops waiting, the call
carries on. The task runs in a context of its own too: Serve cancels the handle calls a request
made by the request's id, which it reads from a context variable, and would otherwise cut the
call's broadcasts short. Its repeat queues behind it on the control lock and finds it done: every
control call is idempotent for its own repeat (docs/design.md#cancellation-safe-control).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class ShieldedCalls:
    """Runs control calls as tasks no caller's cancellation reaches (one per event loop)."""

    def __init__(self) -> None:
        self._running: set[asyncio.Future[Any]] = set()

    async def run(self, name: str, call: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """`await call()` in a task of its own, kept until it ends even if nobody waits for it."""
        task: asyncio.Task[T] = asyncio.get_running_loop().create_task(call(), context=contextvars.Context())
        self._running.add(task)
        task.add_done_callback(lambda t: self._finished(name, t))
        return await asyncio.shield(task)

    def _finished(self, name: str, task: asyncio.Future[Any]) -> None:
        self._running.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            # Also when nobody waits any more: the call was cut off, its outcome is only here.
            log.info("control call %s ended with %s: %s", name, type(error).__name__, error)
