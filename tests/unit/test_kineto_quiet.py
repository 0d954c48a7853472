"""Kineto's thread check, as a replica meets it: torch loaded on one thread, the first profiler
start on another. Kineto then prints `ERROR: External init callback must run in same thread as
registerClient` to stderr, whatever KINETO_LOG_LEVEL says; TorchProfilerBackend's first start
(init_kineto) keeps that line, and only that line, out of stderr."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from profiling.backends.torch_profiler import KINETO_THREAD_LINE, _stderr_without

OFF_THREAD_START = textwrap.dedent(
    """
    import sys, threading
    import torch
    from profiling.backends.torch_profiler import TorchProfilerBackend, init_kineto
    from profiling.config import ProfileOptions

    def first_start():
        print("before the first start", file=sys.stderr, flush=True)
        if sys.argv[1] == "backend":
            backend = TorchProfilerBackend(ProfileOptions(activities=["cpu"]))
            backend.start()
            torch.ones(4) + 1
            backend.stop()
        else:  # torch.profiler alone: what the check prints unfiltered
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
                torch.ones(4) + 1
        print("after the first start", file=sys.stderr, flush=True)

    thread = threading.Thread(target=first_start)
    thread.start()
    thread.join()
    """
)


def _stderr_of(mode: str) -> str:
    env = {**os.environ, "KINETO_LOG_LEVEL": "6"}
    run = subprocess.run(
        [sys.executable, "-c", OFF_THREAD_START, mode], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    return run.stderr


def test_the_first_start_off_the_loading_thread_prints_no_error_line():
    stderr = _stderr_of("backend")
    assert "ERROR" not in stderr, stderr
    assert "before the first start" in stderr and "after the first start" in stderr, stderr


def test_torch_profiler_alone_prints_the_line_this_backend_keeps_out():
    """The check above can fail: the same start without the backend prints the line (should a
    torch release stop printing it, this test says the filter can go)."""
    assert KINETO_THREAD_LINE.decode() in _stderr_of("plain")


def test_the_filter_drops_only_the_named_line(capfd):
    with _stderr_without(b"drop me"):
        os.write(2, b"kept 1\nplease drop me now\nkept 2\n")
        os.write(2, b"kept 3\n")
    os.write(2, b"kept 4\n")
    err = capfd.readouterr().err
    assert err.splitlines() == ["kept 1", "kept 2", "kept 3", "kept 4"], err
