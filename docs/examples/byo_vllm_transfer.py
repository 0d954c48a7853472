"""Bring your own weight transfer: a trainer that moves weights into vLLM replicas itself (runnable).

Many RL trainers already have their own way to put weights into vLLM (an NCCL group of their own,
CUDA IPC, vLLM's weight-transfer engine). They keep it: `ProfiledWeightSync(...,
publisher=ExternalPublisher(move))` calls `await move(version)` between the stop (which holds
generation) and the start of the next profiled step, then publishes the version with
`/weights/update {"source": "external"}`, which succeeds only when every replica's vLLM reports
that version (docs/engines.md#vllm-engine-rpc).

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

import asyncio
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import byo_loop  # docs/examples/byo_loop.py: the trainer loop both examples share

from trainer.policy import Policy


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


def main(argv: list[str] | None = None) -> None:
    """Parse the options, join the app's Ray cluster and run the loop (docs/examples/byo_loop.py)."""
    args = byo_loop.parser(__doc__.split("\n")[0]).parse_args(argv)
    byo_loop.run(
        args,
        lambda a, client, actor, executor: EngineRpcTransfer(
            a.app_name, actor, executor, set_version=not a.skip_version_update
        ),
    )


if __name__ == "__main__":
    main()
