"""The desired state of the rollout fleet, kept in one place (a named Ray actor per app).

The controller is its only writer; every replica reads it when it starts, so a replica that
joins or restarts mid-session loads the current weights and joins the active step.
"""

from __future__ import annotations

import ray
from pydantic import BaseModel

from profiling.session import SessionSpec


class DesiredState(BaseModel):
    active: SessionSpec | None = None
    weight_version: int = 0
    weights_path: str | None = None
    paused: bool = False


@ray.remote(num_cpus=0, max_restarts=-1)
class DesiredStateActor:
    def __init__(self) -> None:
        self._state = DesiredState().model_dump_json()

    def get(self) -> str:
        return self._state

    def set(self, state_json: str) -> None:
        self._state = state_json


class DesiredStateStore:
    """Typed access to the app's desired-state actor (created on first use)."""

    def __init__(self, app_name: str):
        self._actor = DesiredStateActor.options(
            name=f"rollout-profiler-desired-state-{app_name}",
            namespace="serve",
            get_if_exists=True,
            lifetime="detached",
        ).remote()

    async def get(self) -> DesiredState:
        return DesiredState.model_validate_json(await self._actor.get.remote())

    async def set(self, state: DesiredState) -> None:
        await self._actor.set.remote(state.model_dump_json())

    def destroy(self) -> None:
        ray.kill(self._actor)
