"""The admission hold of one engine: while held, no new engine step is admitted, until the next
start or resuming update, or until `hold_timeout_s` passes (docs/design.md#exact-attribution);
and a client's pause (vLLM's `/pause?mode=keep`), which holds the engine too, until the
client's resume or until its own bound passes (docs/design.md#client-pause). The engine runs
only when neither holds it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

log = logging.getLogger(__name__)


class AdmissionHold:
    """The hold, its deadline, and the engine's own pause state.

    `pause` / `resume`: pause and resume the engine (its adapter's); `require_pause`: raises when the
    engine cannot pause; `annotate(step, **fields)`: writes into the step's entry; `control`: the
    engine's control lock, which an expiry takes before it resumes."""

    def __init__(
        self,
        *,
        timeout_s: float,
        control: asyncio.Lock,
        pause: Callable[[], Awaitable[None]],
        resume: Callable[[], Awaitable[None]],
        require_pause: Callable[[], None],
        annotate: Callable[..., None],
    ) -> None:
        self._timeout_s = timeout_s
        self._control = control
        self._pause = pause
        self._resume = resume
        self._require_pause = require_pause
        self._annotate = annotate
        self.held = False
        """Whether admission of new engine steps is held."""
        self.engine_paused = False
        """Whether the engine is paused (held, or paused by a weight load in progress)."""
        self._timer: asyncio.TimerHandle | None = None
        self._armed = 0
        """Counts hold deadlines armed: an expiry that waited for the control lock while a load
        renewed the deadline is stale."""
        self._loading = 0
        """Weight loads (reads, receives) under way: the hold's deadline waits for them."""
        # (step, monotonic time) of a hold begun by the stop of `step`: its length goes to the entry.
        self._sync_hold: tuple[int, float] | None = None
        self.client_held = False
        """Whether a client's pause holds the engine (apart from the sync's hold)."""
        self._client_timer: asyncio.TimerHandle | None = None

    def begun_by_stop(self, step: int) -> None:
        """A hold about to begin comes from the stop of `step`: its length goes to that entry."""
        if not self.held:
            self._sync_hold = (step, time.monotonic())

    async def pause_engine(self) -> None:
        await self._pause()
        self.engine_paused = True

    async def resume_engine(self) -> None:
        await self._resume()
        self.engine_paused = False

    async def hold(self) -> None:
        """Admit no engine step until the next start or resuming update, or until hold_timeout_s
        after the hold began or after the weight load it covered ended: a stop or update while
        held keeps that deadline, so no caller can stretch a hold by repeating them."""
        if self.held:
            return
        self._require_pause()
        if not self.engine_paused:
            await self.pause_engine()
        self.held = True
        if not self._loading:
            self._arm()

    async def release(self) -> None:
        """End the hold (if any), resuming the engine unless a client's pause holds it; the
        caller holds the control lock."""
        self._disarm()
        if self.held:
            if not self.client_held:
                await self.resume_engine()
            self.held = False
            if self._sync_hold is not None:
                step, began = self._sync_hold
                self._annotate(step, sync_held_s=round(time.monotonic() - began, 6))
        self._sync_hold = None

    async def client_hold(self, for_s: float) -> None:
        """A client's pause: admit no engine step until `client_release`, or for `for_s` seconds
        at most (a repeat sets the bound anew); the caller holds the control lock. Starts,
        updates and the sync hold's end leave it in place."""
        self._require_pause()
        if not self.engine_paused:
            await self.pause_engine()
        self.client_held = True
        if self._client_timer is not None:
            self._client_timer.cancel()
        self._client_timer = asyncio.get_running_loop().call_later(
            max(0.0, for_s), lambda: asyncio.ensure_future(self._client_expired())
        )

    async def client_release(self) -> None:
        """End a client's pause (if any), resuming the engine unless the sync's hold still holds
        it; the caller holds the control lock."""
        if self._client_timer is not None:
            self._client_timer.cancel()
            self._client_timer = None
        if self.client_held:
            if not self.held:
                await self.resume_engine()
            self.client_held = False

    async def _client_expired(self) -> None:
        async with self._control:
            if self.client_held:
                log.warning("a client's pause reached client_pause_max_s without its resume; resuming")
                await self.client_release()

    def cancel(self) -> None:
        """Stop the deadlines' timers (at shutdown)."""
        for timer in (self._timer, self._client_timer):
            if timer is not None:
                timer.cancel()

    @contextlib.asynccontextmanager
    async def covering_load(self) -> AsyncIterator[None]:
        """While weights are read, received or loaded, a hold's deadline does not run: a load longer
        than hold_timeout_s must not resume generation before the start that follows it (forward
        passes on the new weights would run unprofiled). The deadline restarts when it ends."""
        self._loading += 1
        self._disarm()
        try:
            yield
        finally:
            self._loading -= 1
            if self.held and not self._loading:
                self._arm()

    def _arm(self) -> None:
        """The hold ends hold_timeout_s from now (unless a start or resuming update ends it first)."""
        self._disarm()
        armed = self._armed
        self._timer = asyncio.get_running_loop().call_later(
            self._timeout_s, lambda: asyncio.ensure_future(self._expired(armed))
        )

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._armed += 1  # an expiry already waiting for the control lock is stale now

    async def _expired(self, armed: int) -> None:
        async with self._control:
            if self.held and armed == self._armed:
                log.warning("admission hold expired without a weight update or start; resuming")
                try:
                    await self.release()
                except Exception:
                    log.exception("resuming after the admission hold expired failed; holding %ss more", self._timeout_s)
                    self._arm()
