"""A trainer rank for tests/integration/test_clock_skew.py, run in its own process under a shifted
clock (libfaketime preloaded): profiles steps 1 to 3 against the app, with real generation on
every replica in each step, and writes its own traces under the app's save_path.

    python skewed_trainer.py BASE_URL SAVE_PATH WEIGHTS
"""

from __future__ import annotations

import asyncio
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from profiling.schedule import StepSchedule
from trainer.client import RolloutClient
from trainer.profiled_sync import ProfiledWeightSync

STEPS = [1, 2, 3]
PROMPTS = ["The rollout server answers prompts", "Red green blue yellow", "One two three four five"]


async def generate_on_every_replica(client: RolloutClient) -> None:
    """Generate until every replica recorded a forward pass in the active step."""
    for _ in range(30):
        await asyncio.gather(*(client.complete(p, max_tokens=6) for p in PROMPTS * 2))
        status = await client.status()
        if all(r.ok and r.forward_steps for r in status.replicas):
            return
    raise SystemExit(f"not every replica recorded a forward pass: {status.replicas}")


async def main(base_url: str, save_path: str, weights: str) -> None:
    model_thread = ThreadPoolExecutor(1, thread_name_prefix="trainer-model")
    loop = asyncio.get_running_loop()
    async with RolloutClient(base_url) as client:
        sync = ProfiledWeightSync(StepSchedule(STEPS), client, save_path=save_path, model_executor=model_thread)
        async with sync:
            for version in STEPS:
                await generate_on_every_replica(client)

                def fit(version: int = version) -> None:
                    with sync.fit_step(version - 1):
                        torch.randn(64, 64) @ torch.randn(64, 64)

                await loop.run_in_executor(model_thread, fit)
                await sync.sync(version, weights)
        await sync.wait_exported()
    sync.shutdown()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
