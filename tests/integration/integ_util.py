"""Shared helpers of the integration tests: HTTP clients, polling, concurrent generation, traces.

A plain module beside this directory's conftest.py (which holds the fixtures): test modules import
from here directly (this directory is no package, so pytest puts it on sys.path).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
from support.traces import read_trace

from profiling.markers import parse_forward_step

T = TypeVar("T")

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}
"""What vLLM on CPU needs in this machine's tests (a replica's `replica_env`, or this process's)."""
HTTP_TIMEOUT_S = 60.0
RESTART_TIMEOUT_S = 120.0
PROMPTS = [
    "The rollout server answers prompts",
    "A weight update publishes a new parameter version",
    "Red green blue yellow",
    "One two three four five",
    "The quick brown fox jumps",
    "Questions and answers, prompts and completions",
]


@dataclass(frozen=True)
class HttpOptions:
    """How a module's `http` client (conftest.py's fixture) reaches its app: a module sets
    `HTTP = HttpOptions(...)` when the defaults do not fit."""

    app: str = "app"
    """The fixture that yields the module's app (a support.apps.ServeApp)."""
    timeout: float = HTTP_TIMEOUT_S
    token: str | None = None
    """A bearer token sent with every request (an app with `auth_token`)."""
    stop_at_end: bool | Callable[[Any], bool] = False
    """Leave the app idle at the end of the module (stop an active profiling session): True, or a
    callable that decides given the app (False for one the module deleted)."""


def client(base_url: str, token: str | None = None, timeout: float = HTTP_TIMEOUT_S) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=base_url, timeout=timeout, headers=headers)


def poll(fn: Callable[[], T], *, timeout: float, what: str, interval: float = 0.2) -> T:
    """Call `fn` until it returns something truthy; fail naming `what` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = fn()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


def ok(resp: httpx.Response, status: int = 200) -> dict:
    assert resp.status_code == status, f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text}"
    return resp.json()


def complete(c: httpx.Client, prompt: Any = "Hello", **body: Any) -> dict:
    return ok(c.post("/v1/completions", json={"prompt": prompt, **body}))


def complete_concurrently(c: httpx.Client, n: int = 6, max_tokens: int = 8, **body: Any) -> list[dict]:
    """`n` completions in flight at once (so the load balancer spreads them over replicas)."""
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(complete, c, PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, **body) for i in range(n)]
        return [f.result() for f in futures]


def status(c: httpx.Client) -> dict:
    return ok(c.get("/profile/status"))


def generate_until_all_recorded(c: httpx.Client, replicas: int, *, timeout: float = 60.0) -> list[dict]:
    """Generate concurrently until every replica's active session counted a forward step."""
    results: list[dict] = []

    def recorded() -> bool:
        results.extend(complete_concurrently(c))
        st = status(c)
        live = [r for r in st["replicas"] if r["ok"]]
        return len(live) >= replicas and all((r["forward_steps"] or 0) > 0 for r in live)

    poll(recorded, timeout=timeout, what=f"{replicas} replicas to record forward steps", interval=0.0)
    return results


def stop_if_active(c: httpx.Client) -> None:
    """Leave the app idle and admitting (for `finally` blocks)."""
    st = status(c)
    if st["active_step"] is not None:
        ok(c.post("/profile/stop", json={"step": st["active_step"]}))


def wait_manifest(c: httpx.Client, step: int, statuses: tuple[str, ...], timeout: float = 60.0) -> dict:
    def done() -> dict | None:
        r = c.get(f"/profile/steps/{step}")
        if r.status_code != 200:
            return None
        m = r.json()
        return m if m["status"] in statuses else None

    return poll(done, timeout=timeout, what=f"step {step} manifest status in {statuses}")


def trace_events(step_dir: Path, entry: dict) -> list[dict]:
    """All Chrome-trace events of a rollout entry's files (each listed file must exist)."""
    assert entry["files"], entry
    events: list[dict] = []
    for rel in entry["files"]:
        path = step_dir / rel
        assert path.is_file(), f"{path} listed in the manifest but missing"
        events += read_trace(path).get("traceEvents", [])
    return events


def forward_markers(events: list[dict]) -> list[tuple[int, int, int]]:
    """(index, step, weight_version) of every forward_step range, in index order."""
    found = []
    for ev in events:
        m = parse_forward_step(str(ev.get("name", "")))
        if m and ev.get("ph") == "X":
            found.append((m.index, m.step, m.weight_version))
    return sorted(found)


def check_entry_traces(
    step_dir: Path, entry: dict, step: int, versions: set[int] | None = None
) -> list[tuple[int, int, int]]:
    """Every file of a rollout entry exists, is a gzip Chrome trace, and its forward_step markers
    match the entry: one per counted forward step (indices 0..n-1), each labelled with this step
    and a weight version in `versions` (default: only the entry's weight_version)."""
    markers = forward_markers(trace_events(step_dir, entry))
    assert len(markers) == entry["forward_steps"], (len(markers), entry)
    assert [i for i, _, _ in markers] == list(range(entry["forward_steps"]))
    assert {s for _, s, _ in markers} <= {step}
    allowed = versions if versions is not None else {entry["weight_version"]}
    assert {v for _, _, v in markers} <= allowed, (markers[:3], entry)
    return markers


def _trace_file() -> str:
    from profiling.backends.torch_profiler import TRACE_FILE  # torch: only for the tests that stall

    return TRACE_FILE


