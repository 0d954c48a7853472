"""The HTTP wire schema of the control routes (docs/design.md#http-api), as pydantic models; the
OpenAI routes' bodies are in serve_app/openai_api.py.

Pure pydantic: the trainer-side client imports this module (and nothing else of serve_app) so
both ends share one definition of every body.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, Field, field_validator, model_validator

from profiling.config import MAX_STEP, Activity, SafeName, StepNumber, StrictModel, Tool
from profiling.manifest import Driver, ManifestStatus
from profiling.weight_source import WeightSource
from serve_app.weights.buckets import plan_buckets
from serve_app.weights.collective_schema import CollectiveTransfer

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


class ScheduleSpec(StrictModel):
    """The app's own step schedule (docs/design.md#who-drives): verl's `global_profiler` keys, from
    the app's args or, with `POST /profile/schedule`, from a framework's plugin at run time."""

    steps: list[StepNumber] = Field(
        min_length=1, max_length=MAX_WINDOW_STEPS, description="The profiled steps, e.g. [1, 2, 5]."
    )
    profile_continuous_steps: bool = Field(
        False, description="Merge consecutive profiled steps into one window labelled by its first step."
    )

    @field_validator("steps")
    @classmethod
    def _sorted_unique(cls, steps: list[int]) -> list[int]:
        return sorted(set(steps))


class ScheduleResponse(BaseModel):
    """`POST /profile/schedule`'s answer: the schedule the app drives by, and where it stands."""

    schedule: ScheduleSpec
    given_by: Literal["args", "request"] = Field(
        description="Where the schedule came from: the app's args (`global_profiler`), or a request."
    )
    driver: Driver | None = Field(description="Who drives the steps now (docs/design.md#who-drives).")
    active_step: int | None = Field(description="The window recording now (its label), if any.")
    weight_version: int


WeightsSource = Literal[WeightSource.PATH, WeightSource.COLLECTIVE, WeightSource.EXTERNAL]
"""How a version's weights reach the replicas over HTTP (docs/design.md#weight-transfer)."""


