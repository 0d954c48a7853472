"""verl's rollout replica `rollout_profiler` (docs/frameworks/verl.md): the app stands for the
replica's inference servers, so verl's own trainer runs its rollout through it unchanged.

verl builds every rollout replica itself (`LLMServerManager` from `actor_rollout_ref.rollout.name`)
and, for a standalone replica, reserves accelerators for the engines it would launch. This one
reserves none and launches no engine: it starts one rollout server (server.py), the actor verl's
load balancer hands to its agent loops, and gives the app verl's `global_profiler` steps as the
app's own schedule (docs/design.md#who-drives). Where verl syncs weights through its
CheckpointEngineManager, the replica's rollout worker is verl's own `CheckpointEngineWorker` on a
CPU, whose adapter receives nothing (weight_sync.py: trainer rank 0 publishes to the app).

When verl starts, every verl setting the plugin cannot honour is refused by name
(verl_config.py).
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit

import ray
from omegaconf import DictConfig, OmegaConf
from verl.checkpoint_engine.base import CheckpointEngineWorker
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils.device import get_device_name
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from serve_app.api import ScheduleSpec
from trainer.client import RolloutError
from trainer.verl_plugin.server import SERVER_NAME, AppRolloutServer
from trainer.verl_plugin.settings import PluginConfigError, read_settings
from trainer.verl_plugin.token_io import RolloutLimits
from trainer.verl_plugin.verl_config import check_backend, refusals, schedule_of
from trainer.verl_plugin.weight_sync import ReceivingAdapter

log = logging.getLogger(__name__)

SERVER_NUM_CPUS = 0.1
"""Ray CPUs the rollout server reserves: it only waits on the app's answers."""


class AppRolloutReplica(RolloutReplica):
    """A verl rollout replica served by the app (the module docstring)."""

    def __init__(
        self,
        replica_rank: int,
        config: Any,
        model_config: Any,
        gpus_per_node: int = 8,
        is_reward_model: bool = False,
        is_teacher_model: bool = False,
        name_suffix: str = "",
    ) -> None:
        # Read before verl turns the rollout block into its dataclass: the block still knows the
        # whole config it came from (LLMServerManager passes actor_rollout_ref.rollout of it).
        global_profiler = _global_profiler(config)
        super().__init__(
            replica_rank, config, model_config, gpus_per_node, is_reward_model, is_teacher_model, name_suffix
        )
        self.settings = read_settings(self.config.checkpoint_engine.engine_kwargs)
        if problems := refusals(self.config, self.model_config):
            raise PluginConfigError(
                "verl settings the rollout_profiler plugin cannot honour (docs/frameworks/verl.md"
                "#what-the-plugin-honours): " + "; ".join(problems)
            )
        policy = not (is_reward_model or is_teacher_model)
        self.schedule = schedule_of(global_profiler, self.config, replica_rank) if policy else None
        self._trace_dir = (global_profiler or {}).get("save_path") if self.schedule is not None else None

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def init_hybrid(self, worker_group: RayWorkerGroup) -> None:
        """verl's synchronous trainer: its ranks hold the rollout; the app generates for them."""
        check_backend(self.config, hybrid=True)
        self.rollout_mode = RolloutMode.HYBRID
        first = self.world_size * self.replica_rank
        self.workers = worker_group.workers[first : first + self.world_size]
        await self.launch_servers()

    async def init_hybrid_colocated(self, worker_group: RayWorkerGroup, resource_pool: RayResourcePool) -> None:
        await self.init_hybrid(worker_group)

    async def init_colocated(self, resource_pool: RayResourcePool) -> None:
        """Reward or teacher models colocated with the trainer: no engine is launched either."""
        self.rollout_mode = RolloutMode.COLOCATED
        await self.launch_servers()

    async def init_standalone(self) -> None:
        """A rollout separate from the trainer (fully-async, separated): no accelerator is reserved;
        the one rollout worker verl's CheckpointEngineManager syncs with runs on a CPU."""
        check_backend(self.config, hybrid=False)
        self.rollout_mode = RolloutMode.STANDALONE
        self.resource_pool = RayResourcePool(
            process_on_nodes=[1],
            use_gpu=False,
            max_colocate_count=1,
            name_prefix=f"rollout_profiler_{self.replica_rank}{self.name_suffix}",
        )
        adapter = ReceivingAdapter(config=self.config, model_config=self.model_config, device_mesh=None)
        worker_group = RayWorkerGroup(
            resource_pool=self.resource_pool,
            ray_cls_with_init=RayClassWithInitArgs(
                cls=ray.remote(CheckpointEngineWorker),
                rollout_config=self.config,
                model_config=self.model_config,
                server_adapter=adapter,
            ),
            bin_pack=False,
            name_prefix=f"rollout_profiler_standalone_{self.replica_rank}{self.name_suffix}",
            use_gpu=False,
            device_name=get_device_name(),
        )
        self.workers = worker_group.workers
        await self.launch_servers()

    async def launch_servers(self) -> None:
        """Start the replica's rollout server and give the app verl's schedule."""
        cfg = self.config
        limits = RolloutLimits(
            prompt_length=cfg.prompt_length,
            response_length=cfg.response_length,
            max_model_len=cfg.max_model_len,
            repetition_penalty=cfg.repetition_penalty,
            ignore_eos=cfg.ignore_eos,
            seed=self.replica_rank + cfg.seed if cfg.full_determinism else None,
        )
        server = (
            ray.remote(AppRolloutServer)
            .options(
                name=SERVER_NAME.format(replica_rank=self.replica_rank) + self.name_suffix,
                max_concurrency=self.max_concurrency,
                num_cpus=SERVER_NUM_CPUS,
            )
            .remote(self.settings, limits, max_in_flight=cfg.max_num_seqs, trace_dir=self._trace_dir)
        )
        self.servers = [server]
        self._server_handle = server
        url = urlsplit(self.settings.url)
        self._server_address = url.netloc
        if self.schedule is not None:
            await self._give_schedule(self.schedule)

    async def _give_schedule(self, schedule: ScheduleSpec) -> None:
        """The app drives verl's steps from now on (the same schedule from every replica changes nothing)."""
        async with self.settings.client() as app:
            try:
                answer = await app.set_schedule(schedule)
            except RolloutError as e:
                raise PluginConfigError(
                    f"the app at {self.settings.url} did not take verl's global_profiler steps {schedule.steps} as its "
                    f"schedule: {e}"
                ) from None
        log.info(
            "the app drives verl's profiled steps %s (schedule from its %s; step %s recording)",
            answer.schedule.steps,
            answer.given_by,
            answer.active_step,
        )


def _global_profiler(config: Any) -> dict[str, Any] | None:
    """verl's `global_profiler` block, from the rollout block's place in the whole config."""
    if not isinstance(config, DictConfig):
        raise PluginConfigError(
            "the rollout_profiler replica was given actor_rollout_ref.rollout detached from verl's config, so it "
            "cannot read global_profiler: build it through verl's LLMServerManager"
        )
    block = OmegaConf.select(config, "...global_profiler")
    if block is None:
        return None
    plain = OmegaConf.to_container(block, resolve=True)
    assert isinstance(plain, dict)
    return {str(k): v for k, v in plain.items()}
