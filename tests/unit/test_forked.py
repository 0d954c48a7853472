"""Work done in a forked child (profiling/backends/forked.py), and the torch backend's export
through it: the answer comes back, the child runs at lower priority with none of the parent's
descriptors, a failure or a hang in it is reported (a hang killed), and a recorded trace exported
in a child is the same trace as one exported in the process."""

from __future__ import annotations

import functools
import gzip
import json
import multiprocessing
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.profiler import record_function

from profiling.backends import forked, torch_profiler
from profiling.backends.forked import CHILD_NICE, ForkUnavailable, run_forked
from profiling.backends.torch_profiler import TorchProfilerBackend
from profiling.config import ProfileOptions
from profiling.markers import format_forward_step


def test_the_child_answers_at_lower_priority_without_the_parents_descriptors():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)

        def work() -> dict:
            return {"pid": os.getpid(), "nice": os.nice(0), "fds": [int(f) for f in os.listdir("/proc/self/fd")]}

        answer = run_forked(work, timeout_s=30)
        assert answer["pid"] != os.getpid()
        assert answer["nice"] == os.nice(0) + CHILD_NICE
        assert listening.fileno() not in answer["fds"], "a socket of the parent must not live on in the child"


def test_a_failure_in_the_child_is_raised_here():
    def work() -> dict:
        raise ValueError("no room on the disk")

    with pytest.raises(RuntimeError, match=r"ValueError\('no room on the disk'\)"):
        run_forked(work, timeout_s=30)


def test_a_child_that_dies_without_an_answer_hands_the_work_back_naming_how_it_died():
    def work() -> dict:
        os.kill(os.getpid(), signal.SIGSEGV)
        return {}

    with pytest.raises(ForkUnavailable, match=r"died without an answer \(killed by SIGSEGV\)"):
        run_forked(work, timeout_s=30)


def test_a_child_that_hangs_is_killed_at_the_timeout():
    def work() -> dict:
        time.sleep(3600)
        return {}

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="killed"):
        run_forked(work, timeout_s=0.5)
    assert time.monotonic() - t0 < 10


def test_a_child_stuck_on_a_lock_another_thread_held_at_the_fork_is_killed_and_hands_the_work_back(monkeypatch):
    """The child inherits the lock as it was at the fork, held, and nobody in the child will
    release it: no CPU time passes, so it is killed after STALL_S, not at the (hour-long) timeout."""
    monkeypatch.setattr(forked, "STALL_S", 1.0)
    held, release = threading.Lock(), threading.Event()

    def hold() -> None:
        with held:
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        while not held.locked():
            time.sleep(0.01)

        def work() -> dict:
            with held:
                return {"done": True}

        t0 = time.monotonic()
        with pytest.raises(ForkUnavailable, match=r"used no CPU for 1s"):
            run_forked(work, timeout_s=60)
        assert time.monotonic() - t0 < 10
    finally:
        release.set()
        holder.join()
    assert work() == {"done": True}, "the work hands back, done here once the lock is free"


def test_without_the_stall_check_a_stuck_child_waits_out_the_whole_timeout(monkeypatch):
    """The test above fails without the check: the same stuck child is only ended by the timeout."""
    monkeypatch.setattr(forked, "_cpu_ticks", lambda pid: None)  # as where /proc cannot be read
    monkeypatch.setattr(forked, "STALL_S", 0.5)

    def work() -> dict:
        threading.Event().wait(3600)
        return {}

    with pytest.raises(TimeoutError, match="did not finish within 3s"):
        run_forked(work, timeout_s=3)


def test_a_busy_child_is_not_taken_for_a_stuck_one(monkeypatch):
    monkeypatch.setattr(forked, "STALL_S", 0.5)

    def work() -> dict:
        end, n = time.monotonic() + 2.0, 0
        while time.monotonic() < end:
            n += 1
        return {"n": n}

    assert run_forked(work, timeout_s=60)["n"] > 0


def _sleep_noting_pid(path: str) -> dict:
    Path(path).write_text(str(os.getpid()))
    time.sleep(3600)
    return {}


def _parent_of_a_sleeping_child(path: str) -> None:
    run_forked(functools.partial(_sleep_noting_pid, path), timeout_s=3600)


def _gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie nobody reaps counts as exited)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def test_the_child_dies_with_its_parent(tmp_path):
    """A replica killed mid-export takes its export's child with it, as it took an export thread."""
    noted = tmp_path / "child.pid"
    parent = multiprocessing.get_context("spawn").Process(target=_parent_of_a_sleeping_child, args=(str(noted),))
    parent.start()
    deadline = time.monotonic() + 60
    while not noted.exists() or not noted.read_text():
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.05)
    child = int(noted.read_text())
    assert not _gone(child)
    parent.kill()
    parent.join(10)
    deadline = time.monotonic() + 10
    while not _gone(child):
        assert time.monotonic() < deadline, f"the child {child} outlived its killed parent"
        time.sleep(0.05)


def _recorded(steps: int):
    backend = TorchProfilerBackend(ProfileOptions(tool="torch", activities=["cpu"]))
    backend.start()
    x = torch.ones(8, 8)
    for i in range(steps):
        with backend.mark(format_forward_step(i, 1, 0)), record_function("work"):
            x = torch.tanh(x @ x)
    return backend.stop()


def _names(path) -> list[str]:
    with gzip.open(path) as f:
        return sorted(e["name"] for e in json.load(f)["traceEvents"] if e.get("ph") == "X")


@pytest.mark.parametrize("in_child", [True, False])
def test_an_export_in_a_child_writes_the_same_trace_as_one_here(tmp_path, monkeypatch, in_child):
    if not in_child:
        monkeypatch.setattr(forked, "can_fork", lambda: False)
    trace = _recorded(5)
    (path,) = trace.export(tmp_path)
    names = _names(path)
    assert [n for n in names if n.startswith("forward_step#")] == [format_forward_step(i, 1, 0) for i in range(5)]
    assert names.count("work") == 5 and "aten::mm" in names
    assert trace.trace_bytes and trace.trace_bytes > path.stat().st_size
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary file is left"


def test_where_no_child_can_be_forked_the_export_runs_here(tmp_path, monkeypatch):
    calls = []

    def refuse(work, timeout_s):
        calls.append(timeout_s)
        raise ForkUnavailable("fork failed: Cannot allocate memory")

    monkeypatch.setattr(torch_profiler, "run_forked", refuse)
    (path,) = _recorded(2).export(tmp_path)
    assert calls and path.exists()


def test_an_export_whose_child_crashes_is_written_here_and_nothing_is_lost(tmp_path, monkeypatch):
    """A child forked from a threaded process can die on a lock another thread held (seen once in
    about 200 exports of a soak): the recording is still in this process, so it is written here."""
    parent, write = os.getpid(), torch_profiler._write

    def crash_in_the_child(prof, out_dir, options):
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGSEGV)
        return write(prof, out_dir, options)

    monkeypatch.setattr(torch_profiler, "_write", crash_in_the_child)
    (path,) = _recorded(3).export(tmp_path)
    marks = [n for n in _names(path) if n.startswith("forward_step#")]
    assert marks == [format_forward_step(i, 1, 0) for i in range(3)]
