"""Two of the three ways a trainer's weights reach the replicas, each inside a ProfiledWeightSync
(docs/trainer.md#weight-transfer-modes). It publishes `--versions` versions after the one the app
serves, and profiles the second and third of them (the steps that generate on the first and
second):

* `--mode file`: the trainer writes each version as a safetensors file inside the app's
  weights_dir, and the replicas read it;
* `--mode collective`: the trainer's rank broadcasts the state dict to every replica over a
  process group (the app needs `weight_transfer: collective`; nothing touches disk).

The third, the trainer's own transfer (`ExternalPublisher`), is docs/examples/byo_vllm_transfer.py.
"Training" here adds noise to the served checkpoint's tensors, one version at a time.

    python docs/examples/transfer_modes.py --url URL --mode file|collective
        [--model-path DIR] [--weights-dir DIR] [--versions 3]
"""

from __future__ import annotations

import asyncio
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import torch
import typer
from safetensors.torch import load_file, save_file

from profiling.schedule import StepSchedule
from serve_app.tiny_model import ensure_tiny_model
from trainer.client import RolloutClient
from trainer.collective import CollectiveWeights
from trainer.profiled_sync import CollectivePublisher, ProfiledWeightSync


class Mode(StrEnum):
    path = "path"
    collective = "collective"


def train(model: dict[str, torch.Tensor]) -> None:
    """Stands in for the mini-batches that make the next version."""
    for t in model.values():
        if t.is_floating_point():
            t.add_(torch.randn_like(t), alpha=1e-3)


async def file_mode(client: RolloutClient, model: dict[str, torch.Tensor], weights_dir: Path, versions: range) -> None:
    schedule = StepSchedule([versions[1], versions[2]])
    # --8<-- [start:file]
    sync = ProfiledWeightSync(schedule, client, save_path=None)
    async with sync:
        for version in versions:
            train(model)
            path = weights_dir / f"v{version}.safetensors"  # inside the app's weights_dir
            save_file(model, str(path))
            report = await sync.sync(version, path)
            print(f"v{version}: path, update {report.cost.update_s:.3f} s")
    # --8<-- [end:file]


async def collective_mode(client: RolloutClient, model: dict[str, torch.Tensor], versions: range) -> None:
    schedule = StepSchedule([versions[1], versions[2]])
    # --8<-- [start:collective]
    transport = CollectiveWeights(client, address="127.0.0.1")  # an address every replica can dial
    sync = ProfiledWeightSync(schedule, client, save_path=None, publisher=CollectivePublisher(transport))

    async def publish() -> dict[str, torch.Tensor]:
        return model  # with FSDP: the full state dict, gathered on this rank

    async with sync:
        for version in versions:
            train(model)
            report = await sync.sync(version, publish)
            print(f"v{version}: collective, broadcast {report.cost.transfer_s:.3f} s")
    # --8<-- [end:collective]


def main(
    url: Annotated[str, typer.Option(help="The running app.")],
    mode: Annotated[Mode, typer.Option(help="path or collective.")] = Mode.path,
    model_path: Annotated[Path | None, typer.Option(help="The app's model (default: the tiny Llama).")] = None,
    weights_dir: Annotated[Path, typer.Option(help="The app's weights_dir (file mode).")] = Path(
        "/tmp/rollout-profiler/weights"
    ),
    versions: Annotated[int, typer.Option(help="Versions to publish (at least 3).", min=3)] = 3,
) -> None:
    model = load_file(str((model_path or ensure_tiny_model()) / "model.safetensors"))

    async def run() -> None:
        async with RolloutClient(url) as client:
            first = (await client.status()).weight_version + 1
            published = range(first, first + versions)
            if mode is Mode.path:
                weights_dir.mkdir(parents=True, exist_ok=True)
                await file_mode(client, model, weights_dir, published)
            else:
                await collective_mode(client, model, published)

    asyncio.run(run())


if __name__ == "__main__":
    typer.run(main)
