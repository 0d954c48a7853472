"""The trainer ranks' clocks against the app's, measured during a verl run through the plugin
(docs/frameworks/verl.md#clocks): one JSON line per rank per publish, beside verl's trainer
traces, so the ingest can place those traces on the app's timeline (`ClockOffset`,
docs/analysis.md#how-clocks-are-aligned)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ValidationError

from profiling.manifest import ClockOffset

CLOCKS_FILE = "rollout_profiler.trainer_clocks.record"
"""In verl's `global_profiler.save_path`. Not `*.json`: trace tools take every `*.json` of a
directory for a trace."""


class TrainerClock(BaseModel):
    """One trainer rank's clock against the app's, measured when it published a version."""

    rank: int
    pid: int
    hostname: str
    version: int
    """The version the rank was publishing."""
    measured_at: float
    """Unix seconds (the rank's clock) when it was measured."""
    offset: ClockOffset


def append_trainer_clock(trace_dir: Path, clock: TrainerClock) -> None:
    """Add `clock` to the records in `trace_dir` (one writer: the rollout server that receives them)."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    with open(trace_dir / CLOCKS_FILE, "a") as f:
        f.write(clock.model_dump_json() + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_trainer_clocks(trace_dir: Path) -> tuple[list[TrainerClock], list[str]]:
    """The records in `trace_dir` (none if there is no file) and, per line that is not one, why."""
    path = trace_dir / CLOCKS_FILE
    if not path.is_file():
        return [], []
    clocks, problems = [], []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            clocks.append(TrainerClock.model_validate_json(line))
        except ValidationError as e:
            problems.append(f"{CLOCKS_FILE} line {n} is not a clock record ({e.error_count()} error(s)); skipped")
    return clocks, problems


def clock_for(clocks: list[TrainerClock], rank: int, pid: int | None, version: int) -> ClockOffset | None:
    """The offset measured by trainer rank `rank` (in process `pid`, when known) nearest to the
    publish of `version` (None: that rank measured none)."""
    mine = [c for c in clocks if c.rank == rank and (pid is None or c.pid == pid)]
    if not mine:
        return None
    return min(mine, key=lambda c: (abs(c.version - version), c.offset.bound_ns)).offset
