"""A replica's convergence on the app's desired state when a control call missed it.

A replica that is still starting is not routable, so a start, stop or client pause sent then
never reaches it: it would record a step the app has stopped, miss the step being profiled, or
generate while the app is paused. Serve's health
checks (every 2 s) run `Reconciler.check`; a difference seen at two checks in a row (any call in
flight has landed by then) is put right (docs/design.md#desired-state).
"""

from __future__ import annotations

import logging
from typing import Protocol

from profiling.session import SessionSpec, StopOutcome
from serve_app.api import ClientPauseMode, ReplicaReport
from serve_app.desired_state import ClientPause, DesiredState

log = logging.getLogger(__name__)


class _Engine(Protocol):
    @property
    def active_step(self) -> int | None: ...

    async def start_profile(self, spec: SessionSpec) -> bool: ...

    async def stop_profile(self, step: int | None, pause: bool) -> StopOutcome: ...


class _Desired(Protocol):
    async def get(self) -> DesiredState: ...


class _Pauses(Protocol):
    """The replica's part of a client's pause."""

    @property
    def client_pause_mode(self) -> ClientPauseMode | None: ...

    async def client_pause(self, mode: ClientPauseMode, for_s: float, drain: bool = True) -> ReplicaReport: ...

    async def client_resume(self) -> ReplicaReport: ...


class Reconciler:
    def __init__(self, engine: _Engine, desired: _Desired, pauses: _Pauses):
        self._engine = engine
        self._desired = desired
        self._pauses = pauses
        self._mismatch: tuple[int | None, int | None] | None = None
        self._pause_mismatch: tuple[str | None, str | None] | None = None
        self._joined_late: set[int] = set()

    async def check(self) -> None:
        """Compare the engine's recording and the replica's client pause with the desired state;
        act on a difference seen twice."""
        state = await self._desired.get()
        await self._check_pause(state.client_pause)
        active = self._engine.active_step
        wanted = state.active
        seen = (active, wanted.step if wanted else None)
        if seen[0] == seen[1] or self._mismatch != seen:
            self._mismatch = None if seen[0] == seen[1] else seen
            return
        self._mismatch = None
        if active is not None:
            log.warning("step %s is no longer profiled by the app; stopping this replica's recording", active)
            await self._engine.stop_profile(active, pause=False)
        if wanted is not None and wanted.step not in self._joined_late:
            log.warning("step %s is profiled by the app but not here; joining it late", wanted.step)
            self._joined_late.add(wanted.step)  # once: a start that fails is not retried every 2 s
            await self._engine.start_profile(wanted.model_copy(update={"late_start": True}))

    async def _check_pause(self, wanted: ClientPause | None) -> None:
        # A pause whose bound has passed is over here too, whether or not the controller has
        # cleared it yet.
        if wanted is not None and wanted.left_s() <= 0:
            wanted = None
        seen = (self._pauses.client_pause_mode, wanted.mode if wanted else None)
        if seen[0] == seen[1] or self._pause_mismatch != seen:
            self._pause_mismatch = None if seen[0] == seen[1] else seen
            return
        self._pause_mismatch = None
        if wanted is None:
            log.warning("the app's client pause is over but this replica still pauses; resuming")
            await self._pauses.client_resume()
        else:
            log.warning("the app is paused by a client (mode %s) but this replica is not; pausing", wanted.mode)
            await self._pauses.client_pause(wanted.mode, wanted.left_s(), drain=False)
