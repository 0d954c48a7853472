"""The reference fully-async RL loop (the main job).

A rollout producer (`rollout.mode`: batched completions, or multi-turn agent-loop episodes,
trainer/agent_loop.py) keeps completions coming (token ids, logprobs, the weight version that made
them) while the trainer takes mini-batches, steps the optimizer, and every
`trigger_parameter_sync_step` mini-batches publishes a new version through the profiled sync.
Samples more than `max_staleness` versions old are dropped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from profiling.manifest import SyncCost
from profiling.schedule import StepSchedule
from profiling.weight_source import WeightSource
from trainer.agent_loop import AgentLoop, Reward
from trainer.client import RolloutClient
from trainer.config import TrainerConfig
from trainer.distributed import Ranks, share_from_driver
from trainer.policy import Policy, Sample, TrainingPolicy
from trainer.profiled_sync import (
    CollectivePublisher,
    InClusterPublisher,
    PathPublisher,
    ProfiledWeightSync,
    WeightPublisher,
    Weights,
)

if TYPE_CHECKING:
    from trainer.in_cluster import AppCluster  # imports Ray: only jobs in the app's cluster load it

PROMPTS = [
    "The rollout server",
    "One two three",
    "Red green blue",
    "The quick brown fox",
    "A weight update",
    "Every replica keeps",
    "Questions and answers",
    "Numbers: 0 1 2",
]


class VersionStats(BaseModel):
    version: int
    reward: float
    loss: float
    staleness: float
    samples_per_s: float
    sync: SyncCost


class MiniBatch(BaseModel):
    """One mini-batch as the driving rank shares it with the other ranks (as JSON)."""

    samples: list[Sample]
    dropped: int = Field(ge=0)
    """Samples taken from the producers but dropped as too stale."""
    taken: int = Field(ge=0)
    """Samples taken from the producers, dropped ones included."""


class RunResult(BaseModel):
    versions: list[VersionStats] = Field(default_factory=list)
    dropped_stale: int = 0

    @property
    def first_reward(self) -> float:
        head = self.versions[: max(1, len(self.versions) // 5)]
        return sum(v.reward for v in head) / len(head)

    @property
    def last_reward(self) -> float:
        tail = self.versions[-max(1, len(self.versions) // 5) :]
        return sum(v.reward for v in tail) / len(tail)


ProgressHook = Callable[[VersionStats], None]


async def _produce(
    client: RolloutClient, cfg: TrainerConfig, reward: Reward, queue: asyncio.Queue[Sample], worker: int
) -> None:
    """Mode completions: batches of prompts through /v1/completions, one sample per completion."""
    r = cfg.rollout
    n = worker
    while True:
        prompts = [PROMPTS[(n + i) % len(PROMPTS)] for i in range(r.prompts_per_request)]
        n += r.prompts_per_request
        resp = await client.complete(prompts, max_tokens=r.max_tokens, temperature=r.temperature, logprobs=1)
        for c in resp.choices:
            logprobs = c.logprobs.token_logprobs if c.logprobs else []
            if any(lp is None for lp in logprobs):  # OpenAI's None is an echoed prompt's first token
                raise ValueError("a completion's logprobs hold a null: the producers' requests must not echo")
            sample = Sample(
                prompt_ids=c.prompt_token_ids,
                completion_ids=c.token_ids,
                logprobs=[lp for lp in logprobs if lp is not None],
                weight_version=c.weight_version,
                reward=reward(c.token_ids),
            )
            await queue.put(sample)


def token_share(target: int) -> Reward:
    """The reward of both modes: the share of completion tokens equal to `target`."""
    return lambda ids: sum(t == target for t in ids) / max(1, len(ids))


def _producers(
    client: RolloutClient, cfg: TrainerConfig, reward: Reward, context_len: int, queue: asyncio.Queue[Sample]
) -> list[asyncio.Task]:
    """`rollout.concurrency` producers of the configured mode; `context_len`: the policy's."""
    r = cfg.rollout
    if r.mode == "completions":
        return [asyncio.create_task(_produce(client, cfg, reward, queue, i)) for i in range(r.concurrency)]
    agent = AgentLoop(
        client,
        turns=r.agent_turns,
        max_tokens=r.max_tokens,
        temperature=r.temperature,
        reward=reward,
        tasks=PROMPTS,
        context_len=context_len,
        episodes_path=Path(r.agent_episodes_path) if r.agent_episodes_path else None,
    )
    return [asyncio.create_task(agent.produce(i, queue)) for i in range(r.concurrency)]


