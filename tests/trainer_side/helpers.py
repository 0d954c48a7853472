"""Helpers of the trainer-side tests: run the real loop in-process, read manifests and traces.

Imported relatively (`from .helpers import ...`) by the modules of this package.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
from support.traces import read_trace

from profiling.markers import parse_forward_step, parse_weight_update

REPO_ROOT = Path(__file__).resolve().parents[2]
RAY_STARTUP_TIMEOUT = "timed out during startup"
"""Ray's raylet has a fixed 30 s startup deadline that an overloaded 2-core box can miss: an
environment failure before a job did anything, worth one more run."""


def training_config(app: Any, *overrides: str):
    """A TrainerConfig sized for tests, pointed at `app`'s save_path and weights_dir."""
    from trainer.config import load_config

    return load_config(
        None,
        [
            "trainer.mini_batch_size=8",
            "trainer.trigger_parameter_sync_step=1",
            "rollout.max_tokens=8",
            "global_profiler.tool=torch",  # verl's default tool null profiles nothing
            f"global_profiler.save_path={app.save_path}",
            f"trainer.weights_dir={app.weights_dir}",
            *overrides,
        ],
    )


def run_training(cfg: Any, base_url: str, model_dir: Path) -> Any:
    """trainer.loop.run_training against the app at `base_url`, on a fresh event loop."""
    from trainer.client import RolloutClient
    from trainer.loop import run_training as _run

    async def go() -> Any:
        async with RolloutClient(base_url) as client:
            return await _run(cfg, client, str(model_dir))

    return asyncio.run(go())


def get_status(base_url: str) -> dict:
    """GET /profile/status as raw JSON (forward_steps_by_version keys are strings)."""
    r = httpx.get(f"{base_url}/profile/status", timeout=60.0)
    assert r.status_code == 200, f"/profile/status: {r.status_code} {r.text}"
    return r.json()


def read_manifest(save_path: Path, step: int) -> dict | None:
    path = Path(save_path) / f"step_{step}" / "manifest.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def wait_manifest(save_path: Path, step: int, statuses: tuple[str, ...] = ("complete",), timeout: float = 60.0) -> dict:
    """Poll step_<k>/manifest.json until its status is one of `statuses`."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = read_manifest(save_path, step)
        if last is not None and last["status"] in statuses:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"step {step} manifest never reached {statuses} within {timeout:.0f}s; last: "
                f"{json.dumps(last, indent=1)[:3000] if last else None}"
            )
        time.sleep(0.25)


def range_names(trace: dict) -> list[str]:
    """Names of the complete ('X') events of a Chrome trace: record_function ranges among them."""
    return [str(ev.get("name", "")) for ev in trace.get("traceEvents", []) if ev.get("ph") == "X"]


def forward_markers(trace: dict) -> list[tuple[int, int, int]]:
    """(index, step, weight_version) of every forward_step range."""
    return [(m.index, m.step, m.weight_version) for n in range_names(trace) if (m := parse_forward_step(n))]


def weight_update_versions(trace: dict) -> list[int]:
    return [v for n in range_names(trace) if (v := parse_weight_update(n)) is not None]


def entry_traces(step_dir: Path, entry: dict) -> list[dict]:
    """Every file of a manifest entry must exist; each is loaded as a gzip Chrome trace."""
    assert entry["files"], f"entry lists no files: {entry}"
    traces = []
    for rel in entry["files"]:
        path = step_dir / rel
        assert path.is_file(), f"{path} is listed in the manifest but missing"
        traces.append(read_trace(path))
    return traces


def entry_markers(step_dir: Path, entry: dict) -> list[tuple[int, int, int]]:
    return [m for t in entry_traces(step_dir, entry) for m in forward_markers(t)]


def by_role(manifest: dict, role: str) -> list[dict]:
    return [e for e in manifest["entries"] if e["role"] == role]


def forwards_by_version(status: dict) -> dict[str, dict[int, int]]:
    """replica_id -> {weight_version: forward passes the replica ran}, from /profile/status."""
    out = {}
    for r in status["replicas"]:
        assert r["ok"], f"replica did not answer the status call: {r}"
        out[r["replica_id"]] = {int(v): n for v, n in r["forward_steps_by_version"].items()}
    return out
