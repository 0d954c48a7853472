"""`python -m profiling status|start|stop --url URL`: the CLI commands that talk to the app.

They use the trainer's HTTP client, so they live here; `profiling/` (no HTTP) adds them to its
CLI through the `rollout_profiler.app_commands` entry point (pyproject.toml).
"""

from __future__ import annotations

import os
from typing import Annotated, Any, TypeVar

import typer
from pydantic import BaseModel
from rich.table import Table

from profiling.cli import EXIT_FAILED, EXIT_UNREACHABLE, AsJson, _fail, _print_json, err, out
from serve_app.api import ReplicaReport, StartProfileResponse, StatusResponse, StopProfileResponse
from serve_app.control_token import CONTROL_TOKEN_ENV as TOKEN_ENV
from serve_app.control_token import DEPRECATED_TOKEN_ENV
from trainer.client import RolloutError, SyncRolloutClient

R = TypeVar("R", bound=BaseModel)

Url = Annotated[str, typer.Option(help="The app's base URL, e.g. http://127.0.0.1:8000.")]
Token = Annotated[
    str | None,
    typer.Option(
        envvar=TOKEN_ENV, help=f"Control token (sent as 'Authorization: Bearer'); also ${TOKEN_ENV}."
    ),
]
Timeout = Annotated[float, typer.Option(help="Seconds to wait for the app's answer.")]


def _call(
    url: str, token: str | None, timeout: float, model: type[R], method: str, *args: Any, **kwargs: Any
) -> R:
    """One call through the client (`method` answers a `model`); exits 3 if the app cannot be
    reached and 1 if it refuses."""
    if token is None and (token := os.environ.get(DEPRECATED_TOKEN_ENV)) is not None:
        err.print(f"warning: ${DEPRECATED_TOKEN_ENV} is deprecated and will be removed: set ${TOKEN_ENV}", markup=False)
    # No retries: a script calling the CLI decides itself whether to try again.
    with SyncRolloutClient(
        url, control_token=token, timeout_s=timeout, control_wait_s=timeout, retries=0, backlog_wait_s=0
    ) as client:
        try:
            answer = getattr(client, method)(*args, **kwargs)
        except RolloutError as e:
            if e.status == 0:
                _fail(EXIT_UNREACHABLE, f"{e.detail} at {url}; check --url and that the app is running")
            hint = f" (pass --token or set ${TOKEN_ENV})" if e.status == 401 else ""
            _fail(EXIT_FAILED, f"{e}{hint}")
        # The sync client forwards methods by name (untyped); the async method validated `model`.
        assert isinstance(answer, model)
        return answer


def _replicas_done(data: BaseModel, replicas: list[ReplicaReport], as_json: bool, title: str) -> None:
    """Print the per-replica answers; exit 1 if any replica did not carry the call out."""
    if as_json:
        _print_json(data)
    else:
        table = Table(title=title)
        for col in ("replica", "ok", "state", "step", "weights", "fwd steps", "error"):
            table.add_column(col)
        for r in replicas:
            table.add_row(
                r.replica_id,
                "yes" if r.ok else "NO",
                r.state or "-",
                str(r.active_step or "-"),
                str(r.weight_version),
                str(r.forward_steps or 0),
                r.error or "",
            )
        out.print(table)
    bad = [r.replica_id for r in replicas if not r.ok]
    if bad:
        _fail(EXIT_FAILED, f"{len(bad)} replica(s) did not carry it out: {', '.join(bad)}")


def status(url: Url, token: Token = None, timeout: Timeout = 30.0, as_json: AsJson = False) -> None:
    """GET /profile/status: the active step (or idle), weight version, and each replica's state."""
    st = _call(url, token, timeout, StatusResponse, "status")
    title = f"{st.state} (step {st.active_step}, weights v{st.weight_version}, paused {st.paused})"
    _replicas_done(st, st.replicas, as_json, title)


def start(
    url: Url,
    step: Annotated[int, typer.Option(min=1, help="The step to profile (generation on weights step-1).")],
    token: Token = None,
    tag: Annotated[str | None, typer.Option(help="A label for the window ([A-Za-z0-9._-]{1,64}).")] = None,
    max_forward_steps: Annotated[
        int | None, typer.Option(min=1, help="Cap the recording at this many engine steps.")
    ] = None,
    max_duration_s: Annotated[
        float | None, typer.Option(min=0.001, help="Cap the recording at this many seconds.")
    ] = None,
    max_trace_mb: Annotated[
        float | None, typer.Option(min=0.001, help="Trace budget per replica, MiB of trace JSON.")
    ] = None,
    timeout: Timeout = 60.0,
    as_json: AsJson = False,
) -> None:
    """POST /profile/start: start profiling STEP on every replica."""
    options = {
        "tag": tag,
        "max_forward_steps": max_forward_steps,
        "max_duration_s": max_duration_s,
        "max_trace_mb": max_trace_mb,
    }
    started = _call(
        url,
        token,
        timeout,
        StartProfileResponse,
        "start_profile",
        step,
        **{k: v for k, v in options.items() if v is not None},
    )
    _replicas_done(started, started.replicas, as_json, f"step {started.step}: {started.state}")


def stop(
    url: Url,
    step: Annotated[int, typer.Option(min=1, help="The step being profiled.")],
    token: Token = None,
    timeout: Timeout = 60.0,
    as_json: AsJson = False,
) -> None:
    """POST /profile/stop: stop STEP; traces are exported in the background (see `list`)."""
    stopped = _call(url, token, timeout, StopProfileResponse, "stop_profile", step)
    if not stopped.stopped and not as_json:
        out.print("nothing was being profiled", markup=False)
        return
    _replicas_done(stopped, stopped.replicas, as_json, f"step {stopped.step}: stopped")
    if not as_json and stopped.manifest:
        out.print(f"manifest: {stopped.manifest}", markup=False)


def register(app: typer.Typer) -> None:
    """Add status/start/stop to `python -m profiling` (the entry point's target)."""
    for command in (status, start, stop):
        app.command()(command)
