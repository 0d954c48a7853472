"""vLLM's and SGLang's own `/start_profile` body, and its mapping onto the app's version-keyed
windows (docs/http_api.md#route-mapping): a bare start profiles the step the served weights
generate (served version v: step v+1), with the body's options where the app can honour them.

One body takes both servers' fields (vLLM 0.33's `StartProfileRequest`, SGLang 0.5.23's
`ProfileReq`): no field of one means something else in the other. A field the app cannot honour
is refused with a 422 naming it. Pure pydantic.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from profiling.config import Activity, SafeName, StrictModel
from serve_app.api import StartProfileRequest

START_TEXT = "Start profiling.\n"
"""SGLang's answer to a start (vLLM's is empty: its clients read only the status)."""
STOP_TEXT = "Stop profiling. This will take some time.\n"
"""SGLang's answer to a stop."""

_ACTIVITIES: dict[str, Activity] = {"CPU": "cpu", "GPU": "cuda"}
"""SGLang's activities the app records (MEM is `with_memory`; RPD, ROCm's tracer, is not taken)."""


class EngineStartProfile(StrictModel):
    """`/start_profile`'s body, as vLLM's and SGLang's clients send it."""

    # vLLM 0.33
    profile_prefix: SafeName | None = Field(None, description="vLLM and SGLang: the window's tag.")
    delay_iterations: int | None = Field(None, ge=0, description="vLLM: only 0 (the window opens at once).")
    max_iterations: int | None = Field(None, ge=1, description="vLLM: max_forward_steps of the window.")
    profiler_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM: not taken (the app's `profiler` settings and start_limits rule)."
    )
    # SGLang 0.5.23
    output_dir: str | None = Field(None, description="SGLang: not taken (traces go under the app's save_path).")
    start_step: int | None = Field(None, description="SGLang: not taken (the window opens at once).")
    num_steps: int | None = Field(None, ge=1, description="SGLang: max_forward_steps of the window.")
    activities: list[Literal["CPU", "GPU", "MEM", "RPD"]] | None = Field(
        None, min_length=1, description="SGLang: CPU and GPU (cpu, cuda); MEM: with_memory."
    )
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_id: SafeName | None = Field(None, description="SGLang: the window's tag, where profile_prefix is not set.")
    merge_profiles: bool = Field(False, description="SGLang: accepted, the app merges every step's traces itself.")
    profile_by_stage: bool = Field(False, description="SGLang: not taken.")
    profile_stages: list[str] | None = Field(None, description="SGLang: not taken.")
    detailed_annotations: bool = Field(False, description="SGLang: not taken.")

    @model_validator(mode="after")
    def _honoured(self) -> EngineStartProfile:
        why = {
            "delay_iterations": "the window opens at once (send the start when it should open)"
            if self.delay_iterations
            else None,
            "profiler_kwargs": "the profiler's settings are the app's `profiler` block, within its start_limits; "
            "/profile/start overrides some of them"
            if self.profiler_kwargs
            else None,
            "output_dir": "traces go under the app's save_path, in step_<k>/ (GET /profile/steps lists them)"
            if self.output_dir is not None
            else None,
            "start_step": "the window opens at once (send the start when it should open)"
            if self.start_step is not None
            else None,
            "activities": "RPD is not recorded here; use CPU, GPU or MEM"
            if self.activities and "RPD" in self.activities
            else None,
            "profile_by_stage": "windows are keyed to weight versions, not to prefill and decode stages"
            if self.profile_by_stage or self.profile_stages
            else None,
            "detailed_annotations": "not recorded here" if self.detailed_annotations else None,
        }
        if self.max_iterations is not None and self.num_steps is not None:
            why["num_steps"] = "give max_iterations or num_steps, not both"
        if problems := [f"{field}: {reason}" for field, reason in why.items() if reason]:
            raise ValueError("; ".join(problems))
        return self

    def start(self, served_version: int) -> StartProfileRequest:
        """The app's start of the step the served weights generate (served version v: step v+1)."""
        activities = [_ACTIVITIES[a] for a in self.activities or () if a in _ACTIVITIES]
        return StartProfileRequest(
            step=served_version + 1,
            activities=activities or None,
            with_memory=True if self.activities and "MEM" in self.activities else None,
            with_stack=self.with_stack,
            record_shapes=self.record_shapes,
            max_forward_steps=self.max_iterations or self.num_steps,
            tag=self.profile_prefix or self.profile_id,
        )
