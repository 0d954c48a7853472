"""What a rollout engine offers the replica: generation, profiling, weight updates, status."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod

from pydantic import BaseModel, Field

from profiling.manifest import ManifestEntry
from profiling.session import ProfileSession, SessionSpec, StopOutcome


class GenerateRequest(BaseModel):
    prompt_token_ids: list[int] = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    seed: int | None = None


class GenerateResult(BaseModel):
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_versions: list[int]


class EngineStatus(BaseModel):
    state: str
    active_step: int | None
    weight_version: int
    paused: bool
    forward_steps: int
    """Forward passes recorded in the active window."""
    forward_steps_by_version: dict[int, int]
    """All forward passes this engine ran, by weight version (recorded or not)."""
    exports_pending: int


class RolloutEngine(ABC):
    """One engine inside one replica. Profiling calls are keyed by the step they belong to."""

    model_name: str
    weight_version: int
    _session: ProfileSession
    """The replica's profiling session (its state and exports are what `status` reports)."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abstractmethod
    def detokenize(self, token_ids: list[int]) -> str: ...

    @abstractmethod
    def token_strings(self, token_ids: list[int]) -> list[str]: ...

    @abstractmethod
    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    @abstractmethod
    async def start_profile(self, spec: SessionSpec) -> bool:
        """Start recording; resumes admission. False: that step was already recording."""

    @abstractmethod
    async def stop_profile(self, step: int | None, pause: bool) -> StopOutcome:
        """Stop recording `step` (None: only apply `pause`); answer once the window is closed."""

    @abstractmethod
    async def update_weights(self, version: int, path: str | None, resume: bool) -> float:
        """Load `path` as `version` between engine steps; returns seconds spent. Afterwards
        admission is open if `resume`, else held until the next start (or the hold timeout)."""

    async def wait_exported(self, step: int, timeout_s: float) -> ManifestEntry | None:
        """This replica's final entry for `step` once its export is done (None: none)."""
        return await asyncio.to_thread(self._session.wait_exported, step, timeout_s)

    @property
    @abstractmethod
    def paused(self) -> bool:
        """Whether admission of new engine steps is held."""

    def forward_steps_by_version(self) -> dict[int, int]:
        """All forward passes run, by weight version ({}: the engine does not say)."""
        return {}

    def status(self) -> EngineStatus:
        return EngineStatus(
            state=self._session.state,
            active_step=self._session.active_step,
            weight_version=self.weight_version,
            paused=self.paused,
            forward_steps=self._session.forward_steps,
            forward_steps_by_version=self.forward_steps_by_version(),
            exports_pending=self._session.exports_pending,
        )

    @abstractmethod
    def healthy(self) -> bool: ...

    @abstractmethod
    async def shutdown(self) -> None: ...
