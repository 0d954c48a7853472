"""The app's arguments: the `args:` block of config/serve.yaml, validated when it is read.

Every rule that ties two keys together is checked here, by the builder, so `serve run` and
`serve deploy` refuse a bad config before any replica starts, naming the keys.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    create_model,
    field_validator,
    model_validator,
)

from profiling.config import (
    ProfileOptions,
    StepNumber,
    StrictModel,
    VerlProfilerKeys,
    VerlTool,
    VerlToolConfigs,
    relocate_note,
)
from profiling.weight_source import WeightSource, read_old_spelling
from serve_app.engines.options import Capability, EngineOptions
from serve_app.engines.registry import DEFAULT_ENGINE, ENGINE_OPTIONS, EngineName
from serve_app.limits import RequestLimits, StartLimits
from serve_app.net import is_loopback
from serve_app.tiny_model import TinyModelSpec

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ListenerOptions(StrictModel):
    """An HTTP listener of the app beside Serve's HTTP port (docs/design.md#control-path)."""

    host: str = "127.0.0.1"
    """The interface it listens on, on the node of each process that listens: loopback by
    default; any other needs a control token (control_token_env or control_token_file)."""
    port: int = Field(ge=1, le=65535)
    """Its TCP port (the app's HTTP port is Serve's, http_options.port)."""


class AppSchedule(VerlProfilerKeys):
    """verl's `global_profiler` block that the app applies itself, at every version change it
    sees, whichever route brought it: the server drives the steps (docs/design.md#who-drives).
    verl's block is accepted as written (docs/configuration.md#verls-blocks); the app records
    with its `profiler` settings."""

    tool: VerlTool = None
    """Left out: the app's profiler.tool. Written: null (verl's default) is profiling off, whatever
    steps says; a tool must be the app's profiler.tool (verl's torch_memory and precision_debugger
    are refused)."""
    steps: Annotated[list[StepNumber], Field(min_length=1)] | None = None
    """Profiled steps, e.g. [1, 2, 5]: step k is the generation on weights k-1; null (verl's
    default): the app profiles no step itself."""
    profile_continuous_steps: bool = False
    """Merge consecutive profiled steps into one window labelled by its first step."""
    save_path: str | None = None
    """verl's root of the traces: the app's are under its own save_path (another path here is
    accepted with a warning)."""
    global_tool_config: VerlToolConfigs = Field(default_factory=VerlToolConfigs)
    """verl's per-tool settings: the app records with its `profiler` block, so the tool's block
    here has no effect (set, it is accepted with a warning naming the key)."""

    @field_validator("steps")
    @classmethod
    def _sorted_unique(cls, steps: list[int] | None) -> list[int] | None:
        return None if steps is None else sorted(set(steps))

    @property
    def drives(self) -> bool:
        """Whether the app profiles steps itself: steps, and a tool unless it was left out."""
        return bool(self.steps) and ("tool" not in self.model_fields_set or self.tool is not None)


