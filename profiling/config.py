"""Profiler configuration (pydantic). Keys follow verl's `global_profiler` where verl has one."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

Tool = Literal["torch", "npu", "nsys"]
Activity = Literal["cpu", "cuda"]

# tool: npu (torch_npu.profiler). Names follow verl's NPUToolConfig and torch_npu's enums.
NpuContent = Literal["npu", "cpu", "memory", "shapes", "module", "stack"]
NpuLevel = Literal["level_none", "level0", "level1", "level2"]
NpuAicMetrics = Literal[
    "PipeUtilization",
    "ArithmeticUtilization",
    "Memory",
    "MemoryL0",
    "MemoryUB",
    "ResourceConflictRatio",
    "L2Cache",
    "MemoryAccess",
    "AiCoreNone",
]
NpuExportType = Literal["text", "db"]

# Names that become directory names: replica ids, tags. Never "." or "..".
SAFE_NAME = re.compile(r"(?!\.{1,2}\Z)[A-Za-z0-9._-]{1,64}")


def check_safe_name(value: str, kind: str = "name") -> str:
    """`value` if it is safe as one path component, else ValueError naming the rule."""
    if not SAFE_NAME.fullmatch(value):
        raise ValueError(f"{kind} {value!r} must match [A-Za-z0-9._-]{{1,64}} and not be '.' or '..'")
    return value


SafeName = Annotated[str, AfterValidator(check_safe_name)]

MAX_STEP = 10**9
"""Steps and versions are at most this (they become directory names)."""
StepNumber = Annotated[int, Field(ge=1, le=MAX_STEP)]


class StrictModel(BaseModel):
    """Base for every config/boundary model: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class NpuOptions(StrictModel):
    """`tool: npu` settings (torch_npu.profiler); verl's `tool_config.npu` keys plus two of
    torch_npu's `_ExperimentalConfig` knobs. Ignored by the other tools."""

    contents: list[NpuContent] = Field(
        default_factory=list,
        description="What to collect (verl's keys): npu, cpu (activities; if neither is named both "
        "are recorded), memory (profile_memory), shapes (record_shapes), module (with_modules), "
        "stack (with_stack). The top-level record_shapes/with_stack/with_memory also switch "
        "shapes/stack/memory on.",
    )
    level: NpuLevel = Field(
        "level0", description="torch_npu ProfilerLevel: level_none, level0, level1 or level2."
    )
    analysis: bool = Field(
        True,
        description="torch_npu parses the raw data when the recording stops (tensorboard_trace_handler "
        "analyse_flag). The parse runs inside stop, on the model thread; false leaves raw data to be "
        "parsed offline with torch_npu.profiler.profiler.analyse(<dir>).",
    )
    aic_metrics: NpuAicMetrics | None = Field(
        None,
        description="torch_npu AiCMetrics name (AI Core metrics, collected at level1/level2); "
        "null: torch_npu's default.",
    )
    export_type: NpuExportType = Field("text", description="torch_npu ExportType: text or db.")
    data_simplification: bool = Field(
        True, description="torch_npu _ExperimentalConfig data_simplification (drops intermediate data)."
    )
    min_free_staging_mb: float = Field(
        1024.0,
        ge=0,
        description="torch_npu writes its raw data in a staging directory under $TMPDIR first: a start "
        "is refused when that disk has less free space than this (MiB).",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_discrete(cls, data: Any) -> Any:
        if isinstance(data, dict) and "discrete" in data:
            raise ValueError(
                "discrete (verl's one-profiler-per-stage mode) does not apply: a rollout replica records "
                "each window (one step, or a continuous window) as one recording; remove the key"
            )
        return data

    @field_validator("contents")
    @classmethod
    def _unique(cls, contents: list[str]) -> list[str]:
        return list(dict.fromkeys(contents))


def _cpu_only() -> list[Activity]:
    return ["cpu"]


class ProfileOptions(StrictModel):
    """What one profiling session records and how it is bounded."""

    tool: Tool = Field(
        "torch",
        description="torch (torch.profiler), npu (torch_npu.profiler, Ascend) or nsys (a CUDA "
        "profiler capture range for `nsys profile --capture-range=cudaProfilerApi`).",
    )
    activities: list[Activity] = Field(
        default_factory=_cpu_only,
        min_length=1,
        description="What torch.profiler records: cpu (operators, ranges), cuda (kernels, copies).",
    )
    record_shapes: bool = Field(False, description="Record operators' input shapes.")
    with_stack: bool = Field(False, description="Record Python stacks (large traces, slow finalize).")
    with_memory: bool = Field(False, description="Record tensor allocations and frees.")
    max_forward_steps: int | None = Field(
        200, ge=1, description="Stop recording after this many engine steps (null: unbounded)."
    )
    max_duration_s: float | None = Field(
        300.0, gt=0, description="Stop recording after this many seconds (null: unbounded)."
    )
    max_trace_mb: float | None = Field(
        1024.0,
        gt=0,
        allow_inf_nan=False,
        description="Budget for one replica's trace of one window: MiB of trace JSON as exported, "
        "before compression (what a viewer loads). The window stops recording early when the steps "
        "recorded would exceed it (estimated from this process's earlier traces), and a torch trace "
        "still over it is cut after the last forward step that fits; the manifest entry says so "
        "(truncated, forward_steps_kept). Engine-owned traces (an engine's own profiler's) are only flagged "
        "(over_budget). Null: no budget.",
    )
    npu: NpuOptions = Field(default_factory=NpuOptions, description="Settings of tool: npu.")

    def merged(self, **overrides: object) -> ProfileOptions:
        """These options with the given non-None fields replaced (validated)."""
        data = self.model_dump()
        data.update({k: v for k, v in overrides.items() if v is not None})
        return ProfileOptions.model_validate(data)


# verl's own profiler blocks (verl 0.9.1: `global_profiler` in verl/trainer/config/ppo_trainer.yaml,
# each role's `profiler` in verl/trainer/config/profiler/profiler.yaml), accepted as written. What
# this project implements takes effect; a key it does not implement is accepted and named by one
# warning (`notes`) when its value asks for something, never silently (docs/configuration.md#verls-blocks).
VERL_TOOLS_NOT_HERE = {
    "torch_memory": "use tool: torch with profiler.with_memory: true for allocations",
    "precision_debugger": "msprobe's precision dumps have no counterpart here",
}
RAY_NSIGHT_LOG_DIR = "/tmp/ray/session_latest/logs/nsight"
"""Where Ray writes the reports of actors started with runtime_env nsight (verl's
VERL_PROFILE_RAY_NSIGHT_DIR)."""


def _tool_here(value: Any) -> Any:
    if isinstance(value, str) and value in VERL_TOOLS_NOT_HERE:
        raise ValueError(
            f"tool {value!r} is one of verl's but not implemented here ({VERL_TOOLS_NOT_HERE[value]}): "
            "set tool to torch, npu, nsys or null"
        )
    return value


VerlTool = Annotated[Tool | None, BeforeValidator(_tool_here)]
"""A verl block's `tool`: one of this project's, or null (off); verl's other tools refused by name."""


def relocate_note(relocate_results: bool | None, where: str) -> list[str]:
    """The note for verl's `relocate_results: true` at `where` (a no-op here), or none."""
    if not relocate_results:
        return []
    return [
        f"{where}.relocate_results is true: nothing to relocate here, each step's traces already are in "
        "one directory (save_path/step_<k>/); the key has no effect"
    ]


class VerlModel(StrictModel):
    """A verl config block: its keys by verl's names, `_target_` (verl's Hydra hint) included."""

    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)
    target: str | None = Field(
        None,
        alias="_target_",
        description="verl's Hydra instantiation hint (the dataclass verl builds from the block); "
        "accepted and read by nothing here.",
    )


