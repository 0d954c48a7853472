"""The trainer loop both bring-your-own examples run (byo_vllm_transfer.py, byo_sglang_transfer.py):
they differ only in `move`, how the weights reach the engines.

A trainer in the app's Ray cluster continues from the version the app serves: per version one
fit step of the actor (the main job's policy, the tiny Llama the app serves) on completions from
`/v1/completions`, then `ProfiledWeightSync.sync(version)`, which stops the profiled step (holding
generation), awaits `move(version)`, publishes the version with `/weights/update {"source":
"external"}` (checked against every replica's engine) and starts the next step. Steps 1 and 2
are profiled (verl's `global_profiler` block).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from profiling.config import GlobalProfilerConfig, ProfileOptions
from profiling.schedule import StepSchedule
from trainer.client import RolloutClient
from trainer.policy import Policy, Sample
from trainer.profiled_sync import ExternalPublisher, ProfiledWeightSync

GLOBAL_PROFILER = {"tool": "torch", "steps": [1, 2], "profile_continuous_steps": False}
TRAINER_PROFILER = {"activities": ["cpu"], "max_forward_steps": 200}
PROMPTS = ["The rollout server", "One two three", "Red green blue", "A weight update"]

Move = Callable[[int], Awaitable[None]]
MakeMove = Callable[[argparse.Namespace, RolloutClient, Policy, ThreadPoolExecutor], Move]
"""Builds `move` from the options, the app's client, the actor and the actor's thread."""


def parser(description: str) -> argparse.ArgumentParser:
    """The options both examples take; each adds its own."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the app's base URL")
    p.add_argument("--app-name", default="rollout", help="the app's Serve application name")
    p.add_argument("--ray-address", default="auto", help="the app's Ray cluster")
    p.add_argument("--control-token", default=None, help="the app's control token, if it has one")
    p.add_argument("--save-path", default="/tmp/rollout-profiler/traces", help="the app's save_path")
    p.add_argument("--model-path", default=None, help="the app's initial checkpoint (default: its tiny Llama)")
    p.add_argument("--versions", type=int, default=2, help="weight versions to publish")
    p.add_argument("--save-weights", type=Path, default=None, help="write the last version's weights here")
    p.add_argument("--skip-version-update", action="store_true", help="show the failure: the engine's version unset")
    return p


async def fit(args: argparse.Namespace, make_move: MakeMove) -> None:
    """Continue from the version the app serves: `args.versions` more, each after one fit step."""
    cfg = GlobalProfilerConfig.model_validate({**GLOBAL_PROFILER, "save_path": args.save_path})
    executor = ThreadPoolExecutor(1, thread_name_prefix="actor")
    loop = asyncio.get_running_loop()
    actor = await loop.run_in_executor(executor, Policy, args.model_path, 0.05, 0.2, 0)
    target = actor.token_id(" the")
    async with RolloutClient(args.url, control_token=args.control_token) as client:
        first = (await client.status()).weight_version
        sync = ProfiledWeightSync(
            StepSchedule.from_config(cfg),
            client,
            save_path=cfg.save_path,
            options=ProfileOptions.model_validate(TRAINER_PROFILER),
            model_executor=executor,
            publisher=ExternalPublisher(make_move(args, client, actor, executor)),
        )
        await sync.begin(first)  # version 0: starts step 1 if profiled
        failed = True
        try:
            for version in range(first + 1, first + args.versions + 1):
                answer = await client.complete(PROMPTS, max_tokens=8, logprobs=1)
                batch = [
                    Sample(
                        prompt_ids=c.prompt_token_ids,
                        completion_ids=c.token_ids,
                        logprobs=c.logprobs.token_logprobs if c.logprobs else [],
                        weight_version=c.weight_version,
                        reward=c.token_ids.count(target) / max(1, len(c.token_ids)),
                    )
                    for c in answer.choices
                ]

                def update_actor(batch: list[Sample] = batch, on: int = version - 1) -> float:
                    with sync.fit_step(on):
                        return actor.train_step(batch)

                loss = await loop.run_in_executor(executor, update_actor)
                # stop step k (holding generation) -> move(k) -> source external (checked) -> start k+1
                report = await sync.sync(version)
                cost = report.cost
                print(
                    f"v{version}: loss {loss:+.3f}, transfer {cost.transfer_s or 0:.3f} s, "
                    f"update {cost.update_s or 0:.3f} s"
                )
            failed = False
        finally:
            await sync.end(failed=failed)  # stop whatever is active, also after an error
        await sync.wait_exported()
        if args.save_weights:  # the weights of the last version sent
            await loop.run_in_executor(executor, lambda: actor.save(args.save_weights))
        sync.shutdown()


def run(args: argparse.Namespace, make_move: MakeMove) -> None:
    """Join the app's Ray cluster and run the loop."""
    import ray

    if args.model_path is None:
        from serve_app.tiny_model import ensure_tiny_model

        args.model_path = str(ensure_tiny_model())
    ray.init(address=args.ray_address, log_to_driver=False)
    try:
        asyncio.run(fit(args, make_move))
    finally:
        ray.shutdown()
