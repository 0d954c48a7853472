"""A verl-style trainer loop wired to the rollout app's profiled weight sync (runnable).

verl's fully-async trainer, per parameter version: fit steps (one per mini-batch, `update_actor`),
then `_fit_update_weights`, which stops rollout profiling of step k, syncs weights k and starts
step k+1. Here `ProfiledWeightSync` makes those three calls, in that order, keyed to the version,
and profiles the trainer's own mini-batches into the same step directories.

    serve run --address local config/serve.yaml          # the app, in another terminal
    python docs/examples/verl_style_integration.py       # defaults match config/serve.yaml

`--save-path` and `--weights-dir` must be the app's `save_path` and `weights_dir` (the trainer's
traces join the replicas' in one manifest; the app only loads weights from inside weights_dir).
"""

from __future__ import annotations

import argparse
import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from profiling.config import GlobalProfilerConfig, ProfileOptions
from profiling.schedule import StepSchedule
from trainer.client import RolloutClient
from trainer.policy import Policy, Sample
from trainer.profiled_sync import ProfiledWeightSync

# verl's `global_profiler` block, same keys and meaning: in fully-async mode a step is a
# parameter version (step k ends when version k is published).
GLOBAL_PROFILER = {"tool": "torch", "steps": [1, 2], "profile_continuous_steps": False}
# The trainer-side window options (the rollout side uses the app's `profiler` args).
TRAINER_PROFILER = {"activities": ["cpu"], "max_forward_steps": 200}
PROMPTS = ["The rollout server", "One two three", "Red green blue", "A weight update"]


async def fit(args: argparse.Namespace) -> None:
    """`args.versions` versions of `args.mini_batches` fit steps each, then a weight sync."""
    cfg = GlobalProfilerConfig.model_validate({**GLOBAL_PROFILER, "save_path": args.save_path})
    executor = ThreadPoolExecutor(1, thread_name_prefix="actor")  # the actor's model: one thread
    loop = asyncio.get_running_loop()
    actor = await loop.run_in_executor(executor, Policy, args.model_path, 0.01, 0.2, 0)
    target = actor.token_id(" the")  # reward: share of generated tokens equal to " the"
    async with RolloutClient(args.url, control_token=args.control_token) as client:
        sync = ProfiledWeightSync(
            StepSchedule.from_config(cfg),
            client,
            save_path=cfg.save_path,
            options=ProfileOptions.model_validate(TRAINER_PROFILER),
            model_executor=executor,
        )
        async with sync:  # start step 1 if profiled; on exit (also on errors) stop what is active
            for version in range(1, args.versions + 1):
                for _ in range(args.mini_batches):
                    # Rollout (verl: the rollouter's samples); weights version-1 generated them.
                    answer = await client.complete(PROMPTS, max_tokens=8, logprobs=1)
                    batch = [
                        Sample(
                            prompt_ids=c.prompt_token_ids,
                            completion_ids=c.token_ids,
                            logprobs=c.logprobs.token_logprobs,
                            weight_version=c.weight_version,
                            reward=c.token_ids.count(target) / max(1, len(c.token_ids)),
                        )
                        for c in answer.choices
                    ]

                    def update_actor(batch: list[Sample] = batch, on: int = version - 1) -> float:
                        with sync.fit_step(on):  # the trainer's trace: a mini-batch on weights `on`
                            return actor.train_step(batch)

                    loss = await loop.run_in_executor(executor, update_actor)
                # verl's _fit_update_weights: stop step k -> update_weights(k) -> start step k+1.
                path = Path(args.weights_dir) / f"v{version}.safetensors"
                report = await sync.sync(version, lambda p=path: loop.run_in_executor(executor, actor.save, p))
                print(
                    f"v{version}: loss {loss:+.3f}, sync {report.plan.control_calls} profiling call(s), "
                    f"update {report.cost.update_s * 1000:.0f} ms"
                )
        await sync.wait_exported()  # the trainer's traces are written before the process exits
        sync.shutdown()
    print(f"profiled steps {cfg.steps} under {Path(cfg.save_path).resolve()}: python -m profiling list {cfg.save_path}")


def main(argv: list[str] | None = None) -> None:
    """Parse the options and run the loop."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the app's base URL")
    parser.add_argument(
        "--control-token",
        default=None,
        help="the app's control token (its control_token_env or control_token_file), if it has one",
    )
    parser.add_argument("--save-path", default="/tmp/rollout-profiler/traces", help="the app's save_path")
    parser.add_argument("--weights-dir", default="/tmp/rollout-profiler/weights", help="the app's weights_dir")
    parser.add_argument("--model-path", default=None, help="the app's initial checkpoint (default: its tiny Llama)")
    parser.add_argument("--versions", type=int, default=3, help="weight versions to publish")
    parser.add_argument("--mini-batches", type=int, default=2, help="fit steps per version")
    args = parser.parse_args(argv)
    if args.model_path is None:
        # An app with `model_path: null` serves the tiny Llama built from the same seed.
        from serve_app.tiny_model import ensure_tiny_model

        args.model_path = str(ensure_tiny_model())
    asyncio.run(fit(args))


if __name__ == "__main__":
    main()