class VerlTorchSchedule(VerlModel):
    """verl's `tool_config.torch.schedule` (torch.profiler.schedule over update mini-batches)."""

    skip_first: int = Field(0, ge=0, description="verl's; not implemented here (see active).")
    wait: int = Field(0, ge=0, description="verl's; not implemented here (see active).")
    warmup: int = Field(0, ge=0, description="verl's; not implemented here (see active).")
    active: int = Field(
        0,
        ge=0,
        description="verl: record this many update mini-batches per cycle (0: the whole step). Here a "
        "window always records the whole step: above 0 is accepted with a warning.",
    )
    repeat: int = Field(0, ge=0, description="verl's; not implemented here (see active).")
    name: str = Field("torch_schedule", description="verl's label of the block; read by nothing here.")


class _VerlToolBlock(VerlModel):
    discrete: bool = Field(
        False,
        description="verl: one trace per stage (true) or one per step (false). Here a window is one "
        "recording per process: true is accepted with a warning.",
    )

    def notes(self, where: str) -> list[str]:
        """One warning per key of this block that asks for what this project does not do."""
        out = []
        if self.discrete:
            out.append(
                f"{where}.discrete is true, which is not implemented here: each process records a window "
                "(one step, or a continuous window) as one trace; the key has no effect"
            )
        return out


