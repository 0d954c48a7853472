"""The wire of vLLM's dense weight-transfer engine, over gloo (the `rollout_gloo` backend:
docs/engines.md#vllm-weight-transfer-routes): the trainer is rank 0 of a process group formed at
an open TCP rendezvous (`master_address`, `master_port`), as vLLM's NCCL engine forms its group
(`StatelessProcessGroup`), each engine worker joins as `rank_offset` + its worker rank, and each
tensor travels as one broadcast from rank 0, in the order of the update's `names`.

Unlike the app's own collective (serve_app/weights/collective.py, a sealed rendezvous per sync),
this group is open to whoever reaches the port first, as vLLM's NCCL group is: it is for a
trainer that speaks vLLM's weight-transfer routes, on a network it trusts.

Pure torch (no Ray, no HTTP, no vLLM): the trainer side imports it as well as vLLM's workers.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from serve_app.weights.collective import connect_store, host_store

GROUP_PREFIX = "rollout_gloo/"
"""The store prefix the group forms under (both sides must use it)."""


class PlainGroup:
    """One gloo process group apart from torch's default one, with the store it was built on
    (torch calls back into the store while the group lives)."""

    def __init__(self, address: str, port: int, rank: int, world_size: int, timeout_s: float):
        """Join as `rank` of `world_size`: rank 0 hosts the rendezvous on `address`:`port`, the
        others connect to it. Blocks until every member joined, or fails after `timeout_s`; every
        later broadcast fails after `timeout_s` too."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
        self._store: dist.TCPStore = (
            host_store(address, port, timeout_s) if rank == 0 else connect_store(address, port, timeout_s)
        )
        prefixed = dist.PrefixStore(GROUP_PREFIX, self._store)
        self._group: Any = dist.ProcessGroupGloo(prefixed, rank, world_size, datetime.timedelta(seconds=timeout_s))
        self.rank, self.world_size = rank, world_size

    def broadcast(self, tensor: torch.Tensor) -> None:
        """`tensor` from rank 0 into every member's `tensor` (same dtype and shape)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._group.broadcast([tensor], opts).wait()

    def close(self) -> None:
        """Drop the group and its store."""
        self._group = None
        self._store = None  # type: ignore[assignment]


def receive_tensor(group: PlainGroup, dtype_name: str, shape: list[int]) -> torch.Tensor:
    """The next tensor rank 0 broadcasts, on the host."""
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {dtype_name!r} is not a torch dtype (give names as vLLM does: 'float32', 'bfloat16')")
    tensor = torch.empty(shape, dtype=dtype)
    group.broadcast(tensor)
    return tensor


def send_tensors(group: PlainGroup, tensors: list[torch.Tensor]) -> None:
    """Rank 0: each tensor in turn, as the update's `names` list them (contiguous, on the host)."""
    for tensor in tensors:
        group.broadcast(tensor.detach().contiguous().cpu())
