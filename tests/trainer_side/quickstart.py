"""Run docs/quickstart.md's shell blocks as written.

A fenced ```bash block runs when the line before it is a marker:

    <!-- quickstart: run NAME -->          run to completion (bash -euo pipefail), cwd = repo root
    <!-- quickstart: background NAME -->   a server: started in its own session, stopped by pid

Every other ```bash block of the page must be one of README.md's commands (the test command,
which would run the whole suite from inside it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .helpers import REPO_ROOT

PAGE = REPO_ROOT / "docs" / "quickstart.md"
README = REPO_ROOT / "README.md"
_BLOCK = re.compile(
    r"(?:<!-- quickstart: (?P<kind>run|background) (?P<name>[\w-]+) -->\n)?```bash\n(?P<body>.*?)\n```", re.S
)
VENV = REPO_ROOT / ".venv"
"""The virtual environment README.md's commands make and activate (the main-job block among them)."""
MAIN_JOB_TIMEOUT_S = 1500.0
"""The set-up (about 15 s of pip when the venv has everything; making it first, about 1.5 minutes on
2 cores, more where pip downloads everything) plus the 30-version main job (1 to 3 minutes on 2
cores), with room for a loaded machine."""
LOCK = Path("/tmp/rollout-profiler-quickstart.lock")
"""Serialises quick-start runs of several test sessions: they share the repo's outputs/ and port 8000."""


@dataclass(frozen=True)
class Block:
    kind: str | None  # "run", "background", or None (not run)
    name: str | None
    body: str


@dataclass
class BlockRun:
    block: Block
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def log(self) -> str:
        return (
            f"--- {self.block.name} (exit {self.returncode}, {self.seconds:.0f}s) ---\n{self.block.body}\n"
            f"--- stdout tail ---\n{self.stdout[-6000:]}\n--- stderr tail ---\n{self.stderr[-4000:]}"
        )


def blocks(page: Path = PAGE) -> list[Block]:
    """Every ```bash block of `page`, with its marker if it has one."""
    return [Block(m["kind"], m["name"], m["body"]) for m in _BLOCK.finditer(page.read_text())]


def block(name: str) -> Block:
    found = [b for b in blocks() if b.name == name]
    assert len(found) == 1, f"{PAGE.name} must have exactly one block marked {name!r}; found {len(found)}"
    return found[0]


def readme_commands() -> list[str]:
    """README.md's first two commands (the main job, the tests)."""
    return re.findall(r"```bash\n(.+?)\n```", README.read_text())[:2]


def environment() -> dict[str, str]:
    """The environment a user's shell would give the commands, loopback-only Ray, no stale RAY_ADDRESS.

    The main-job block (README.md's first command) makes and activates VENV, and the user's shell
    stays in it for the later blocks: once VENV exists, every block runs with it activated (its
    bin/ first on PATH, VIRTUAL_ENV), as `. .venv/bin/activate` leaves a shell, whether this
    process runs in that venv or not."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONHOME")}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    if (VENV / "bin" / "python").exists():
        bin_dir = str(VENV / "bin")
        path = [p for p in env.get("PATH", os.defpath).split(os.pathsep) if p and p != bin_dir]
        env.update(VIRTUAL_ENV=str(VENV), PATH=os.pathsep.join([bin_dir, *path]))
    return env


def run(b: Block, timeout_s: float) -> BlockRun:
    """Run a `run` block as a bash script from the repo root."""
    assert b.kind == "run", f"block {b.name!r} is not marked to run to completion"
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", b.body],
            cwd=REPO_ROOT,
            env=environment(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as e:
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        return BlockRun(b, 124, out, err + f"\n(killed after {timeout_s:.0f}s)", time.monotonic() - t0)
    return BlockRun(b, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0)


@contextlib.contextmanager
def background(b: Block, log: Path) -> Iterator[subprocess.Popen]:
    """Start a `background` block in its own session; on exit stop it and everything it started
    (a Ray cluster's processes share its process group), by its pid."""
    assert b.kind == "background", f"block {b.name!r} is not marked as a background server"
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", "-c", b.body],
            cwd=REPO_ROOT,
            env=environment(),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: pgid == proc.pid
        )
        try:
            yield proc
        finally:
            stop_group(proc)


def stop_group(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """Ctrl-C (serve run shuts Serve and its Ray down), then TERM/KILL whatever of the group is left."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        if not group_alive(proc.pid):
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait_s
        while group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def set_aside(*paths: Path) -> Iterator[None]:
    """Move existing `paths` out of the way (the quick start writes there), and put them back
    afterwards in place of what the run wrote."""
    moved: list[tuple[Path, Path]] = []
    try:
        for p in paths:
            if p.exists():
                aside = p.with_name(f".{p.name}.set-aside-by-quickstart-test-{os.getpid()}")
                p.rename(aside)
                moved.append((p, aside))
        yield
    finally:
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
        for p, aside in moved:
            aside.rename(p)


@contextlib.contextmanager
def exclusive() -> Iterator[None]:
    """Hold LOCK: one quick-start run at a time on this machine."""
    with LOCK.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def json_values(text: str) -> list[object]:
    """The JSON values printed one after another (curl -s prints no newline between answers)."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while (i := _skip_space(text, i)) < len(text):
        value, i = decoder.raw_decode(text, i)
        values.append(value)
    return values


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i
