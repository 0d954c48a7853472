"""Cost of having profiling configured on syncs that do not profile, measured side by side.

Each round runs one weight sync through ProfiledWeightSync with profiling off (no steps) and one
with profiling configured for a step that this sync does not touch, in alternating order, and
prints the ratio of the medians (goal <= 1.02: a step that is not profiled costs nothing).

    python benchmarks/sync_overhead.py [--rounds 40]
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import typer
from rich.console import Console
from safetensors.torch import load_file, save_file

from profiling.schedule import StepSchedule
from serve_app.tiny_model import ensure_tiny_model
from trainer.client import RolloutClient
from trainer.local_app import local_cluster, run_app
from trainer.profiled_sync import ProfiledWeightSync

console = Console()


async def _measure(url: str, weights: Path, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"off": [], "configured": []}
    async with RolloutClient(url) as client:
        syncs = {
            "off": ProfiledWeightSync(StepSchedule(None), client, save_path=None),
            "configured": ProfiledWeightSync(StepSchedule([10_000]), client, save_path=None),
        }
        version = 0
        for i in range(rounds):
            for mode in ("off", "configured") if i % 2 == 0 else ("configured", "off"):
                version += 1
                t0 = time.perf_counter()
                await syncs[mode].sync(version, weights)
                times[mode].append(time.perf_counter() - t0)
    return times


def main(rounds: int = typer.Option(40, help="Syncs per mode.")) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    model = ensure_tiny_model(cache_dir=tmp / "model")
    (tmp / "weights").mkdir()
    weights = tmp / "weights" / "w.safetensors"
    save_file(load_file(str(model / "model.safetensors")), str(weights))
    with local_cluster() as port:
        url = run_app(port, "rollout", {
            "num_replicas": 2, "save_path": str(tmp / "traces"), "weights_dir": str(tmp / "weights"),
            "model_path": str(model), "min_free_disk_mb": 1,
        })
        times = asyncio.run(_measure(url, weights, rounds))
    off, on = statistics.median(times["off"]), statistics.median(times["configured"])
    console.print(
        f"weight sync median over {rounds} rounds: profiling off {off * 1000:.1f} ms, "
        f"configured but not this step {on * 1000:.1f} ms, ratio {on / off:.3f} (goal <= 1.02)"
    )


if __name__ == "__main__":
    typer.run(main)
