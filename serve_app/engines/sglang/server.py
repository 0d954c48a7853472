"""The SGLang server process a replica launches (SGLang runs as its own server process).

The command is `server_command + --model-path <dir> --host 127.0.0.1 --port <free port> +
server_args`, the arguments `python -m sglang.launch_server` takes. The child runs in a session
of its own, so terminating it reaches SGLang's scheduler and detokenizer subprocesses too and
nothing else. Its stdout and stderr go to a log file next to the replica's trace directory: SGLang
reports why a profiler call failed only there.

Readiness is `GET /health` answering 200: SGLang starts HTTP once the model is loaded and
answers 503 while its warmup is still running.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import time
from collections import deque
from pathlib import Path

import httpx

from serve_app.net import free_port

_POLL_S = 0.5
_TAIL_LINES = 20
_TERMINATE_GRACE_S = 30.0


def tail(path: Path, lines: int = _TAIL_LINES) -> str:
    """The last `lines` lines of a text file ("" if it cannot be read)."""
    try:
        with path.open("r", errors="replace") as f:
            return "".join(deque(f, maxlen=lines)).rstrip()
    except OSError:
        return ""


def wait_ready(url: str, timeout_s: float, server: SglangServer | None = None) -> None:
    """Return once `GET {url}/health` answers 200; fail if `server` exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    with httpx.Client(timeout=5.0) as http:
        while True:
            if server is not None and (code := server.returncode()) is not None:
                raise RuntimeError(
                    f"the SGLang server exited with code {code} before it was ready; command: "
                    f"{' '.join(server.argv)}; last lines of {server.log_path}:\n{server.log_tail()}"
                )
            try:
                resp = http.get(f"{url}/health")
                if resp.status_code == 200:
                    return
                last = f"HTTP {resp.status_code}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                where = f"; last lines of {server.log_path}:\n{server.log_tail()}" if server else ""
                raise RuntimeError(
                    f"the SGLang server at {url} was not ready within {timeout_s:.0f}s "
                    f"(GET /health: {last}); raise sglang.startup_timeout_s if it is still loading{where}"
                )
            time.sleep(_POLL_S)


class SglangServer:
    """One SGLang server child process, launched and owned by this replica."""

    def __init__(self, command: list[str], server_args: list[str], model_dir: Path, log_path: Path):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.argv = [
            *command,
            "--model-path", str(model_dir),
            "--host", "127.0.0.1",
            "--port", str(port),
            *server_args,
        ]
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            try:
                self._proc = subprocess.Popen(
                    self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            except OSError as e:
                raise RuntimeError(
                    f"cannot launch the SGLang server ({' '.join(self.argv)}): {e}; "
                    "set sglang.server_command to a command that exists in the replica's environment"
                ) from e
        # The replica's __del__ terminates the server; this covers an exit that skips it.
        atexit.register(self.terminate)

    def returncode(self) -> int | None:
        return self._proc.poll()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def log_tail(self) -> str:
        return tail(self.log_path)

    def terminate(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after a grace period; idempotent."""
        atexit.unregister(self.terminate)
        if self._proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self._proc.wait(_TERMINATE_GRACE_S)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self._proc.wait()
        # SGLang's own subprocesses may outlive a parent that died first.
        self._signal(signal.SIGKILL)

    def _signal(self, sig: signal.Signals) -> None:
        # The child leads its own session, so its group id is its pid: only its tree is reached.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)