def stall_export(entry_dir: Path) -> list[Path]:
    """Make the trace export of the replica owning `entry_dir` hang, deterministically: it writes
    its trace through temp files in that directory, and opening a FIFO for writing blocks until
    a reader comes (none will). A slow disk, without depending on how long an export takes."""
    trace = _trace_file()
    fifos = [entry_dir / f".{trace}.tmp.json", entry_dir / f".{trace}.tmp.gz"]
    for fifo in fifos:
        os.mkfifo(fifo)
    return fifos


def release_export(fifos: list[Path], timeout: float = 60.0) -> threading.Thread:
    """Let an export that `stall_export` stalled finish with its real trace; returns the thread
    doing it (join it before reading the trace). Kineto writes the JSON aside and renames it
    over the `.tmp.json` FIFO, so the export waits on the `.tmp.gz` one: read what it writes
    there, and once the export has renamed that FIFO to the trace's name, put the bytes read in
    its place as a file (the entry keeps the FIFO's size, 0)."""
    packed = fifos[1]
    trace = packed.parent / _trace_file()

    def release() -> None:
        with open(packed, "rb") as f:
            data = f.read()
        poll(
            lambda: trace.exists() and stat.S_ISFIFO(trace.stat().st_mode),
            timeout=timeout,
            what="the export to move its FIFO into place",
            interval=0.01,
        )
        written = packed.parent / ".released.tmp"
        written.write_bytes(data)
        written.replace(trace)

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    return thread


def kill_replica(report: dict, known_pids: set[int]) -> None:
    """SIGKILL the replica of `report`, which must be one of `known_pids` (replicas this test's
    app reported), never anything else."""
    pid = report["pid"]
    assert pid and pid in known_pids and pid != os.getpid(), report
    os.kill(pid, signal.SIGKILL)


def wait_for_fleet(
    c: httpx.Client, replicas: int, exclude: set[str], *, ingress_may_restart: bool = False
) -> list[dict]:
    """Until `replicas` replicas answer ok, none of them one in `exclude` (killed ones).
    `ingress_may_restart`: a failing status call (the ingress itself restarting) is waited out."""

    def healthy() -> list[dict] | None:
        try:
            st = status(c)
        except (AssertionError, httpx.HTTPError):
            if not ingress_may_restart:
                raise
            return None
        live = [r for r in st["replicas"] if r["ok"]]
        if len(live) == replicas and not {r["replica_id"] for r in live} & exclude:
            return live
        return None

    return poll(healthy, timeout=RESTART_TIMEOUT_S, what="a full fleet of live replicas", interval=0.5)


def write_perturbed_weights(model_dir: Path, out: Path, seed: int) -> Path:
    """The tiny model's full state dict with every tensor perturbed, as one safetensors file."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in model.state_dict().items():
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype)
        state[name] = (t + 0.05 * noise).contiguous()
    save_file(state, str(out))
    return out


@contextlib.asynccontextmanager
async def direct_vllm_engine(model_dir: Path, tmp: Path) -> AsyncIterator[Any]:
    """One `VllmEngine` behind its controller, built in this process, on the caller's event
    loop, as a replica builds it (its traces under `tmp`); shut down on the way out."""
    from support.engines import replica_sessions

    from profiling.store import TraceStore
    from serve_app.config import AppArgs
    from serve_app.engines.controller import EngineController
    from serve_app.engines.vllm.engine import VllmEngine

    os.environ.update(VLLM_ENV)
    exporter = ThreadPoolExecutor(1, thread_name_prefix="export")
    built = EngineController(
        VllmEngine,
        args=AppArgs(engine="vllm", vllm={"dtype": "float32", "max_model_len": 256}),
        model_dir=model_dir,
        session_factory=replica_sessions(TraceStore(tmp / "traces"), exporter, "direct0"),
        trace_dir=tmp / "engine",
    )
    await built.opened()
    try:
        yield built
    finally:
        await built.shutdown()
        exporter.shutdown(wait=True)


def run_example_in_cluster(example: Path, app: Any, model_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """Run a docs/examples trainer as a user runs it: a second Ray driver joining this test's
    cluster, against `app` (its URL, name and save_path), on `model_dir`."""
    import ray

    return subprocess.run(
        [
            sys.executable,
            str(example),
            "--url",
            app.base_url,
            "--app-name",
            app.name,
            "--ray-address",
            ray.get_runtime_context().gcs_address,
            "--save-path",
            str(app.save_path),
            "--model-path",
            str(model_dir),
            *extra,
        ],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=420,
    )


def process_log(proc: subprocess.CompletedProcess) -> str:
    """The tails of a finished process's stdout and stderr, for an assertion's message."""
    return f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"


def wait_complete_manifest(save_path: Path, step: int, timeout: float) -> dict:
    """step_<k>/manifest.json read from disk once it is complete (or its last state when the time is up)."""
    path = save_path / f"step_{step}" / "manifest.json"
    deadline = time.monotonic() + timeout
    manifest: dict = {}
    while time.monotonic() < deadline:
        if path.exists():
            manifest = json.loads(path.read_text())
            if manifest.get("status") == "complete":
                break
        time.sleep(0.5)
    return manifest


def complete_one(app: Any) -> dict:
    """One short completion through `app`'s /v1/completions (asserted 200)."""
    answer = httpx.post(
        f"{app.base_url}/v1/completions",
        json={"model": app.args.get("model_name", "tiny-llama"), "prompt": "One two three", "max_tokens": 6},
        timeout=120.0,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()