class _VerlTokenRange(_VerlToolBlock):
    profile_token_start: int | None = Field(
        None,
        ge=0,
        description="verl: the rollout engines record from this response token on. Not implemented "
        "here (the app bounds a window with profiler.max_forward_steps): set, it is accepted with a warning.",
    )
    profile_token_end: int | None = Field(
        None,
        ge=0,
        description="verl: ... up to this response token (exclusive). Not implemented here, as profile_token_start.",
    )

    def notes(self, where: str) -> list[str]:
        out = super().notes(where)
        out += [
            f"{where}.{key} is set, which is not implemented here: a window records every engine step up to "
            "profiler.max_forward_steps; the key has no effect"
            for key in ("profile_token_start", "profile_token_end")
            if getattr(self, key) is not None
        ]
        return out


class VerlTorchToolConfig(_VerlTokenRange):
    """verl's `tool_config.torch` / `global_tool_config.torch` (TorchProfilerToolConfig)."""

    contents: list[Literal["cuda", "cpu", "memory", "shapes", "stack"]] = Field(
        default_factory=list,
        description="What torch.profiler records, by verl's names: cuda (activity CUDA), cpu (always "
        "recorded), memory (with_memory), shapes (record_shapes), stack (with_stack); added to this "
        "project's own keys. Empty: those keys alone decide (verl's empty list also records CUDA: "
        "list cuda, or set activities).",
    )
    schedule: VerlTorchSchedule | None = Field(None, description="verl's mini-batch schedule (see its active).")
    name: str = Field("torch", description="verl's label of the block; read by nothing here.")

    def notes(self, where: str) -> list[str]:
        out = super().notes(where)
        if self.schedule is not None and self.schedule.active > 0:
            out.append(
                f"{where}.schedule.active is {self.schedule.active}, which is not implemented here: a window "
                "records the whole step; the schedule has no effect"
            )
        return out

    def apply(self, options: ProfileOptions) -> ProfileOptions:
        """`options` with `contents` switched on as well."""
        c = set(self.contents)
        if not c:
            return options
        activities = list(dict.fromkeys([*options.activities, "cpu", *(["cuda"] if "cuda" in c else [])]))
        return options.merged(
            activities=activities,
            record_shapes=options.record_shapes or "shapes" in c,
            with_stack=options.with_stack or "stack" in c,
            with_memory=options.with_memory or "memory" in c,
        )


class VerlNpuToolConfig(_VerlTokenRange):
    """verl's `tool_config.npu` / `global_tool_config.npu` (NPUToolConfig); applied to `profiler.npu`."""

    contents: list[NpuContent] = Field(
        default_factory=list, description="Added to profiler.npu.contents (same names and meaning)."
    )
    level: NpuLevel | None = Field(None, description="Replaces profiler.npu.level when set.")
    analysis: bool | None = Field(None, description="Replaces profiler.npu.analysis when set.")
    name: str = Field("npu", description="verl's label of the block; read by nothing here.")

    def apply(self, options: ProfileOptions) -> ProfileOptions:
        """`options` with this block's settings in its `npu` block."""
        npu = options.npu.model_dump()
        npu["contents"] = list(dict.fromkeys([*npu["contents"], *self.contents]))
        npu.update({k: v for k in ("level", "analysis") if (v := getattr(self, k)) is not None})
        return options.merged(npu=npu)


