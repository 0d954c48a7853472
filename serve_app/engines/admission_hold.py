"""The admission hold of one engine: while held, no new engine step is admitted, until the next
start or resuming update, or until `hold_timeout_s` passes (docs/design.md#exact-attribution)."""

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
        """End the hold (if any), resuming the engine; the caller holds the control lock."""
        self._disarm()
        if self.held:
            await self.resume_engine()
            self.held = False
            if self._sync_hold is not None:
                step, began = self._sync_hold
                self._annotate(step, sync_held_s=round(time.monotonic() - began, 6))
        self._sync_hold = None

    def cancel(self) -> None:
        """Stop the deadline's timer (at shutdown)."""
        if self._timer is not None:
            self._timer.cancel()

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