async def run_training(
    cfg: TrainerConfig,
    client: RolloutClient | None,
    model_dir: str,
    on_version: ProgressHook | None = None,
    ranks: Ranks | None = None,
    cluster: AppCluster | None = None,
) -> RunResult:
    """Train for `total_versions` versions against the app behind `client`. `ranks`: this
    process's rank of `trainer.world_size` (their process group joined; docs/trainer.md#several-ranks):
    the driving rank samples, shares each mini-batch and publishes; the others train on their
    share and have no client. `cluster`: the app's Ray cluster, which this process has joined
    (`trainer.weight_transfer: object_store`, on the driving rank)."""
    t = cfg.trainer
    ranks = ranks or Ranks()
    executor = ThreadPoolExecutor(1, thread_name_prefix="trainer-model")
    loop = asyncio.get_running_loop()
    policy = await loop.run_in_executor(executor, _policy, cfg, model_dir, ranks)
    reward = token_share(policy.token_id(t.reward_text))
    # The policy is the served model: a sample must fit its context to be trained on.
    context_len = policy.context_len
    weights_dir = Path(t.weights_dir).resolve()
    schedule = StepSchedule.from_config(cfg.global_profiler)
    publisher = _publisher(cfg, client, cluster) if ranks.drives else PathPublisher()
    by_file = isinstance(publisher, PathPublisher)
    sync = ProfiledWeightSync(
        schedule,
        client if ranks.drives else None,
        save_path=cfg.global_profiler.save_path if cfg.global_profiler.profiles else None,
        publisher=publisher,
        role=ranks.role(policy.parallel),
        options=cfg.window_options(),
        model_executor=executor,
        merge_on_complete=cfg.global_profiler.merge_on_complete,
    )
    result = RunResult()
    queue: asyncio.Queue[Sample] = asyncio.Queue(maxsize=t.mini_batch_size * 2)
    producers: list[asyncio.Task] = []
    try:
        async with sync:
            if client is not None and ranks.drives:
                producers = _producers(client, cfg, reward, context_len, queue)
            for version in range(1, t.total_versions + 1):
                stats = await _train_version(cfg, policy, sync, queue, producers, executor, version, result, ranks)
                path = weights_dir / f"v{version}.safetensors"

                def publish(p: Path = path) -> Awaitable[Weights | None]:
                    return loop.run_in_executor(executor, _publish, policy, p, ranks, not by_file, sync)

                report = await sync.sync(version, publish)
                if ranks.drives and by_file:
                    _prune(weights_dir, version, t.keep_versions)
                stats.sync = report.cost
                result.versions.append(stats)
                if on_version:
                    on_version(stats)
    finally:
        for p in producers:
            p.cancel()
        await asyncio.gather(*producers, return_exceptions=True)
        await sync.wait_exported()
        sync.shutdown()
    return result


def _publisher(cfg: TrainerConfig, client: RolloutClient | None, cluster: AppCluster | None) -> WeightPublisher:
    """The publisher of `trainer.weight_transfer`: weight files, the object store of the app's
    cluster, or a broadcast to the replicas."""
    t = cfg.trainer
    if t.weight_transfer == WeightSource.PATH or client is None:
        return PathPublisher()
    if t.weight_transfer == WeightSource.OBJECT_STORE:
        if cluster is None:
            raise ValueError(
                "trainer.weight_transfer object_store: this process is not in the app's Ray cluster; run the "
                "main job with rollout.url unset (it starts the app), or publish by path or collective"
            )
        from trainer.in_cluster import InClusterWeights  # lazy: only jobs in the app's cluster need Ray

        return InClusterPublisher(InClusterWeights(cluster.app_name))
    from trainer.collective import CollectiveWeights  # lazy: only jobs that broadcast need it

    return CollectivePublisher(
        CollectiveWeights(client, address=t.collective_address, bucket_bytes=int(t.bucket_mb * 2**20))
    )