class VerlNsysToolConfig(_VerlToolBlock):
    """verl's `global_tool_config.nsys` / `tool_config.nsys` (NsightToolConfig and Ray's nsight options)."""

    controller_nsight_options: dict[str, Any] | None = Field(
        None,
        description="verl: the nsys options of its driver (Ray runtime_env nsight). Not applied here: "
        "run the process under `nsys profile --capture-range=cudaProfilerApi` yourself "
        "(docs/profiling.md); with tool nsys, set, it is accepted with a warning.",
    )
    worker_nsight_options: dict[str, Any] | None = Field(
        None, description="verl: the nsys options of its workers. Not applied here, as controller_nsight_options."
    )
    name: str = Field("nsight", description="verl's label of the block; read by nothing here.")

    def notes(self, where: str) -> list[str]:
        out = super().notes(where)
        out += [
            f"{where}.{key} is set, which is not applied here: this project does not start processes under "
            "nsys; run the process under `nsys profile --capture-range=cudaProfilerApi --capture-range-end=repeat` "
            "with these options yourself (docs/profiling.md)"
            for key in ("controller_nsight_options", "worker_nsight_options")
            if getattr(self, key)
        ]
        return out

    def apply(self, options: ProfileOptions) -> ProfileOptions:
        return options


class VerlTorchMemoryToolConfig(VerlModel):
    """verl's `global_tool_config.torch_memory`: read only with verl's tool torch_memory, which this
    project refuses, so never in effect (as in verl with any other tool)."""

    trace_alloc_max_entries: int = Field(100_000, description="verl's; tool torch_memory only.")
    stack_depth: int = Field(32, description="verl's; tool torch_memory only.")
    memory_snapshot_num_steps: int = Field(1, description="verl's; tool torch_memory only.")
    context: str = Field("all", description="verl's; tool torch_memory only.")
    stacks: str = Field("all", description="verl's; tool torch_memory only.")
    kw_args: dict[str, Any] = Field(default_factory=dict, description="verl's; tool torch_memory only.")
    name: str = Field("torch_memory", description="verl's label of the block; read by nothing here.")


class VerlPrecisionDebuggerToolConfig(VerlModel):
    """verl's `global_tool_config.precision_debugger`: read only with verl's tool precision_debugger,
    which this project refuses, so never in effect (as in verl with any other tool)."""

    config_path: str | None = Field(None, description="verl's; tool precision_debugger only.")
    steps: list[int] | None = Field(None, description="verl's (deprecated there); tool precision_debugger only.")
    stages: list[str] | None = Field(None, description="verl's; tool precision_debugger only.")
    strict: bool = Field(False, description="verl's; tool precision_debugger only.")
    name: str = Field("precision_debugger", description="verl's label of the block; read by nothing here.")


class VerlToolConfigs(StrictModel):
    """verl's per-tool blocks (`global_tool_config`, a role's `tool_config`): only the block of
    the selected tool is read, as in verl."""

    torch: VerlTorchToolConfig | None = Field(None, description="Read with tool torch.")
    npu: VerlNpuToolConfig | None = Field(None, description="Read with tool npu.")
    nsys: VerlNsysToolConfig | None = Field(None, description="Read with tool nsys.")
    torch_memory: VerlTorchMemoryToolConfig | None = Field(None, description="verl's tool torch_memory (refused here).")
    precision_debugger: VerlPrecisionDebuggerToolConfig | None = Field(
        None, description="verl's tool precision_debugger (refused here)."
    )

    def block(self, tool: str | None) -> VerlTorchToolConfig | VerlNpuToolConfig | VerlNsysToolConfig | None:
        """The block of `tool` (None: none set)."""
        block: VerlTorchToolConfig | VerlNpuToolConfig | VerlNsysToolConfig | None = (
            getattr(self, tool) if tool in ("torch", "npu", "nsys") else None
        )
        return block

    def apply(self, tool: str | None, options: ProfileOptions) -> ProfileOptions:
        """`options` with the selected tool's block applied."""
        block = self.block(tool)
        return options if block is None else block.apply(options)

    def notes(self, tool: str | None, where: str) -> list[str]:
        block = self.block(tool)
        return [] if block is None else block.notes(f"{where}.{tool}")


