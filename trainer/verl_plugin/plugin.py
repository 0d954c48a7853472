"""The plugin's entry point in verl's `verl.plugins` group (pyproject.toml): every process that
imports verl loads it (verl/__init__.py), so verl finds `rollout_profiler` wherever it looks it
up: the rollout replica (`actor_rollout_ref.rollout.name`), the checkpoint engine
(`checkpoint_engine.backend`) and the synchronous trainer's rollout (verl's rollout registry).
verl logs a plugin that fails to load only at debug level, so nothing here may fail on import
beyond verl's own modules."""

from __future__ import annotations

from verl.checkpoint_engine.base import CheckpointEngineRegistry
from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry

from trainer.verl_plugin.settings import PLUGIN_NAME


def _replica() -> type[RolloutReplica]:
    from trainer.verl_plugin.replica import AppRolloutReplica  # verl loads a replica class only when it is used

    return AppRolloutReplica


def _register() -> None:
    from trainer.verl_plugin.weight_sync import AppCheckpointEngine

    RolloutReplicaRegistry.register(PLUGIN_NAME, _replica)
    CheckpointEngineRegistry.register(PLUGIN_NAME)(AppCheckpointEngine)
    # verl's rollout registry is a table of import paths, with no function to add to it.
    rollout_base._ROLLOUT_REGISTRY[(PLUGIN_NAME, "async")] = "trainer.verl_plugin.weight_sync.HybridAdapter"


_register()