class _AppArgs(StrictModel):
    """The app's keys but the engines' blocks, which `AppArgs` adds from the registry."""

    engine: EngineName = DEFAULT_ENGINE
    """The engine each replica runs, by its `engine:` value (docs/engines.md lists them); by
    default the embedded one, which runs on CPU."""
    num_replicas: int = Field(2, ge=1)
    """Rollout replicas (Serve replicas of RolloutReplica), each with its own engine."""
    num_ingress_replicas: int = Field(1, ge=1)
    """HTTP front replicas (Serve replicas of RolloutIngress): more spread the parsing and
    answering of generation requests over more processes; all of them hand control calls to the
    app's one controller, so they share its desired state."""
    replica_num_cpus: float = Field(0.25, gt=0)
    """Fractional CPUs per replica, so several fit on a small machine."""
    replica_num_gpus: float = Field(0, ge=0)
    """GPUs per replica (vLLM/SGLang on GPU)."""
    replica_env: dict[str, str] = Field(default_factory=dict)
    """Environment variables of the replica processes (e.g. VLLM_CPU_KVCACHE_SPACE)."""
    save_path: str = "/tmp/rollout-profiler/traces"
    """Root of all step traces (step_<k>/ directories and their manifests)."""
    trace_collection: Literal["shared_fs", "ray"] = "shared_fs"
    """shared_fs: replicas write under save_path directly (one filesystem). ray: each replica
    writes under node_dir on its own node and ships its traces through Ray to the controller's
    node, which holds save_path (nodes that share no filesystem)."""
    node_dir: str = "/tmp/rollout-profiler/node"
    """A directory on every node: traces before shipping (trace_collection: ray) and weights
    received through the Ray object store."""
    max_replicas_per_node: int | None = Field(None, ge=1)
    """Spread replicas over nodes (Serve's max_replicas_per_node); null: no limit."""
    keep_steps: int | None = Field(None, ge=1)
    """Step directories kept under save_path, earlier runs moved aside included: a fresh start
    removes the least recently written beyond it (logged), except steps still being written
    (recording, exporting, merging, or their ranks view), kept until a later start. At least
    max_exporting_steps + 1. null: keep every step."""
    merge_on_complete: bool = True
    """Merge each complete or partial step into merged.trace.json.gz in the background."""
    weights_dir: str = "/tmp/rollout-profiler/weights"
    """/weights/update may only read paths inside this directory."""
    weight_transfer: Annotated[
        Literal[WeightSource.PATH, WeightSource.COLLECTIVE], BeforeValidator(read_old_spelling)
    ] = WeightSource.PATH
    """How trainers deliver weights besides a path or the object store, which always work. path
    (`file`, the old spelling, is read as path): nothing more. collective: each replica can join a
    process group with the trainer's publishing rank and receive the tensors by broadcast
    (`/weights/update` with source collective: docs/design.md#weights-by-collective)."""
    collective_backend: Literal["gloo", "nccl"] = "gloo"
    """The process-group backend of weight_transfer: collective: gloo on CPU, nccl between GPUs
    (replica_num_gpus > 0)."""
    control_token_env: str | None = None
    """Name of an environment variable of the ingress's process holding the control token: then
    /profile/* and /weights/* need 'Authorization: Bearer <token>'. The token itself is never in
    the app's args (the Ray dashboard and `serve config` show them)."""
    control_token_file: str | None = None
    """A file, readable where the ingress runs, holding the control token (instead of
    control_token_env)."""
    control_listener: ListenerOptions | None = None
    """A listener of its own for the control routes (/profile/*, /weights/update, /health,
    /metrics), served by the app's controller beside Serve's HTTP port, so that no control call
    waits behind generation in Serve's proxy or the ingress. The control routes stay on Serve's
    port too. null: none."""
    replica_listener: ListenerOptions | None = None
    """The app's whole HTTP API served by every rollout replica on a port of its own, beside
    Serve's HTTP port: generation runs in the replica's own process (no proxy, no ingress, no
    handle call), control calls go to the controller as from the ingress. The replicas of a
    node share the port (the kernel spreads connections over them); each node's replicas listen
    on that node. For RL-scale generation load (docs/operations.md#replica-listener). null: none."""
    profiler: ProfileOptions = Field(default_factory=ProfileOptions)
    """The replicas' profiler settings; a /profile/start may override some of them."""
    start_limits: StartLimits = Field(default_factory=StartLimits, validate_default=True)
    """The most a /profile/start may ask for (422 above it)."""
    global_profiler: AppSchedule | None = None
    """The steps the app profiles on its own, keyed to the weight versions clients publish, with
    the `profiler` settings: for frameworks that never call /profile/* (docs/design.md#who-drives).
    A client's /profile/start or /profile/stop takes over from it. null: only clients drive."""
    request_limits: RequestLimits = Field(default_factory=RequestLimits)
    """Bounds on generation requests (413, 422, 503 above them)."""
    model_path: str | None = None
    """HF checkpoint directory every replica loads; null builds the tiny Llama locally."""
    tiny_model: TinyModelSpec = Field(default_factory=TinyModelSpec)
    """Shape of the tiny Llama built when model_path is null."""
    model_name: str = "tiny-llama"
    """The served model's name in /v1/models and completions."""
    control_timeout_s: float = Field(30.0, gt=0)
    """Per control call, per replica: a replica that does not answer in time is reported failed."""
    resume_state: bool = False
    """A new deployment of this app (`serve run`, `serve deploy`) takes over the desired state the
    app's last deployment left in this Ray cluster (served version and weights, active step,
    hold). false: it starts clean. A controller that restarts within one deployment always
    keeps its state."""
    export_timeout_s: float = Field(600.0, gt=0)
    """Longest wait for a replica's trace export before its entry is recorded as lost."""
    max_exporting_steps: int = Field(4, ge=1)
    """Stopped steps whose traces may still be exporting before a new start is refused with 429
    (unexported recordings are held in replica memory)."""
    hold_timeout_s: float = Field(60.0, gt=0)
    """Longest a stop(pause=true) or update(resume=false) holds engine steps without the
    update or start that ends the hold, counted from when the hold began or from the end of the
    last weight load it covered (a load longer than this keeps the hold)."""
    client_pause_max_s: float = Field(600.0, gt=0)
    """Longest a client's pause (vLLM's `/pause`) lasts without its `/resume`: then generation
    goes on by itself, so a client that died mid-sync never leaves the app paused
    (docs/design.md#client-pause)."""
    min_free_disk_mb: float = Field(256.0, ge=0)
    """A start is refused with 507 when save_path has less free space than this."""

    @model_validator(mode="before")
    @classmethod
    def _no_token_in_args(cls, data: Any) -> Any:
        if isinstance(data, dict) and "control_token" in data:
            raise ValueError(
                "control_token in the app's args would be shown by the Ray dashboard and `serve config`: "
                "put the token in an environment variable of the ingress (control_token_env: NAME) or in "
                "a file (control_token_file: PATH), and remove control_token"
            )
        return data

    @model_validator(mode="after")
    def _collective_backend_fits(self) -> AppArgs:
        if self.collective_backend == "nccl" and self.weight_transfer != WeightSource.COLLECTIVE:
            raise ValueError(
                "collective_backend is only read with weight_transfer: collective: set weight_transfer: "
                "collective, or remove collective_backend"
            )
        if self.collective_backend == "nccl" and self.replica_num_gpus <= 0:
            raise ValueError(
                "collective_backend: nccl moves weights between GPUs, but replica_num_gpus is 0: give each "
                "replica a GPU (replica_num_gpus), or use collective_backend: gloo on CPU"
            )
        if self.weight_transfer == WeightSource.COLLECTIVE:
            self.engine_options.require(Capability.RECEIVE_COLLECTIVE)  # a ValueError: pydantic reports it
        return self

    @model_validator(mode="after")
    def _one_app_tool(self) -> AppArgs:
        schedule = self.global_profiler
        if schedule is not None and schedule.tool is not None and schedule.tool != self.profiler.tool:
            raise ValueError(
                f"global_profiler.tool is {schedule.tool!r} but profiler.tool is {self.profiler.tool!r}: the app "
                "records with profiler.tool; make them agree, or leave global_profiler.tool out"
            )
        return self

    def notes(self) -> list[str]:
        """One warning per key of `global_profiler` that is accepted but has no effect here, to be
        logged once by the builder."""
        g, where = self.global_profiler, "args.global_profiler"
        if g is None:
            return []
        out = []
        if not g.steps:
            out.append(f"{where}.steps is null: the app profiles no step itself; list the steps or remove the block")
        elif not g.drives:
            out.append(
                f"{where}.steps is {g.steps} but {where}.tool is null: the app profiles no step (verl's meaning "
                f"of tool: null); set {where}.tool: {self.profiler.tool} or leave the key out"
            )
        if not g.drives:
            return out
        out += relocate_note(g.relocate_results, where)
        if g.save_path is not None and Path(g.save_path).expanduser().resolve() != Path(self.save_path):
            out.append(
                f"{where}.save_path is {g.save_path!r}, which is not implemented here: the app's traces go under "
                f"args.save_path ({self.save_path}); the key has no effect"
            )
        if g.finish_hook_cmd:
            out.append(
                f"{where}.finish_hook_cmd is set, which the app does not run: the trainer's `python -m trainer` "
                "runs its own global_profiler.finish_hook_cmd (docs/trainer.md#finish-hook); the key has no effect"
            )
        tool = self.profiler.tool
        if g.global_tool_config.block(tool) is not None:
            out.append(
                f"{where}.global_tool_config.{tool} is set, which the app does not apply: it records with "
                "args.profiler (activities, record_shapes, with_stack, with_memory, npu); the block has no effect"
            )
        return out

    @model_validator(mode="after")
    def _listeners_guarded(self) -> AppArgs:
        has_token = self.control_token_env is not None or self.control_token_file is not None
        for key in ("control_listener", "replica_listener"):
            listener: ListenerOptions | None = getattr(self, key)
            if listener is not None and not has_token and not is_loopback(listener.host):
                raise ValueError(
                    f"{key}.host is {listener.host!r}, beyond loopback, and no control token is set: anyone who "
                    "reaches the port could drive profiling and weight updates. Set control_token_env (or "
                    "control_token_file), or listen on 127.0.0.1"
                )
        control, replica = self.control_listener, self.replica_listener
        if control is not None and replica is not None and control.port == replica.port:
            raise ValueError(
                f"control_listener.port and replica_listener.port are both {control.port}: the controller and a "
                "replica on one node cannot share a port; give each its own"
            )
        return self

    @model_validator(mode="after")
    def _keep_steps_fit_the_export_backlog(self) -> AppArgs:
        # At a start, up to max_exporting_steps stopped steps may still be written (exporting,
        # or the last one exported still merging), and the started step needs a directory too.
        least = self.max_exporting_steps + 1
        if self.keep_steps is not None and self.keep_steps < least:
            raise ValueError(
                f"keep_steps={self.keep_steps} leaves no room for the steps still being written at a start: "
                f"up to max_exporting_steps={self.max_exporting_steps} stopped steps may still be exporting, "
                f"plus the step being started, so keep_steps must be at least {least}: raise keep_steps "
                f"to {least} or more, lower max_exporting_steps, or set keep_steps: null (keep every step)"
            )
        return self

    @field_validator("engine", mode="wrap")
    @classmethod
    def _registered(cls, name: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # An engine added to the registry at run time (a test's, a plugin's) has no literal here.
        return name if isinstance(name, str) and name in ENGINE_OPTIONS else handler(name)

    @field_validator("control_token_env")
    @classmethod
    def _env_name(cls, name: str | None) -> str | None:
        if name is not None and not _ENV_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
        return name

    @field_validator("control_token_file")
    @classmethod
    def _one_token_source(cls, path: str | None, info: ValidationInfo) -> str | None:
        if path is not None and info.data.get("control_token_env") is not None:
            raise ValueError("set control_token_env or control_token_file, not both")
        return path

    @field_validator("save_path", "weights_dir", "node_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        # Replicas run in other working directories: pin relative paths where the app is built.
        return str(Path(v).expanduser().resolve())

    @field_validator("profiler")
    @classmethod
    def _engine_records_it(cls, profiler: ProfileOptions, info: ValidationInfo) -> ProfileOptions:
        # Runs only for a profiler block the config sets: asking an engine to profile.
        if (engine := info.data.get("engine")) is not None:
            ENGINE_OPTIONS[engine].require(Capability.PROFILE, "remove the profiler block")
            ENGINE_OPTIONS[engine].check_profiler(profiler, profiler)
        return profiler

    @field_validator("global_profiler")
    @classmethod
    def _engine_profiles(cls, schedule: AppSchedule | None, info: ValidationInfo) -> AppSchedule | None:
        if schedule is not None and (engine := info.data.get("engine")) is not None:
            ENGINE_OPTIONS[engine].require(Capability.PROFILE, "remove global_profiler")
        return schedule

    @field_validator("start_limits")
    @classmethod
    def _profiler_within_limits(cls, limits: StartLimits, info: ValidationInfo) -> StartLimits:
        if (profiler := info.data.get("profiler")) is not None and (problems := limits.problems(profiler)):
            raise ValueError(f"the app's profiler settings exceed start_limits: {'; '.join(problems)}")
        return limits

    @field_validator("tiny_model", *ENGINE_OPTIONS, check_fields=False)  # the blocks are AppArgs'
    @classmethod
    def _engine_rules_hold(cls, value: Any, info: ValidationInfo) -> Any:
        # The engine's own rules about the app's other keys (EngineOptions.app_problems).
        engine, key = info.data.get("engine"), str(info.field_name)
        if engine is not None and (why := ENGINE_OPTIONS[engine].app_problems({**info.data, key: value}).get(key)):
            raise ValueError(why)
        return value

    @field_validator(*ENGINE_OPTIONS, check_fields=False)
    @classmethod
    def _only_for_its_engine(cls, options: EngineOptions, info: ValidationInfo) -> EngineOptions:
        # Runs only for a block the config sets: a block of another engine would do nothing.
        engine = info.data.get("engine")
        if engine is not None and engine != info.field_name:
            raise ValueError(
                f"settings of engine {info.field_name!r}, but engine is {engine!r}: remove them, "
                f"or set engine: {info.field_name}"
            )
        return options

    @property
    def engine_options(self) -> EngineOptions:
        """The settings block of the selected engine (its defaults for an engine registered
        without a block of its own in these args)."""
        options: EngineOptions = getattr(self, self.engine, None) or ENGINE_OPTIONS[self.engine]()
        return options


def _engine_blocks() -> dict[str, Any]:
    """One settings block per registered engine, keyed by its `engine:` value: the registry is
    the one list of engines, so adding one adds its block here."""
    return {
        name: (
            options,
            Field(default_factory=options, description=f"Settings of engine: {name} (set only with that engine)."),
        )
        for name, options in ENGINE_OPTIONS.items()
    }


if TYPE_CHECKING:
    AppArgs = _AppArgs
else:
    # The blocks come after the other keys: their rules read `engine` and the keys before them.
    AppArgs = create_model(
        "AppArgs",
        __base__=_AppArgs,
        __module__=__name__,
        __doc__="Field docstrings are the fields' documentation (docs/configuration.md is generated from them).",
        **_engine_blocks(),
    )
