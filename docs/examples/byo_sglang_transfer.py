"""Bring your own weight transfer into SGLang replicas: SGLang's update_weights_from_distributed (runnable).

verl and slime move weights into SGLang servers with SGLang's own distributed update: the trainer
forms a process group with every server (the trainer rank 0, each server `rank_offset` + its
tp_rank), broadcasts each tensor, and SGLang loads them and takes the new weight version. A trainer
outside the cluster drives the same routes over HTTP (docs/sglang.md#the-update-group-over-http);
one in the cluster drives them through the handle, and the app profiles around it: `ProfiledWeightSync(...,
publisher=ExternalPublisher(move))` calls `await move(version)` between the stop (which holds generation) and the start
of the next profiled step, then publishes the version with `/weights/update {"source":
"external"}`, which succeeds only when every replica's SGLang reports that version.

`move` reaches each replica's SGLang through the app's handle (`engine_rpc`, never HTTP), with
SGLang's own routes and fields (docs/sglang.md#the-trainers-own-transfer):

1. `init_weights_update_group` on every replica, `rank_offset` given per replica id, while the
   trainer joins the same group as rank 0 (`init_custom_process_group`, as SGLang forms it);
2. `begin_weight_update`, then `update_weights_from_distributed` with every tensor's name, dtype
   and shape and `weight_version`, while the trainer broadcasts each tensor from rank 0 in that
   order; then `end_weight_update`;
3. `destroy_weights_update_group` on both sides.

    serve run --address local config/serve.sglang.yaml      # the app (engine: sglang), in another terminal
    python docs/examples/byo_sglang_transfer.py             # this trainer joins the same Ray cluster

`--save-path` must be the app's `save_path`. `--skip-version-update` leaves `weight_version` out of
step 2, to show the sync failing: the app names each replica and the version its SGLang reports.
`--backend nccl` on GPUs (gloo here, on CPU).
"""

from __future__ import annotations

import asyncio
import datetime
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import byo_loop  # docs/examples/byo_loop.py: the trainer loop both examples share
import torch
import torch.distributed as dist

from serve_app.api import PerReplica
from serve_app.net import free_port
from trainer.client import RolloutClient
from trainer.policy import Policy


def init_custom_process_group(
    backend: str, init_method: str, world_size: int, rank: int, group_name: str, timeout: datetime.timedelta
) -> Any:
    """A process group apart from torch's default one, formed as SGLang forms its side
    (`sglang/srt/utils/common.py`, after OpenRLHF): TCP rendezvous at `init_method` (hosted by
    rank 0), a store under the group's prefix, the group's ranks its own."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=cast(Any, group_name),
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_all(group: Any, state: dict[str, torch.Tensor]) -> None:
    """Rank 0: each tensor, in order, as SGLang receives them (one broadcast per tensor)."""
    for tensor in state.values():
        dist.broadcast(tensor, src=0, group=group)


class SglangDistributedTransfer:
    """`move(version)` for ProfiledWeightSync: the actor's weights into every replica's SGLang by
    SGLang's own distributed update, through the app's `engine_rpc` handle method."""

    def __init__(
        self,
        app_name: str,
        client: RolloutClient,
        actor: Policy,
        executor: ThreadPoolExecutor,
        *,
        backend: str = "gloo",
        timeout_s: float = 120.0,
        set_version: bool = True,
    ):
        import ray
        from ray import serve

        self._handle = serve.get_app_handle(app_name)
        self._client, self._actor, self._executor = client, actor, executor
        self._backend, self._set_version = backend, set_version
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._address = ray.util.get_node_ip_address()  # where every SGLang server reaches rank 0

    # --8<-- [start:move]
    async def __call__(self, version: int) -> None:
        loop = asyncio.get_running_loop()
        state = await loop.run_in_executor(self._executor, self._actor.full_state_dict)  # on the actor's thread
        # Rank 0 is the trainer; each replica's SGLang joins as rank_offset + tp_rank.
        offsets, world_size = {}, 1
        for replica in (await self._client.status()).replicas:
            offsets[replica.replica_id] = world_size
            world_size += replica.transfer_ranks or 1
        name, port = f"weights-v{version}", free_port()
        join = loop.run_in_executor(
            None, init_custom_process_group,
            self._backend, f"tcp://{self._address}:{port}", world_size, 0, name, self._timeout,
        )  # fmt: skip
        await self._rpc(
            "init_weights_update_group",
            master_address=self._address, master_port=port, rank_offset=PerReplica(values=offsets),
            world_size=world_size, group_name=name, backend=self._backend,
        )  # fmt: skip
        group = await join
        try:
            await self._rpc("begin_weight_update")
            sent = loop.run_in_executor(None, broadcast_all, group, state)
            await self._rpc(
                "update_weights_from_distributed",
                names=list(state),
                dtypes=[str(t.dtype).removeprefix("torch.") for t in state.values()],
                shapes=[list(t.shape) for t in state.values()],
                group_name=name,
                weight_version=str(version) if self._set_version else None,
            )
            await sent
            await self._rpc("end_weight_update")
        finally:
            await self._rpc("destroy_weights_update_group", group_name=name)
            dist.destroy_process_group(group)

    # --8<-- [end:move]

    async def _rpc(self, method: str, **body: Any) -> None:
        body = {k: v for k, v in body.items() if v is not None}
        reports = await self._handle.engine_rpc.remote(method, [], body)
        failed = [f"{r.replica_id}: {r.error}" for r in reports if not r.ok]
        if failed:
            raise RuntimeError(f"engine rpc {method} failed on {len(failed)} replica(s): {'; '.join(failed)}")


def main(argv: list[str] | None = None) -> None:
    """Parse the options, join the app's Ray cluster and run the loop (docs/examples/byo_loop.py)."""
    p = byo_loop.parser(__doc__.split("\n")[0])
    p.add_argument("--backend", default="gloo", help="the group's backend: gloo (CPU) or nccl (GPUs)")
    args = p.parse_args(argv)
    byo_loop.run(
        args,
        lambda a, client, actor, executor: SglangDistributedTransfer(
            a.app_name, client, actor, executor, backend=a.backend, set_version=not a.skip_version_update
        ),
    )


if __name__ == "__main__":
    main()
