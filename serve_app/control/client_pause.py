"""A client's pause over the fleet (vLLM's `/pause`, `/resume`, `/is_paused`;
docs/design.md#client-pause): one desired pause for the app, carried out on every replica, bounded
by `client_pause_max_s`, recorded so that a replica that starts or missed the call converges on it.

The sync's own hold (a stop with pause, an update with resume false) is apart from it: a start or
a resuming update ends that hold and leaves a client's pause in place, so a client that pauses,
publishes and resumes keeps generation paused across the update it drives.
"""

from __future__ import annotations

import asyncio
import logging
import time

from serve_app.api import ClientPauseMode, IsPausedResponse, PauseResponse, ReplicaReport, ResumeResponse
from serve_app.config import AppArgs
from serve_app.control.fleet import Fleet
from serve_app.desired_state import ClientPause
from serve_app.errors import Unavailable

log = logging.getLogger(__name__)


class ClientPauses:
    """The app's client pause: set, lifted, and ended by its bound."""

    def __init__(self, fleet: Fleet, args: AppArgs):
        self._fleet = fleet
        self._max_s = args.client_pause_max_s
        self._timeout_s = args.control_timeout_s
        self._timer: asyncio.TimerHandle | None = None

    async def recover(self) -> None:
        """After a controller restart: the recorded pause ends when it would have."""
        if (pause := (await self._fleet.desired()).client_pause) is not None:
            self._arm(pause)

    async def pause(self, mode: ClientPauseMode) -> PauseResponse:
        """Pause generation on every replica in `mode`, for client_pause_max_s at most (a repeat
        sets the bound anew). Answers once every replica paused (`wait`: once every request in
        flight finished). Unavailable (503) naming each replica that did not."""
        async with self._fleet.lock:
            pause = ClientPause(mode=mode, until=time.time() + self._max_s)
            state = await self._fleet.desired()
            await self._fleet.publish(state.model_copy(update={"client_pause": pause}))
            self._arm(pause)
            # `wait` answers when the requests in flight have finished: as long as the pause may last.
            timeout_s = self._timeout_s + (self._max_s if mode == "wait" else 0.0)
            reports = await self._fleet.broadcast("client_pause", mode, pause.left_s(), timeout_s=timeout_s)
        _check(reports, "pause")
        return PauseResponse(mode=mode, until=pause.until, replicas=reports)

    async def resume(self) -> ResumeResponse:
        """Lift the client's pause on every replica (none in effect: nothing changes). The
        sync's own hold, where one is in effect, still holds until its start or update."""
        async with self._fleet.lock:
            await self._lift()
            reports = await self._fleet.broadcast("client_resume")
        _check(reports, "resume")
        return ResumeResponse(replicas=reports)

    async def is_paused(self) -> IsPausedResponse:
        pause = (await self._fleet.desired()).client_pause
        if pause is None:
            return IsPausedResponse(is_paused=False)
        return IsPausedResponse(is_paused=True, mode=pause.mode, until=pause.until)

    async def _lift(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        state = await self._fleet.desired()
        if state.client_pause is not None:
            await self._fleet.publish(state.model_copy(update={"client_pause": None}))

    def _arm(self, pause: ClientPause) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(
            pause.left_s(), lambda: asyncio.ensure_future(self._expired(pause))
        )

    async def _expired(self, pause: ClientPause) -> None:
        # Every replica ends its own part at the same bound; here the desired state follows.
        async with self._fleet.lock:
            if (await self._fleet.desired()).client_pause == pause:
                log.warning("a client's pause reached client_pause_max_s without its /resume; generation goes on")
                await self._lift()


def _check(reports: list[ReplicaReport], what: str) -> None:
    """Unavailable naming every replica that did not carry out the client's `what`."""
    if failed := [r for r in reports if not r.ok]:
        named = "; ".join(f"{r.replica_id}: {r.error}" for r in failed)
        raise Unavailable(
            f"the {what} did not reach every replica ({named}); the app's desired state has it, so those "
            "replicas converge within two health checks, or repeat the call"
        )
