"""The HTTP wire schema of the control routes (docs/design.md#http-api), as pydantic models; the
OpenAI routes' bodies are in serve_app/openai_api.py.

Pure pydantic: the trainer-side client imports this module (and nothing else of serve_app) so
both ends share one definition of every body.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from profiling.config import MAX_STEP, Activity, SafeName, StepNumber, StrictModel, Tool
from profiling.manifest import ManifestStatus

MAX_WINDOW_STEPS = 10_000
"""Most steps one continuous window may span."""


class StartProfileRequest(StrictModel):
    step: StepNumber = Field(description="Step k: generation served with weights version k-1.")
    steps: list[StepNumber] | None = Field(
        None,
        max_length=MAX_WINDOW_STEPS,
        description="All steps of a continuous window labelled `step` (default: [step]).",
    )
    tool: Tool | None = None
    activities: list[Activity] | None = Field(None, min_length=1)
    record_shapes: bool | None = None
    with_stack: bool | None = None
    with_memory: bool | None = None
    max_forward_steps: int | None = Field(None, ge=1)
    max_duration_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    max_trace_mb: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="This window's trace budget in MiB of trace JSON (default: the app's profiler.max_trace_mb).",
    )
    tag: SafeName | None = None


class StopProfileRequest(StrictModel):
    step: StepNumber
    pause: bool = Field(
        False,
        description="Hold admission of new engine steps until the next /weights/update or "
        "/profile/start (the trainer client sets it: nothing runs unprofiled in the gap).",
    )


class UpdateWeightsRequest(StrictModel):
    version: int = Field(ge=0, le=MAX_STEP, description="Parameter version; must not decrease.")
    path: str = Field(min_length=1, description="safetensors file or directory of them.")
    resume: bool = Field(
        True,
        description="Open admission after loading. False holds engine steps after the load "
        "until the /profile/start that follows, so no step on the new weights runs unprofiled.",
    )


class InClusterWeightsRequest(StrictModel):
    """The handle-only counterpart of UpdateWeightsRequest: weights come as an object-store ref."""

    version: int = Field(ge=0, le=MAX_STEP)
    resume: bool = True


UNKNOWN_REPLICA = "unknown"
"""The replica id of a failure that no replica's report names (none reachable, or an anonymous
timeout)."""


class ReplicaReport(BaseModel):
    """One replica's answer to a control call."""

    replica_id: str
    pid: int | None = None
    node_id: str | None = None
    ok: bool = True
    conflict: bool = Field(
        False, description="The call contradicts this replica's state (another step recording): a 409 cause."
    )
    refused: bool = Field(
        False,
        description="This replica's engine or profiler refused the call (e.g. a tool the engine "
        "cannot record with): when no replica starts a step, a refusal makes the answer 422, not 503.",
    )
    state: str | None = None
    active_step: int | None = None
    weight_version: int | None = None
    paused: bool | None = None
    forward_steps: int | None = None
    forward_steps_by_version: dict[int, int] = Field(
        default_factory=dict, description="All forward passes the replica ran, by weight version."
    )
    requests_in_flight: int | None = Field(
        None, description="Generation requests (one per choice) the replica's engine is running or queueing."
    )
    files: list[str] = Field(default_factory=list)
    stop_ack_s: float | None = None
    load_s: float | None = None
    error: str | None = None


class StartProfileResponse(BaseModel):
    step: int
    steps: list[int]
    state: Literal["profiling", "already_profiling"]
    replicas: list[ReplicaReport]


class StopProfileResponse(BaseModel):
    step: int | None
    stopped: bool
    replicas: list[ReplicaReport] = Field(default_factory=list)
    manifest: str | None = Field(None, description="Path of step_<k>/manifest.json.")
    critical_path_s: float | None = None


class UpdateWeightsResponse(BaseModel):
    version: int
    replicas: list[ReplicaReport]
    load_s: float | None = Field(None, description="Slowest replica's load seconds.")


class StatusResponse(BaseModel):
    state: Literal["idle", "profiling"]
    active_step: int | None
    steps: list[int] = Field(default_factory=list)
    weight_version: int
    paused: bool
    replicas: list[ReplicaReport]


class ClockResponse(BaseModel):
    time_ns: int = Field(
        description="The app's reference clock (the controller's `time.time_ns()`) when it answered: "
        "a trainer brackets the call with its own readings to measure its clock against the app's."
    )


class StepSummary(BaseModel):
    step: int
    steps: list[int]
    status: ManifestStatus


class StepsResponse(BaseModel):
    save_path: str
    steps: list[StepSummary]


class ErrorResponse(BaseModel):
    detail: str
    replicas: list[ReplicaReport] = Field(default_factory=list)