def _policy(cfg: TrainerConfig, model_dir: str, ranks: Ranks) -> TrainingPolicy:
    """The policy of `trainer.backend`, constructed on every rank (a collective with several)."""
    t = cfg.trainer
    if t.backend == "megatron":
        from trainer.megatron.policy import MegatronPolicy  # lazy: megatron-core is an extra

        m = t.megatron
        return MegatronPolicy(
            model_dir,
            t.lr,
            t.clip_ratio,
            t.seed,
            tp=m.tensor_parallel_size,
            pp=m.pipeline_parallel_size,
            micro_batch_size=m.micro_batch_size,
        )
    return Policy(model_dir, t.lr, t.clip_ratio, t.seed, shard=ranks.distributed)


def _publish(
    policy: TrainingPolicy, path: Path, ranks: Ranks, as_state_dict: bool, sync: ProfiledWeightSync
) -> Weights | None:
    """The sync's publish, on the model thread: every rank joins the gather (timed into the
    sync's `gather_s`); the driving rank writes the weights file, or hands the state dict to the
    publisher."""
    t0 = time.perf_counter()
    state = policy.full_state_dict()
    sync.gathered(time.perf_counter() - t0)
    if not ranks.drives:
        return None
    return state if as_state_dict else policy.save(path, state)


async def _train_version(
    cfg: TrainerConfig,
    policy: TrainingPolicy,
    sync: ProfiledWeightSync,
    queue: asyncio.Queue[Sample],
    producers: list[asyncio.Task],
    executor: ThreadPoolExecutor,
    version: int,
    result: RunResult,
    ranks: Ranks,
) -> VersionStats:
    """The mini-batches that produce `version` (trained from version-1); with several ranks the
    driving rank samples each mini-batch and shares it (the others wait for it)."""
    t = cfg.trainer
    loop = asyncio.get_running_loop()
    rewards: list[float] = []
    losses: list[float] = []
    staleness: list[int] = []
    t0, taken, dropped = time.perf_counter(), 0, 0
    for _ in range(t.trigger_parameter_sync_step):
        batch: list[Sample] = []
        batch_dropped, batch_taken = 0, 0
        while ranks.drives and len(batch) < t.mini_batch_size:
            sample = await _next_sample(queue, producers)
            batch_taken += 1
            if (version - 1) - sample.weight_version > cfg.rollout.max_staleness:
                batch_dropped += 1
                continue
            batch.append(sample)
        if ranks.distributed:
            mine = MiniBatch(samples=batch, dropped=batch_dropped, taken=batch_taken) if ranks.drives else None
            shared = await loop.run_in_executor(executor, share_from_driver, mine, MiniBatch, ranks)
            batch, batch_dropped, batch_taken = shared.samples, shared.dropped, shared.taken
        taken += batch_taken
        dropped += batch_dropped
        result.dropped_stale += batch_dropped
        staleness.extend((version - 1) - s.weight_version for s in batch)

        def step(b: list[Sample] = batch) -> float:
            with sync.fit_step(version - 1):
                return policy.train_step(b, policy.data_part(ranks.rank, ranks.world_size))

        losses.append(await loop.run_in_executor(executor, step))
        rewards.extend(s.reward for s in batch)
    elapsed = time.perf_counter() - t0
    sync.consumed(version, staleness, dropped)
    return VersionStats(
        version=version,
        reward=sum(rewards) / len(rewards),
        loss=sum(losses) / len(losses),
        staleness=sum(staleness) / len(staleness),
        samples_per_s=taken / elapsed if elapsed > 0 else 0.0,
        sync=SyncCost(),
    )


async def _next_sample(queue: asyncio.Queue[Sample], producers: list[asyncio.Task]) -> Sample:
    """The next sample; re-raises a producer's failure instead of waiting forever."""
    while True:
        try:
            return await asyncio.wait_for(queue.get(), timeout=1.0)
        except TimeoutError:
            for p in producers:
                if p.done() and not p.cancelled() and (exc := p.exception()) is not None:
                    raise exc from None


def _prune(weights_dir: Path, version: int, keep: int) -> None:
    for v in range(max(1, version - keep - 5), version - keep + 1):
        (weights_dir / f"v{v}.safetensors").unlink(missing_ok=True)
