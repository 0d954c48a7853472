"""Admission of generation into one rollout replica, apart from its control calls.

Serve gates every call into a replica, control calls included, with one semaphore of
`max_ongoing_requests` slots: with that many generation calls in a replica, a broadcast `stop`
waits for one of them to finish, behind every other call waiting (docs/design.md#control-path).
So the replica's Serve limit is set above what generation can fill, and generation is admitted
here instead: at most `request_limits.max_ongoing_requests` calls run, at most
`max_queued_requests` wait in arrival order (a freed slot goes to the next at once, with no
retry back-off), for at most `queue_timeout_s`; a call beyond that is refused with 503 and
`Retry-After`. Control calls never pass through here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from serve_app.errors import Unavailable
from serve_app.limits import RequestLimits

BUSY_RETRY_AFTER_S = 1
"""Seconds a caller turned away by a full queue waits before it retries."""


class GenerationGate:
    """Generation calls of one replica: `max_ongoing` at once, `max_queued` waiting."""

    def __init__(self, limits: RequestLimits):
        self._limits = limits
        self._slots = asyncio.Semaphore(limits.max_ongoing_requests)
        self._waiting = 0
        self._admitted = 0
        self._drained = asyncio.Event()
        self._drained.set()
        self.closed: str | None = None
        """Why new calls are refused (503) while a client's pause (mode wait) lasts; None: open."""
        self._reopen: asyncio.TimerHandle | None = None

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Hold a generation slot for the body of the `async with`; Unavailable (503 with
        Retry-After) when the queue is full, the wait exceeds queue_timeout_s, or the gate is closed."""
        if self.closed is not None:
            raise Unavailable(self.closed, retry_after_s=BUSY_RETRY_AFTER_S)
        if self._slots.locked():
            if self._waiting >= self._limits.max_queued_requests:
                raise Unavailable(
                    f"this replica runs {self._limits.max_ongoing_requests} generation requests and "
                    f"{self._waiting} more wait (request_limits.max_queued_requests): retry after Retry-After "
                    "seconds, or add replicas",
                    retry_after_s=BUSY_RETRY_AFTER_S,
                )
            self._waiting += 1
            try:
                await asyncio.wait_for(self._slots.acquire(), self._limits.queue_timeout_s)
            except TimeoutError:
                raise Unavailable(
                    f"waited {self._limits.queue_timeout_s:g}s for a generation slot "
                    "(request_limits.queue_timeout_s): retry after Retry-After seconds, or add replicas",
                    retry_after_s=BUSY_RETRY_AFTER_S,
                ) from None
            finally:
                self._waiting -= 1
        else:
            await self._slots.acquire()
        self._admitted += 1
        self._drained.clear()
        try:
            yield
        finally:
            self._slots.release()
            self._admitted -= 1
            if not self._admitted:
                self._drained.set()

    def close(self, why: str, for_s: float) -> None:
        """Refuse new calls with 503 saying `why`, for `for_s` seconds at most (until `open`)."""
        self.closed = why
        if self._reopen is not None:
            self._reopen.cancel()
        self._reopen = asyncio.get_running_loop().call_later(max(0.0, for_s), self.open)

    def open(self) -> None:
        """Admit new calls again."""
        if self._reopen is not None:
            self._reopen.cancel()
            self._reopen = None
        self.closed = None

    async def drained(self) -> None:
        """Return once no admitted call runs (those waiting for a slot count once admitted)."""
        while self._admitted or self._waiting:
            await self._drained.wait()
            await asyncio.sleep(0)  # a waiter handed the freed slot is admitted on its next turn

    @property
    def waiting(self) -> int:
        """Generation calls waiting for a slot now."""
        return self._waiting
