"""Profiler configuration (pydantic). Keys follow verl's `global_profiler` where verl has one."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

Tool = Literal["torch"]
Activity = Literal["cpu", "cuda"]

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

    model_config = ConfigDict(extra="forbid")


class ProfileOptions(StrictModel):
    """What one profiling session records and how it is bounded."""

    tool: Tool = "torch"
    activities: list[Activity] = Field(default_factory=lambda: ["cpu"], min_length=1)
    record_shapes: bool = False
    with_stack: bool = False
    with_memory: bool = False
    max_forward_steps: int | None = Field(
        200, ge=1, description="Stop recording after this many engine steps (null: unbounded)."
    )
    max_duration_s: float | None = Field(
        300.0, gt=0, description="Stop recording after this many seconds (null: unbounded)."
    )

    def merged(self, **overrides: object) -> ProfileOptions:
        """These options with the given non-None fields replaced (validated)."""
        data = self.model_dump()
        data.update({k: v for k, v in overrides.items() if v is not None})
        return ProfileOptions.model_validate(data)


class GlobalProfilerConfig(StrictModel):
    """verl's `global_profiler` keys, same meaning."""

    tool: Tool | None = "torch"
    steps: list[StepNumber] | None = Field(None, description="Profiled steps, e.g. [1, 2, 5]; null: off.")
    save_path: str = "outputs/profile"
    profile_continuous_steps: bool = False

    @field_validator("steps")
    @classmethod
    def _sorted_unique(cls, steps: list[int] | None) -> list[int] | None:
        return None if steps is None else sorted(set(steps))


def describe_validation_error(err: ValidationError, prefix: str = "") -> str:
    """One line per problem, each naming the offending key by its dotted path."""
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{path}'")
        else:
            lines.append(f"'{path}': {e['msg']}")
    return "; ".join(lines)
