"""verl's weight-sync classes for the plugin (docs/frameworks/verl.md#weights): the checkpoint
engine `rollout_profiler`, and the server adapters verl builds beside a rollout.

* **Fully-async and separated trainers** (`checkpoint_engine.backend: rollout_profiler`): verl's
  `CheckpointEngineManager.update_weights(global_steps)` aborts the replicas' requests, then runs
  every trainer rank's `send_weights` beside every rollout worker's `receive_weights`, then
  resumes. `AppCheckpointEngine.send_weights` reads the stream on every rank and publishes it from
  rank 0 (publisher.py); the rollout side receives nothing, the app loads the version itself.
* **The synchronous trainer** (hybrid engine, verl's `naive` backend): every trainer rank calls
  its rollout's `update_weights` with the stream; `HybridAdapter` publishes it from rank 0 the
  same way.

Every rank also measures its clock against the app's at each publish, off the sync's critical
path, and hands it to the rollout server (server.py), which keeps it beside verl's traces.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import AsyncGenerator
from typing import Any

import ray
import torch
from verl.checkpoint_engine.base import CheckpointEngine
from verl.workers.rollout.base import BaseRollout

from profiling.verl_traces.clocks import TrainerClock
from trainer.client import RolloutError
from trainer.verl_plugin.publisher import NamedTensors, VersionPublisher
from trainer.verl_plugin.server import SERVER_NAME
from trainer.verl_plugin.settings import read_settings, validate_settings

log = logging.getLogger(__name__)


class AppCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine `rollout_profiler`: each version through the app (module docstring)."""

    def __init__(self, bucket_size: int, is_master: bool = False, **settings: Any):
        """verl passes `bucket_size` (its update_weights_bucket_megabytes) and, on trainer ranks,
        `is_master` (rank 0); `settings` are the block at
        `checkpoint_engine.engine_kwargs.rollout_profiler`."""
        self._settings = validate_settings(settings)
        self._publisher = VersionPublisher(self._settings, publishes=is_master, bucket_bytes=bucket_size)
        self._clock_tasks: set[asyncio.Task[None]] = set()

    def prepare(self) -> dict[str, Any]:
        """Nothing to allocate: rank 0 sends the weights to the app, not to the rollout workers."""
        return {}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """No process group between the trainer and the rollout workers."""
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        """No process group (build_topology)."""

    def finalize(self) -> None:
        """Nothing was allocated (prepare)."""

    async def send_weights(self, weights: NamedTensors, global_steps: int | None = None) -> dict[str, float]:
        """Every rank reads the stream; rank 0 publishes it as version `global_steps`."""
        metrics = await self._publisher.publish(weights, global_steps)
        if global_steps is not None:
            record_clock(self._publisher, global_steps, self._clock_tasks)
        return metrics

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """The rollout side receives nothing: the app loaded the version rank 0 published."""
        for _ in ():
            yield _


class ReceivingAdapter(BaseRollout):
    """The server adapter of the rollout workers verl's CheckpointEngineManager syncs with
    (replica.py makes one per replica): the app loaded the version already, so the update has
    nothing to apply, and there is no engine memory to free or restore."""

    async def resume(self, tags: list[str]) -> None:
        """Nothing was released."""

    async def release(self) -> None:
        """The app's engines keep their memory."""

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
        """Read the (empty) stream AppCheckpointEngine.receive_weights gives."""
        async for _ in weights:
            pass


class HybridAdapter(BaseRollout):
    """The rollout of verl's synchronous (hybrid-engine) trainer ranks, registered as
    `rollout_profiler` in verl's rollout registry: the app serves generation, and at each sync
    every rank hands it the stream of its weights, which rank 0 publishes (publisher.py)."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any, **kwargs: Any):
        super().__init__(config, model_config, device_mesh)
        self._settings = read_settings(self.config.checkpoint_engine.engine_kwargs)
        publishes = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        bucket_bytes = self.config.checkpoint_engine.update_weights_bucket_megabytes << 20
        self._publisher = VersionPublisher(self._settings, publishes=publishes, bucket_bytes=bucket_bytes)
        self._clock_tasks: set[asyncio.Task[None]] = set()

    async def resume(self, tags: list[str]) -> None:
        """Nothing was released (release)."""

    async def release(self) -> None:
        """The app's engines run on resources of their own: nothing here to free for training."""

    async def update_weights(
        self,
        weights: NamedTensors,
        wire_format: str = "named_tensors",
        peft_config: Any = None,
        global_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        if wire_format != "named_tensors" or peft_config is not None:
            raise ValueError(
                f"the app loads full weights; verl sent {wire_format} weights"
                + (" with a LoRA adapter" if peft_config is not None else "")
                + ": merge LoRA into the weights (actor_rollout_ref.model.lora.merge: true) and use a full-weight "
                "checkpoint engine"
            )
        await self._publisher.publish(weights, global_steps)
        if global_steps is not None:
            record_clock(self._publisher, global_steps, self._clock_tasks)


def record_clock(publisher: VersionPublisher, version: int, tasks: set[asyncio.Task[None]]) -> None:
    """In the background (off the sync's critical path): measure this rank's clock against the
    app's and hand it to replica 0's rollout server, which keeps it beside verl's traces."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    async def measure() -> None:
        try:
            offset = await publisher.client.clock_offset()
            server = ray.get_actor(SERVER_NAME.format(replica_rank=0))
            clock = TrainerClock(
                rank=rank,
                pid=os.getpid(),
                hostname=socket.gethostname(),
                version=version,
                measured_at=time.time(),
                offset=offset,
            )
            await server.record_trainer_clock.remote(clock)
        except (RolloutError, ValueError, ray.exceptions.RayError) as e:
            log.warning("trainer rank %s: its clock against the app's was not recorded: %s", rank, e)

    task = asyncio.get_running_loop().create_task(measure())
    tasks.add(task)
    task.add_done_callback(tasks.discard)