class UpdateWeightsRequest(StrictModel):
    version: int = Field(ge=0, le=MAX_STEP, description="Parameter version; must not decrease.")
    source: WeightsSource = Field(
        WeightSource.PATH,
        description="path: the replicas read `path`. collective: the trainer's publishing rank broadcasts "
        "the tensors to every replica (`collective`; the app needs weight_transfer: collective). external: "
        "the trainer already moved the weights itself; every replica must report `version`.",
    )
    path: str | None = Field(None, min_length=1, description="source path: safetensors file or directory of them.")
    collective: CollectiveTransfer | None = Field(
        None, description="source collective: the publisher's store, the sync's group and the tensors."
    )
    resume: bool = Field(
        True,
        description="Open admission after loading. False holds engine steps after the load "
        "until the /profile/start that follows, so no step on the new weights runs unprofiled.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> UpdateWeightsRequest:
        """Exactly the field its source needs, and no other."""
        given = {"path": self.path is not None, "collective": self.collective is not None}
        needed = {"path": self.source == WeightSource.PATH, "collective": self.source == WeightSource.COLLECTIVE}
        for name in given:
            if needed[name] and not given[name]:
                raise ValueError(f"source {self.source!r} needs `{name}`")
            if given[name] and not needed[name]:
                raise ValueError(f"`{name}` is only read with source {name!r}, not {self.source!r}: remove it")
        return self


class InClusterWeightsRequest(StrictModel):
    """The handle-only counterpart of UpdateWeightsRequest: weights come as an object-store ref."""

    version: int = Field(ge=0, le=MAX_STEP)
    resume: bool = True


UNKNOWN_REPLICA = "unknown"
"""The replica id of a failure that no replica's report names (none reachable, or an anonymous
timeout)."""


class Outcome(StrEnum):
    """How one replica's control call ended. On the wire it is the report's `ok`, `conflict` and
    `refused` flags, which clients already read; the flags can hold only one of these."""

    OK = "ok"
    FAILED = "failed"
    CONFLICT = "conflict"
    """The call contradicts the replica's state (another step recording): a 409 cause."""
    REFUSED = "refused"
    """The replica's engine or profiler cannot do what was asked: a 422 cause."""

    def flags(self) -> dict[str, bool]:
        """The report's fields that carry this outcome."""
        return {"ok": self is Outcome.OK, "conflict": self is Outcome.CONFLICT, "refused": self is Outcome.REFUSED}


ClientPauseMode = Literal["keep", "wait", "abort"]
"""How a client's pause treats generation (vLLM's `/pause` modes; docs/design.md#client-pause):
`keep` freezes requests in flight between engine steps and queues new ones; `wait` refuses new
ones (503) and answers once those in flight finished; `abort` ends those in flight at once
(finish_reason abort, with the tokens sampled so far) and refuses new ones (503)."""

MAX_ABORT_IDS = 10_000
"""Most request ids one `/abort_requests` names."""


class ReplicaReport(BaseModel):
    """One replica's answer to a control call. It ended one of four ways: done (`ok`), failed
    (`ok` false), a conflict (`conflict`, a 409 cause) or a refusal (`refused`, a 422 cause);
    a report that claims two of them is invalid."""

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
    client_pause: ClientPauseMode | None = Field(None, description="A client's pause in effect on this replica.")
    forward_steps: int | None = None
    forward_steps_by_version: dict[int, int] = Field(
        default_factory=dict, description="All forward passes the replica ran, by weight version."
    )
    requests_in_flight: int | None = Field(
        None, description="Generation requests (one per choice) the replica's engine is running or queueing."
    )
    requests_waiting: int | None = Field(
        None, description="Generation calls waiting in the replica's admission queue (request_limits)."
    )
    files: list[str] = Field(default_factory=list)
    stop_ack_s: float | None = None
    load_s: float | None = None
    transfer_ranks: int | None = Field(
        None, description="Members this replica puts in a collective weight transfer's group (one per engine worker)."
    )
    transfer_s: float | None = Field(None, description="Seconds this replica took to receive a collective transfer.")
    aborted: int | None = Field(
        None, description="Generation requests (one per choice) this call ended early on this replica."
    )
    error: str | None = None

    @model_validator(mode="after")
    def _one_outcome(self) -> Self:
        if self.conflict and self.refused:
            raise ValueError("a replica report is either a conflict or a refusal, not both")
        if self.ok and (self.conflict or self.refused):
            raise ValueError("a replica report that is a conflict or a refusal is not ok")
        return self

    @property
    def outcome(self) -> Outcome:
        """The one outcome the flags hold."""
        if self.conflict:
            return Outcome.CONFLICT
        if self.refused:
            return Outcome.REFUSED
        return Outcome.OK if self.ok else Outcome.FAILED


class PerReplica(BaseModel):
    """An `engine_rpc` argument that differs per replica (one handle call reaches every replica
    alike): each replica's engine gets `values[<its replica id>]` (ids from `/profile/status`),
    e.g. a rank offset in a process group the trainer forms with the engines."""

    values: dict[str, Any]

    def pick(self, replica_id: str) -> Any:
        """This replica's value; ValueError naming the replica and the ids given when it has none."""
        if replica_id not in self.values:
            raise ValueError(
                f"a PerReplica argument names no value for replica {replica_id} (it names {sorted(self.values)}); "
                "give every replica of the app's /profile/status its own"
            )
        return self.values[replica_id]


class EngineRpcReport(ReplicaReport):
    """One replica's answer to the ingress's `engine_rpc` (a handle call, never HTTP): what the
    engine's own method returned."""

    result: Any = None


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
    transfer_s: float | None = Field(
        None,
        description="Seconds the bytes took to reach the replicas before the load: the object store's fetch, "
        "the collective's broadcast (measured by the publisher); None for a path the replicas read.",
    )
    schedule: ScheduleActions | None = Field(
        None, description="What the app's own global_profiler schedule did around this update (null: it drives not)."
    )


class ScheduleActions(BaseModel):
    """The profiling calls the app's own schedule made around one weight update."""

    stopped_step: int | None = None
    """The window it stopped before the load (with the hold, so nothing slipped through)."""
    started_step: int | None = None
    """The window it started after the load, before generation resumed."""
    error: str | None = None
    """Why the window due to start did not (its traces are missing; the update itself held)."""


class PauseResponse(BaseModel):
    """vLLM's `/pause` answer, with the pause's bound and each replica's report."""

    status: Literal["paused"] = "paused"
    mode: ClientPauseMode
    until: float = Field(
        description="Unix seconds when the pause ends on its own (client_pause_max_s), unless resumed first."
    )
    replicas: list[ReplicaReport]


class ResumeResponse(BaseModel):
    """vLLM's `/resume` answer, with each replica's report."""

    status: Literal["resumed"] = "resumed"
    replicas: list[ReplicaReport]


class IsPausedResponse(BaseModel):
    """vLLM's `/is_paused`: whether a client's pause is in effect (not the sync's own hold)."""

    is_paused: bool
    mode: ClientPauseMode | None = None
    until: float | None = Field(None, description="Unix seconds when the pause ends on its own.")


class AbortRequestsRequest(StrictModel):
    """vLLM's `/abort_requests` body."""

    request_ids: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = Field(
        None, max_length=MAX_ABORT_IDS
    )
    """The requests to end: a completion's `id`, or the request id vLLM's server gives one of its
    prompts (docs/http_api.md#request-ids). Null or empty: every request in flight."""


class AbortRequestsResponse(BaseModel):
    """vLLM's `/abort_requests` answer, with each replica's report."""

    status: Literal["aborted"] = "aborted"
    aborted: int = Field(
        description="Generation requests ended early, one per choice (vLLM counts the ids it was given, "
        "or every request it tracked)."
    )
    replicas: list[ReplicaReport]


class ResetPrefixCacheResponse(BaseModel):
    """vLLM's `/reset_prefix_cache` answer, with each replica's report."""

    success: bool = Field(description="Every replica's engine emptied its prefix cache.")
    replicas: list[ReplicaReport]


class StatusResponse(BaseModel):
    state: Literal["idle", "profiling"]
    active_step: int | None
    steps: list[int] = Field(default_factory=list)
    weight_version: int
    paused: bool
    driver: Driver | None = Field(
        None,
        description="Who drives the steps: server (the app's global_profiler schedule), client (a client "
        "called /profile/start or /profile/stop), or null (neither yet).",
    )
    schedule: ScheduleSpec | None = Field(
        None, description="The app's own step schedule (its args', or one set by POST /profile/schedule)."
    )
    replicas: list[ReplicaReport]
    control_timeout_s: float = Field(
        description="The app's control_timeout_s: a client sizes its waits for control calls from it."
    )


class Readiness(BaseModel):
    """`GET /ready`: whether the app serves, for probes (docs/operations.md#readiness)."""

    ready: bool = Field(description="Every one of num_replicas replicas answers, on the served weight version.")
    weight_version: int = Field(description="The served (published) weight version.")
    replicas_expected: int = Field(description="The app's num_replicas.")
    replicas_serving: int = Field(description="Replicas that answer on the served weight version.")
    waiting_for: list[str] = Field(
        default_factory=list, description="What keeps each other replica from serving (empty when ready)."
    )

    @classmethod
    def of(cls, status: StatusResponse, expected: int) -> Readiness:
        """The readiness `status` shows with `expected` replicas. A sync's hold does not count
        against it: generation resumes at its end, and a probe that failed every sync would take
        the app out of service while it works as it should."""
        waiting = []
        for r in status.replicas:
            if not r.ok:
                waiting.append(f"replica {r.replica_id} does not answer: {r.error or 'no answer'}")
            elif r.weight_version != status.weight_version:
                waiting.append(
                    f"replica {r.replica_id} is on weight version {r.weight_version}, not the served "
                    f"{status.weight_version} (it is loading it)"
                )
        serving = len(status.replicas) - len(waiting)
        if (missing := expected - len(status.replicas)) > 0:
            waiting.append(f"{missing} of {expected} replicas not running yet (starting, or restarting)")
        return cls(
            ready=serving >= expected,
            weight_version=status.weight_version,
            replicas_expected=expected,
            replicas_serving=serving,
            waiting_for=waiting,
        )


ControlCall = Literal["start", "stop", "update", "collective"]
"""A control call, as its bound counts broadcasts: see `control_bound_s`."""


def control_bound_s(call: ControlCall, control_timeout_s: float, transfer: CollectiveTransfer | None = None) -> float:
    """Longest a control call runs once it holds the control lock, each broadcast bounded by
    `control_timeout_s`: the app's own bound, and what a client waits for (plus a margin) before
    it repeats the call. A start may roll back (two broadcasts); a collective update counts its
    members, announces the group, joins and sends each bucket, then loads or drops
    (docs/design.md#cancellation-safe-control)."""
    broadcasts = {"start": 2, "stop": 1, "update": 1}
    if call != "collective":
        return broadcasts[call] * control_timeout_s
    if transfer is None:
        raise ValueError("the bound of a collective update needs its transfer (its buckets)")
    return 3 * control_timeout_s + receive_bound_s(transfer, control_timeout_s)


def receive_bound_s(transfer: CollectiveTransfer, control_timeout_s: float) -> float:
    """Longest the members take to receive `transfer`: each group operation (the join, then one
    per bucket) fails after `control_timeout_s`, and one more for the answers."""
    return (2 + len(plan_buckets(transfer))) * control_timeout_s


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
