"""Bring your own weight transfer: a trainer that moves weights into vLLM replicas itself (runnable).

Many RL trainers already have their own way to put weights into vLLM (an NCCL group of their own,
CUDA IPC, vLLM's weight-transfer engine). They keep it: `ProfiledWeightSync(..., update=move)`
calls `await move(version)` between the stop (which holds generation) and the start of the next
profiled step, then publishes the version with `/weights/update {"source": "external"}`, which
succeeds only when every replica's vLLM reports that version (docs/engines.md#vllm-engine-rpc).

Here `move` is the simplest transfer through vLLM's own RPC, reached through the app's handle
(`engine_rpc`, handle only, never HTTP):

1. the trainer writes its weights to a shared-memory file (`/dev/shm`: the trainer and the
   replicas on one node; across nodes, your own collective takes its place);
2. `engine_rpc("collective_rpc", [load_into_worker], {"args": [path]})` runs `load_into_worker`
   in every vLLM worker of every replica: it loads the file through vLLM's in-place reload;
3. `engine_rpc("update_weight_version", [version])` sets the version vLLM reports (and labels
   each generated token with).

    serve run --address local config/serve.vllm.yaml        # the app (engine: vllm), in another terminal
    python docs/examples/byo_vllm_transfer.py           # this trainer joins the same Ray cluster

`--save-path` must be the app's `save_path` (the trainer's traces join the replicas' in one
manifest). `--skip-version-update` leaves step 3 out, to show the sync failing: the app names
each replica and the version its vLLM reports.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from profiling.config import GlobalProfilerConfig, ProfileOptions
from profiling.schedule import StepSchedule
from trainer.client import RolloutClient
from trainer.policy import Policy, Sample
from trainer.profiled_sync import ProfiledWeightSync

GLOBAL_PROFILER = {"tool": "torch", "steps": [1, 2], "profile_continuous_steps": False}
TRAINER_PROFILER = {"activities": ["cpu"], "max_forward_steps": 200}
PROMPTS = ["The rollout server", "One two three", "Red green blue", "A weight update"]


def load_into_worker(worker: Any, path: str) -> int:
    """Runs inside each vLLM worker process (`worker` is vLLM's worker): load the checkpoint at
    `path` through vLLM's in-place reload, which also redoes the kernel repacking its layers do
    after a load (assigning into `worker.model_runner.model`'s parameters alone would not).
    Returns the tensors loaded."""
    from safetensors.torch import load_file

    state = load_file(path)
    worker.reload_weights(weights_iterator=iter(state.items()))
    return len(state)


class EngineRpcTransfer:
    """`move(version)` for ProfiledWeightSync: the actor's weights into every replica's vLLM
    through the app's `engine_rpc` handle method."""

    def __init__(self, app_name: str, actor: Policy, executor: ThreadPoolExecutor, *, set_version: bool = True):
        from ray import serve

        self._handle = serve.get_app_handle(app_name)
        self._actor, self._executor, self._set_version = actor, executor, set_version
        self._dir = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())

    # --8<-- [start:move]
    async def __call__(self, version: int) -> None:
        path = self._dir / f"byo-weights-{os.getpid()}-v{version}.safetensors"
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._actor.save, path)  # on the actor's thread
        try:
            await self._rpc("collective_rpc", [load_into_worker], {"args": [str(path)]})
            if self._set_version:
                await self._rpc("update_weight_version", [version])
        finally:
            path.unlink(missing_ok=True)
    # --8<-- [end:move]

    async def _rpc(self, method: str, args: list[Any], kwargs: dict[str, Any] | None = None) -> None:
        reports = await self._handle.engine_rpc.remote(method, args, kwargs or {})
        failed = [f"{r.replica_id}: {r.error}" for r in reports if not r.ok]
        if failed:
            raise RuntimeError(f"engine rpc {method} failed on {len(failed)} replica(s): {'; '.join(failed)}")


async def fit(args: argparse.Namespace) -> None:
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
            update=EngineRpcTransfer(args.app_name, actor, executor, set_version=not args.skip_version_update),
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
                    f"v{version}: loss {loss:+.3f}, transfer {cost.transfer_s or 0:.3f} s, update {cost.update_s or 0:.3f} s"
                )
            failed = False
        finally:
            await sync.end(failed=failed)  # stop whatever is active, also after an error
        await sync.wait_exported()
        sync.shutdown()


def main(argv: list[str] | None = None) -> None:
    """Parse the options, join the app's Ray cluster and run the loop."""
    import ray

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the app's base URL")
    parser.add_argument("--app-name", default="rollout", help="the app's Serve application name")
    parser.add_argument("--ray-address", default="auto", help="the app's Ray cluster")
    parser.add_argument("--control-token", default=None, help="the app's control token, if it has one")
    parser.add_argument("--save-path", default="/tmp/rollout-profiler/traces", help="the app's save_path")
    parser.add_argument("--model-path", default=None, help="the app's initial checkpoint (default: its tiny Llama)")
    parser.add_argument("--versions", type=int, default=2, help="weight versions to publish")
    parser.add_argument("--skip-version-update", action="store_true", help="show the failure: vLLM's version unset")
    args = parser.parse_args(argv)
    if args.model_path is None:
        from serve_app.tiny_model import ensure_tiny_model

        args.model_path = str(ensure_tiny_model())
    ray.init(address=args.ray_address, log_to_driver=False)
    try:
        asyncio.run(fit(args))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
