"""Synthetic verl save_paths for the ingest's tests: trace files named as verl 0.9.1's profilers
name them (docs/analysis.md#verl), Kineto-shaped (`synth.kineto_trace`: the header with
`baseTimeNanoseconds` and `host_name`, the whole-recording span), at known wall-clock windows.

The run: T = 2 trainer steps per version, versions 1..5, steps [1, 2, 5] profiled. Trainer step S
runs over [S-1, S-1 + 0.9] s after `synth.T0_NS`; version k's sync is at the end of step 2k. The
rollout's window of step k opens just before the trainer step 2k-1 starts and stops 0.5 s into
trainer step 2k, so it stops 0.4 s before step k's trainer window closes (the margin).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from .synth import Ev, Proc, kineto_trace

MS = 1_000_000
SECOND = 1000 * MS
SYNC_EVERY = 2
STEPS = [1, 2, 5]
HOST = "node-a"
MARGIN_S = 0.4


def trainer_window(verl_step: int) -> tuple[int, int]:
    """(start, stop) ns after T0_NS of trainer step S's recording."""
    start = (verl_step - 1) * SECOND
    return start, start + 900 * MS


def rollout_window(step: int) -> tuple[int, int]:
    """(start, stop) ns after T0_NS of the rollout's recording of step k."""
    return (2 * step - 2) * SECOND - 50 * MS, (2 * step - 1) * SECOND + 500 * MS


def write_trace(path: Path, proc: Proc, host: str | None = HOST) -> Path:
    """`proc`'s Kineto-shaped trace (no clock markers: verl's profilers record none) at `path`."""
    trace, _ = kineto_trace(proc)
    header = {"schemaVersion": 1, **({"host_name": host} if host else {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps({**header, **trace}, indent=1).encode()
    path.write_bytes(gzip.compress(data))
    return path


def trainer_name(
    verl_step: int | None, rank: int = 0, pid: int = 4242, labels: tuple[str, ...] = ("actor", "train")
) -> str:
    """A trainer trace's name as verl's `build_trace_basename` and trace handler make it."""
    step = [] if verl_step is None else [f"step{verl_step}"]
    return "_".join([*labels, *step, f"rank{rank}", f"pid{pid}", f"2026010112{verl_step or 0:04d}123"]) + ".json.gz"


def write_trainer(save: Path, verl_step: int, rank: int = 0, pid: int = 4242, host: str | None = HOST) -> Path:
    window = trainer_window(verl_step)
    ops = [
        Ev("actor_update", window[0] + MS, 300_000.0, cat="user_annotation"),
        Ev("aten::mm", window[0] + 2 * MS, 50.0),
    ]
    proc = Proc("trainer", str(rank), os_pid=pid, with_clock=False, window=window, events=ops)
    return write_trace(save / trainer_name(verl_step, rank, pid), proc, host)


def write_recording(
    save: Path, window: tuple[int, int], replica: int = 0, engine_steps: int = 4, host: str | None = HOST
) -> Path:
    """One vLLM worker's trace of one window, in verl's replica directory, as vLLM names it."""
    steps = [
        Ev(f"execute_context_1(7)_generation_{i}({i})", window[0] + (i + 1) * 10 * MS, 2000.0, cat="user_annotation")
        for i in range(engine_steps)
    ]
    proc = Proc("rollout", f"r{replica}", os_pid=7000 + replica, with_clock=False, window=window, events=steps)
    name = f"rank0.{1_796_000_000_000_000_000 + window[1]}.pt.trace.json.gz"
    return write_trace(save / f"agent_loop_rollout_replica_{replica}" / name, proc, host)


def write_run(save: Path, replicas: int = 1) -> None:
    """The run of the module docstring: trainer traces of the profiled versions' steps, each
    replica's recording of each profiled step, and vLLM's op table beside them."""
    for k in STEPS:
        for s in range((k - 1) * SYNC_EVERY + 1, k * SYNC_EVERY + 1):
            write_trainer(save, s)
        for r in range(replicas):
            write_recording(save, rollout_window(k), replica=r, engine_steps=3 + k)
    for r in range(replicas):
        (save / f"agent_loop_rollout_replica_{r}" / "rank0.profiler_out.txt").write_text("op table\n")
