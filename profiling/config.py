"""Profiler configuration (pydantic). Keys follow verl's `global_profiler` where verl has one."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

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


class GlobalProfilerConfig(StrictModel):
    """verl's `global_profiler` keys, same meaning."""

    tool: Tool | None = Field(
        "torch",
        description="The trainer-side profiler (torch, npu or nsys); null: profiling off whatever "
        "steps says (verl's meaning). The trainer's `profiler.tool`, if set, must agree.",
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

    @field_validator("steps")
    @classmethod
    def _sorted_unique(cls, steps: list[int] | None) -> list[int] | None:
        return None if steps is None else sorted(set(steps))


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
