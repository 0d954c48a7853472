"""verl's `finish_hook_cmd`: a shell command run once, after the last profiled step's traces are
complete, typically to ship `save_path` off the node (docs/trainer.md#finish-hook).

verl runs it in each selected rank's worker at the stop of its last profiled step. Here the
traces of a step are complete only once the rollout side's exports have landed too (the step's
manifest settles), which the job sees after training, so the job runs it then: once per selected
trainer rank (all of them run on this node), with verl's environment for that rank. A command that
cannot start or exits non-zero is logged as an error; the job goes on.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Callable

from trainer.config import FinishHook

log = logging.getLogger(__name__)


def hook_env(hook: FinishHook, rank: int) -> dict[str, str]:
    """The command's environment for `rank`: this process's, plus verl's VERL_PROFILE_* variables."""
    env = dict(os.environ)
    env.update(
        VERL_PROFILE_SAVE_PATH=hook.save_path,
        VERL_PROFILE_TOOL=hook.tool,
        VERL_PROFILE_RANK=str(rank),
        VERL_PROFILE_PID=str(os.getpid()),
        VERL_PROFILE_ROLE=hook.role,
    )
    if hook.tool == "nsys":
        env["VERL_PROFILE_RAY_NSIGHT_DIR"] = hook.ray_nsight_dir
    return env


def run_finish_hook(hook: FinishHook, echo: Callable[[str], None]) -> list[int]:
    """Run `hook.cmd` with /bin/sh once per rank of `hook.ranks`, its merged output passed to
    `echo` line by line; the ranks whose command failed (did not start, or exited non-zero)."""
    failed = []
    for rank in hook.ranks:
        echo(f"[finish_hook] rank {rank}: running {hook.cmd!r} (VERL_PROFILE_SAVE_PATH={hook.save_path})")
        try:
            proc = subprocess.Popen(
                ["/bin/sh", "-c", hook.cmd],
                env=hook_env(hook, rank),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
            )
        except OSError as e:
            log.error(
                "finish_hook_cmd could not start for rank %s: %s (the traces stay under %s)", rank, e, hook.save_path
            )
            failed.append(rank)
            continue
        with proc:
            assert proc.stdout is not None  # piped above
            for line in proc.stdout:
                echo(f"[finish_hook] rank {rank}: {line.rstrip()}")
        if proc.returncode != 0:
            log.error(
                "finish_hook_cmd exited with status %s for rank %s: %r (the traces stay under %s; fix the "
                "command and run it by hand, with the VERL_PROFILE_* variables set)",
                proc.returncode,
                rank,
                hook.cmd,
                hook.save_path,
            )
            failed.append(rank)
    return failed
