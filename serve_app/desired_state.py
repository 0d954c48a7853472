"""The desired state of the rollout fleet, kept in one place (a named Ray actor per app).

The controller is its only writer; every replica reads it when it starts, so a replica that
joins or restarts mid-session loads the current weights (from a path, the object store, or a
peer replica) and joins the active step.
"""

from __future__ import annotations

from typing import Any

import ray
from pydantic import BaseModel

from profiling.session import SessionSpec


class DesiredState(BaseModel):
    active: SessionSpec | None = None
    active_since: float | None = None
    """Unix seconds when `active` started: a restarted controller re-arms the step's
    max_duration_s watchdog for the time it has left."""
    weight_version: int = 0
    weights_path: str | None = None
    weights_in_object_store: bool = False
    """The served weights came through the Ray object store (the actor keeps their ref)."""
    weights_from_peer: bool = False
    """The served weights came by collective or by the trainer's own transfer: no file holds
    them, so a replica that starts copies them from a peer replica serving `weight_version`."""
    paused: bool = False


class DesiredStateHolder:
    """The actor's body: the state as JSON, and the ref of object-store weights."""

    def __init__(self) -> None:
        self._state = DesiredState().model_dump_json()
        self._weights_refs: list[ray.ObjectRef] = []

    def get(self) -> str:
        return self._state

    def set(self, state_json: str) -> None:
        self._state = state_json

    def get_weights_refs(self) -> list[ray.ObjectRef]:
        return self._weights_refs

    def set_weights_refs(self, refs: list[ray.ObjectRef]) -> None:
        # Holding the ref keeps the object reachable for replicas that start later (as long as
        # its owner, the trainer process that put it, lives).
        self._weights_refs = refs


DesiredStateActor = ray.remote(num_cpus=0, max_restarts=-1)(DesiredStateHolder)


class DesiredStateStore:
    """Typed access to the app's desired-state actor (created on first use)."""

    def __init__(self, app_name: str):
        # Typed Any: Ray types a created actor as "handle or class", which no call type-checks on.
        self._actor: Any = DesiredStateActor.options(
            name=f"rollout-profiler-desired-state-{app_name}",
            namespace="serve",
            get_if_exists=True,
            lifetime="detached",
        ).remote()

    async def get(self) -> DesiredState:
        return DesiredState.model_validate_json(await self._actor.get.remote())

    async def set(self, state: DesiredState) -> None:
        await self._actor.set.remote(state.model_dump_json())

    async def weights_refs(self) -> list[ray.ObjectRef]:
        """The object-store ref of the served weights (a list, so it stays unresolved)."""
        return await self._actor.get_weights_refs.remote()

    async def set_weights_refs(self, refs: list[ray.ObjectRef]) -> None:
        await self._actor.set_weights_refs.remote(refs)

    def destroy(self) -> None:
        ray.kill(self._actor)
