"""Work on a process's memory done in a forked child, off the process's GIL.

torch.profiler's export holds the GIL for its whole run (a vLLM worker's window of 200 engine
steps: a third of a second and more), so a background export thread stalls the model's own
thread in the same process: forward passes stop while a trace is written. A child forked from
the process shares its memory, recorded events included, copy on write: it writes the trace at a
lower CPU priority while the parent goes on, and the parent's thread only waits on a pipe."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import select
import signal
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CHILD_NICE = 10
"""How much lower the child's CPU priority is: below the engine and the trainer, above the
background merges (+19, profiling/analysis/background_merge.py), which nothing waits for: a
step's export holds the next start back once `max_exporting_steps` are pending."""


STALL_S = 20.0
"""A child whose CPU time has not moved for this long is stuck, not slow: killed, and its work
handed back (`ForkUnavailable`). A child forked from a threaded process inherits every lock as it
was at the fork, and one that another thread held then is never released in the child (seen:
an export that never ended in a process whose clock calls go through a preloaded library). An
export always computes or writes; even at its lower priority on a saturated machine it gets some
CPU every few seconds."""
_POLL_S = 1.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class ForkUnavailable(RuntimeError):
    """No child could do the work (no fork on this platform, CUDA is initialised here, the
    kernel refused, the child died without an answer, or it was stuck): do it in the process
    instead."""


def can_fork() -> bool:
    """Whether work may run in a forked child here. Not where CUDA is initialised: a child may
    not touch the parent's CUDA context, and the work could."""
    if not hasattr(os, "fork"):
        return False
    import torch

    return not torch.cuda.is_initialized()


def run_forked(work: Callable[[], dict[str, Any]], timeout_s: float) -> dict[str, Any]:
    """`work()` in a child forked from this process, at lower CPU priority; its result (plain
    JSON data) returned here. ForkUnavailable when no child can be forked, or when the child
    died without an answer or got stuck (a child forked from a threaded process inherits the
    locks other threads held, and rarely, it dies or waits forever on one: `STALL_S`); `work`
    must be safe to do again here.
    RuntimeError with the child's error when `work` raised; TimeoutError, with the child
    killed, when it did not finish within `timeout_s`."""
    if not can_fork():
        raise ForkUnavailable("fork is not available in this process")
    read_end, write_end = os.pipe()
    parent = os.getpid()
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns at a fork of a threaded process: the child runs only `work`,
            # which takes no lock another thread could hold, and exits without cleanup.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError as e:
        os.close(read_end)
        os.close(write_end)
        raise ForkUnavailable(f"fork failed: {e.strerror}") from None
    if pid == 0:  # the child: never returns
        _child(work, read_end, write_end, parent)
    os.close(write_end)
    try:
        payload = _read_all(read_end, pid, timeout_s)
    finally:
        os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if not payload:
        why = f"the forked child died without an answer ({_how_it_ended(status)})"
        log.warning("%s: the work is done in this process instead", why)
        raise ForkUnavailable(why)
    answer: dict[str, Any] = json.loads(payload)
    if "error" in answer:
        raise RuntimeError(answer["error"])
    result: dict[str, Any] = answer["result"]
    return result


def _child(work: Callable[[], dict[str, Any]], read_end: int, write_end: int, parent: int) -> None:
    try:
        _die_with(parent)
        os.close(read_end)
        # Nothing of the parent's stays open here but the answer's pipe: a listening socket
        # the parent closes must not live on in this child.
        os.closerange(3, write_end)
        os.closerange(write_end + 1, _max_fd())
        os.nice(CHILD_NICE)
        try:
            data = json.dumps({"result": work()}).encode()
        except BaseException as e:  # noqa: BLE001 - handed to the parent, which raises it
            data = json.dumps({"error": repr(e)}).encode()
        while data:
            data = data[os.write(write_end, data) :]
    finally:
        os._exit(0)  # no atexit handlers, no flushing of the parent's buffers


def _die_with(parent: int) -> None:
    """Have the kernel kill this child when its parent dies (Linux), as a thread of the parent
    would have died: no export outlives the process that recorded it."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


def _read_all(fd: int, pid: int, timeout_s: float) -> bytes:
    """The child's whole answer; the child killed at `timeout_s` (TimeoutError) or once stuck
    (`STALL_S` without CPU time: ForkUnavailable)."""
    chunks: list[bytes] = []
    now = time.monotonic()
    deadline = now + timeout_s
    cpu, moved_at = _cpu_ticks(pid), now
    while True:
        ready, _, _ = select.select([fd], [], [], max(0.0, min(deadline - now, _POLL_S)))
        now = time.monotonic()
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            cpu, moved_at = _cpu_ticks(pid), now
        elif now >= deadline:
            _kill(pid)
            raise TimeoutError(f"the forked child did not finish within {timeout_s:g}s and was killed")
        elif (ticks := _cpu_ticks(pid)) != cpu:
            cpu, moved_at = ticks, now
        elif ticks is not None and now - moved_at >= STALL_S:
            _kill(pid)
            why = f"the forked child used no CPU for {STALL_S:g}s (stuck on a lock another thread held at the fork)"
            log.warning("%s: killed; the work is done in this process instead", why)
            raise ForkUnavailable(why)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _cpu_ticks(pid: int) -> int | None:
    """The process's user + system CPU time, in clock ticks (None: not readable here, no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name, in parentheses, may hold spaces: count the fields after it.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)


def _how_it_ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


def _max_fd() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (OSError, ValueError):
        return 4096