def distinct_ranks(ranks: list[int], key: str) -> list[int]:
    if any(r < 0 for r in ranks) or len(set(ranks)) != len(ranks):
        raise ValueError(f"{key} {ranks} must list distinct ranks, each 0 or more")
    return ranks


class VerlProfilerKeys(VerlModel):
    """The keys verl's `global_profiler` and its roles' `profiler` blocks share."""

    relocate_results: bool = Field(
        False,
        description="verl: move traces written elsewhere (nsys reports, engine sub-directories) into "
        "save_path. A no-op here: every step's traces already are in one directory, "
        "save_path/step_<k>/ (true is accepted with a note).",
    )
    finish_hook_cmd: str | None = Field(
        None,
        description="A shell command run once, after the last profiled step's traces are complete "
        "(manifests settled, reports written), once per selected rank, with verl's environment: "
        "VERL_PROFILE_SAVE_PATH, VERL_PROFILE_TOOL, VERL_PROFILE_RANK, VERL_PROFILE_PID, "
        "VERL_PROFILE_ROLE (trainer) and, with tool nsys, VERL_PROFILE_RAY_NSIGHT_DIR. A failure is "
        "logged, never fails the job. null: none (docs/trainer.md#finish-hook).",
    )
    finish_hook_all_ranks: bool = Field(False, description="Run finish_hook_cmd for every trainer rank.")
    finish_hook_ranks: list[int] = Field(
        default_factory=list,
        description="The trainer ranks finish_hook_cmd runs for; [] (and finish_hook_all_ranks false): "
        "the profiled ranks.",
    )

    @field_validator("finish_hook_ranks")
    @classmethod
    def _hook_ranks(cls, ranks: list[int]) -> list[int]:
        return distinct_ranks(ranks, "finish_hook_ranks")


class GlobalProfilerConfig(VerlProfilerKeys):
    """verl's `global_profiler` block as written (docs/configuration.md#verls-blocks), plus our
    `merge_on_complete`."""

    tool: VerlTool = Field(
        None,
        description="The profiler (torch, npu or nsys); null (verl's default): profiling off whatever "
        "steps says. verl's torch_memory and precision_debugger are refused. The trainer's "
        "`profiler.tool`, if set, must agree.",
    )
    steps: list[StepNumber] | None = Field(None, description="Profiled steps, e.g. [1, 2, 5]; null: off.")
    save_path: str = Field("outputs/profile", description="Root of the step directories (the app's save_path).")
    profile_continuous_steps: bool = Field(
        False, description="Merge consecutive profiled steps into one window labelled by its first step."
    )
    merge_on_complete: bool = Field(
        True,
        description="Merge a step's traces into step_<k>/merged.trace.json.gz when its manifest "
        "becomes complete or partial (in a background child process).",
    )
    global_tool_config: VerlToolConfigs = Field(
        default_factory=VerlToolConfigs,
        description="verl's per-tool settings; the block of `tool` applies to every recording of the "
        "trainer (a role's `profiler.tool_config` overrides it).",
    )

    @field_validator("steps")
    @classmethod
    def _sorted_unique(cls, steps: list[int] | None) -> list[int] | None:
        return None if steps is None else sorted(set(steps))

    @property
    def profiles(self) -> bool:
        """Whether any step is profiled: a tool and steps (verl's meaning)."""
        return self.tool is not None and bool(self.steps)

    def notes(self, where: str = "global_profiler") -> list[str]:
        """One warning per key that is accepted but has no effect here."""
        out = []
        if self.steps and self.tool is None:
            out.append(
                f"{where}.steps is {self.steps} but {where}.tool is null: nothing is profiled (verl's "
                f"meaning of tool: null); set {where}.tool: torch (or npu, nsys) to profile these steps"
            )
        out += relocate_note(self.relocate_results, where)
        return out + self.global_tool_config.notes(self.tool, f"{where}.global_tool_config")


def describe_validation_error(err: ValidationError, prefix: str = "") -> str:
    """One line per problem, each naming the offending key by its dotted path."""
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
        # A rule's own message, without pydantic's "Value error, " in front of it.
        msg = str(e["ctx"]["error"]) if e["type"] == "value_error" else e["msg"]
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{path}'")
        else:
            lines.append(f"'{path}': {msg}" if path else msg)
    return "; ".join(lines)
