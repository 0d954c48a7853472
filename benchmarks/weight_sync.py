"""Weight sync time per transfer mode, side by side in one run: file, object store, collective,
each with and without a profiled step around the sync, for the tiny model and a ~100M-parameter
random Llama, on the embedded engine (2 replicas, CPU, gloo).

Each round runs every (mode, profiled) pair once, in an order that rotates from round to round
(no drift bias), each sync publishing a new version of random weights:

* file: the trainer writes a safetensors file into weights_dir (`publish`), then
  `POST /weights/update {"path"}`: the replicas read and load it;
* object_store: `InClusterWeights` puts the state dict into Ray's object store, the replicas fetch it
  and load it;
* collective: `CollectiveWeights` broadcasts it bucket by bucket over a gloo group of the trainer's
  rank and both replicas, who stage then load it (docs/design.md#weights-by-collective).

"profiled" wraps the update in the sync's calls: stop(pause) -> update(resume: false) -> start,
as ProfiledWeightSync makes them for a profiled step; the other runs are a bare update. The
table gives the median seconds of each part and the MB/s of the weight delivery (model bytes /
(publish + update)).

    python benchmarks/weight_sync.py [--rounds 3] [--models tiny,100m] [--bucket-mb 64]
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch
import typer
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file, save_file

from serve_app.tiny_model import TinyModelSpec, ensure_tiny_model
from trainer.client import RolloutClient
from trainer.collective import CollectiveWeights
from trainer.in_cluster import InClusterWeights
from trainer.local_app import local_cluster, run_app

console = Console(width=160)
MODES = ("file", "object_store", "collective")
MODELS = {
    "tiny": TinyModelSpec(),
    # ~100M parameters: 12 layers of width 768 (a GPT-2-small-sized Llama), random weights.
    "100m": TinyModelSpec(
        hidden_size=768, intermediate_size=2560, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12
    ),
}


class Sync(BaseModel):
    mode: str
    profiled: bool
    publish_s: float
    stop_s: float = 0.0
    update_s: float
    start_s: float = 0.0
    transfer_s: float | None = None
    load_s: float | None = None

    @property
    def total_s(self) -> float:
        return self.publish_s + self.stop_s + self.update_s + self.start_s


async def _one(
    mode: str,
    profiled: bool,
    version: int,
    state: dict[str, torch.Tensor],
    weights_dir: Path,
    client: RolloutClient,
    channels: dict[str, InClusterWeights | CollectiveWeights],
) -> Sync:
    """One sync of `version` in `mode`; with `profiled`, the step is started before (untimed) and
    the sync stops it with pause, updates with resume false and starts the next one."""
    if profiled:
        await client.start_profile(version)
    t0 = time.perf_counter()
    path = None
    if mode == "file":
        path = weights_dir / f"v{version}.safetensors"
        await asyncio.to_thread(save_file, state, str(path))
    publish_s = time.perf_counter() - t0
    stop_s = start_s = 0.0
    if profiled:
        t0 = time.perf_counter()
        await client.stop_profile(version, pause=True)
        stop_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if path is not None:
        answer = await client.update_weights(version, str(path), resume=not profiled)
    else:
        answer = await channels[mode].update_weights(version, state, resume=not profiled)
    update_s = time.perf_counter() - t0
    if profiled:
        t0 = time.perf_counter()
        await client.start_profile(version + 1)
        start_s = time.perf_counter() - t0
        await client.stop_profile(version + 1)
    if path is not None:
        path.unlink()
    return Sync(
        mode=mode,
        profiled=profiled,
        publish_s=publish_s,
        stop_s=stop_s,
        update_s=update_s,
        start_s=start_s,
        transfer_s=answer.transfer_s,
        load_s=answer.load_s,
    )


async def _measure(url: str, app: str, model: Path, weights_dir: Path, rounds: int, bucket_mb: float) -> list[Sync]:
    base = load_file(str(model / "model.safetensors"))
    runs: list[Sync] = []
    pairs = [(m, p) for m in MODES for p in (False, True)]
    async with RolloutClient(url, timeout_s=600) as client:
        channels: dict[str, InClusterWeights | CollectiveWeights] = {
            "object_store": InClusterWeights(app),
            "collective": CollectiveWeights(client, bucket_bytes=int(bucket_mb * (1 << 20))),
        }
        version = 0
        for r in range(rounds):
            for mode, profiled in pairs[r % len(pairs) :] + pairs[: r % len(pairs)]:
                version += 2  # a profiled sync also starts version + 1's step
                state = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in base.items()}
                runs.append(await _one(mode, profiled, version, state, weights_dir, client, channels))
    return runs


def _table(name: str, mb: float, runs: list[Sync]) -> Table:
    table = Table(title=f"{name}: {mb:.1f} MB of weights, 2 replicas, medians of {len(runs) // 6} syncs each")
    for col in (
        "mode",
        "profiled",
        "publish s",
        "stop s",
        "update s",
        "(transfer s)",
        "(load s)",
        "start s",
        "total s",
        "MB/s",
    ):
        table.add_column(col, justify="left" if col in ("mode", "profiled") else "right")
    for mode in MODES:
        for profiled in (False, True):
            rs = [r for r in runs if r.mode == mode and r.profiled == profiled]

            def med(values: list[float | None]) -> str:
                known = [v for v in values if v is not None]
                return f"{statistics.median(known):.3f}" if known else "-"

            delivery = statistics.median(r.publish_s + r.update_s for r in rs)
            table.add_row(
                mode,
                "yes" if profiled else "no",
                med([r.publish_s for r in rs]),
                med([r.stop_s for r in rs]) if profiled else "-",
                med([r.update_s for r in rs]),
                med([r.transfer_s for r in rs]),
                med([r.load_s for r in rs]),
                med([r.start_s for r in rs]) if profiled else "-",
                med([r.total_s for r in rs]),
                f"{mb / delivery:.0f}",
            )
    return table


def main(
    rounds: int = typer.Option(3, help="Syncs per (mode, profiled) pair and model."),
    models: str = typer.Option("tiny,100m", help="Comma-separated: tiny, 100m."),
    bucket_mb: float = typer.Option(64.0, help="Collective bucket size in MiB."),
) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-weights-"))
    weights_dir = tmp / "weights"
    weights_dir.mkdir()
    with local_cluster() as port:
        for name in models.split(","):
            model = ensure_tiny_model(MODELS[name])
            mb = (model / "model.safetensors").stat().st_size / 1e6
            app = f"weights-{name}"  # one app per model: its desired state (served version) is its own
            url = run_app(
                port,
                app,
                {
                    "num_replicas": 2,
                    "save_path": str(tmp / f"traces-{name}"),
                    "weights_dir": str(weights_dir),
                    "node_dir": str(tmp / "node"),
                    "model_path": str(model),
                    "min_free_disk_mb": 1,
                    "weight_transfer": "collective",
                    "control_timeout_s": 120,
                },
                route_prefix=f"/{app}",
            )
            runs = asyncio.run(_measure(url, app, model, weights_dir, rounds, bucket_mb))
            console.print(_table(name, mb, runs))


if __name__ == "__main__":
    typer.run(main)
