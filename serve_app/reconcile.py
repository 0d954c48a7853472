"""A replica's convergence on the app's desired state when a control call missed it.

A replica that is still starting is not routable, so a start or stop sent then never reaches
it: it would record a step the app has stopped, or miss the step being profiled. Serve's health
checks (every 2 s) run `Reconciler.check`; a difference seen at two checks in a row (any call in
flight has landed by then) is put right (docs/design.md#desired-state).
"""

from __future__ import annotations

import logging
from typing import Protocol

from profiling.session import SessionSpec, StopOutcome
from serve_app.desired_state import DesiredState

log = logging.getLogger(__name__)


class _Engine(Protocol):
    @property
    def active_step(self) -> int | None: ...

    async def start_profile(self, spec: SessionSpec) -> bool: ...

    async def stop_profile(self, step: int | None, pause: bool) -> StopOutcome: ...


class _Desired(Protocol):
    async def get(self) -> DesiredState: ...


class Reconciler:
    def __init__(self, engine: _Engine, desired: _Desired):
        self._engine = engine
        self._desired = desired
        self._mismatch: tuple[int | None, int | None] | None = None
        self._joined_late: set[int] = set()

    async def check(self) -> None:
        """Compare the engine's recording with the desired state; act on a difference seen twice."""
        active = self._engine.active_step
        wanted = (await self._desired.get()).active
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
