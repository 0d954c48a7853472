"""The trace ranges this project records around engine work, formatted and parsed here only.

* a forward-step range (`FORWARD_STEP_SHAPE`) around each forward pass: the i-th of the window
  labelled k, run on weights v (docs/profiling.md#manifest-fields);
* a weight-update range (`weight_update version=<v>`) around a weight load inside a recording
  (a continuous window).

Every producer (the session, an engine's own workers, benchmarks) formats them with
`format_forward_step` / `format_weight_update`, and every reader (verify, the budget's cut,
tools, tests) parses them with `parse_forward_step` / `parse_weight_update`, so the names cannot
drift apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FORWARD_STEP = "forward_step#"
"""The name prefix of a forward-step range."""
WEIGHT_UPDATE = "weight_update"
"""The name prefix of a weight-update range."""

FORWARD_STEP_SHAPE = f"{FORWARD_STEP}<i> step=<k> weight_version=<v>"
"""The forward-step range's name as messages and docs spell it."""

_FORWARD = re.compile(rf"{re.escape(FORWARD_STEP)}(\d+) step=(\d+) weight_version=(-?\d+)")
_WEIGHT_UPDATE = re.compile(rf"{WEIGHT_UPDATE} version=(-?\d+)")


@dataclass(frozen=True)
class ForwardStepMarker:
    """What a forward-step range's name says."""

    index: int
    """The pass's number within its recording, from 0."""
    step: int
    """The label of the window that recorded it (its first step)."""
    weight_version: int
    """The weight version the pass ran on."""


def format_forward_step(index: int, step: int, weight_version: int) -> str:
    """The name of the range around forward pass `index` of the window labelled `step`, run on
    weights `weight_version`."""
    return f"{FORWARD_STEP}{index} step={step} weight_version={weight_version}"


def parse_forward_step(name: str) -> ForwardStepMarker | None:
    """The marker a range's name spells (None: not exactly a forward-step marker, e.g. another
    range, or a name that starts with `FORWARD_STEP` but lacks its step or version)."""
    m = _FORWARD.fullmatch(name)
    return ForwardStepMarker(int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def format_weight_update(version: int) -> str:
    """The name of the range around the load of weights `version`."""
    return f"{WEIGHT_UPDATE} version={version}"


def parse_weight_update(name: str) -> int | None:
    """The version a weight-update range's name loads (None: not a weight-update marker)."""
    m = _WEIGHT_UPDATE.fullmatch(name)
    return int(m.group(1)) if m else None
