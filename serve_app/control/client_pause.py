"""A client's pause over the fleet (vLLM's `/pause`, `/resume`, `/is_paused`;
docs/design.md#client-pause): one desired pause for the app, carried out on every replica, bounded
by `client_pause_max_s`, recorded so that a replica that starts or missed the call converges on it;
and a client's abort of requests in flight (vLLM's `/abort_requests`), which pauses nothing.

The sync's own hold (a stop with pause, an update with resume false) is apart from it: a start or
a resuming update ends that hold and leaves a client's pause in place, so a client that pauses,
publishes and resumes keeps generation paused across the update it drives.
"""

from __future__ import annotations

import asyncio
import logging
import time

from serve_app.api import (
    AbortRequestsResponse,
    ClientPauseMode,
    IsPausedResponse,
    PauseResponse,
    ReplicaReport,
    ResumeResponse,
)
from serve_app.config import AppArgs
from serve_app.control.capabilities import require
from serve_app.control.fleet import Fleet
from serve_app.desired_state import ClientPause
from serve_app.engines.options import Capability
from serve_app.errors import Unavailable

KEEP_INSTEAD = "pause with mode=keep instead (requests in flight freeze and go on after /resume)"
"""What a caller does where the engine cannot abort."""

log = logging.getLogger(__name__)


class ClientPauses:
    """The app's client pause: set, lifted, and ended by its bound."""

    def __init__(self, fleet: Fleet, args: AppArgs):
        self._args = args
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
        flight finished; `abort`: once every request in flight was ended). Refused (422) when the
        engine cannot abort (`abort`) or hold its steps (`keep`); Unavailable (503) naming each
        replica that did not pause."""
        if mode == "abort":
            require(self._args, Capability.ABORT, "mode=abort", KEEP_INSTEAD)
        elif mode == "keep":
            require(self._args, Capability.PAUSE, "mode=keep")
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

    async def abort(self, request_ids: list[str] | None) -> AbortRequestsResponse:
        """End the generation requests in flight on every replica that `request_ids` names (a
        completion's `id`, or vLLM's request id of one of its prompts; None or empty: every one),
        each answering finish_reason abort with the tokens sampled so far; nothing is paused.
        Refused (422) when the engine cannot abort; Unavailable (503) naming each replica that
        did not carry it out."""
        require(self._args, Capability.ABORT, "/abort_requests", KEEP_INSTEAD)
        reports = await self._fleet.broadcast("abort_requests", request_ids or None)
        _check(reports, "abort", desired=False)
        return AbortRequestsResponse(aborted=sum(r.aborted or 0 for r in reports), replicas=reports)

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


def _check(reports: list[ReplicaReport], what: str, desired: bool = True) -> None:
    """Unavailable naming every replica that did not carry out the client's `what`; `desired`:
    the desired state has it, so those replicas converge on their own."""
    if failed := [r for r in reports if not r.ok]:
        named = "; ".join(f"{r.replica_id}: {r.error}" for r in failed)
        fix = (
            "the app's desired state has it, so those replicas converge within two health checks, or repeat the call"
            if desired
            else "repeat the call"
        )
        raise Unavailable(f"the {what} did not reach every replica ({named}); {fix}")
