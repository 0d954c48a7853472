"""Weights by collective: the wire protocol shared by the trainer's publishing rank and every
receiving engine worker (docs/design.md#weights-by-collective).

One sync is one group. The publishing rank hosts a `TCPStore`; its `/weights/update` call names
the store, a group name unique to the sync and the tensors. The app assigns each receiver (an
embedded engine, or each worker of a vLLM engine) a rank from 1 on and writes the group's world
size into the store under `<group>/world_size`, where the publisher reads it. Every member joins a
process group built on the store under the group's prefix (not torch's default group: a trainer
rank already has one, and so does a vLLM worker); the tensors travel in buckets, each one flat
byte buffer broadcast from rank 0; then the group is dropped. A member that dies breaks the
group, and every other member's next operation fails within the group's timeout, so nothing
waits for it.

Pure torch and pydantic (no Ray, no HTTP): the trainer imports it as well as the app.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from serve_app.api import WORLD_SIZE_KEY, CollectiveTransfer, TensorMeta, plan_buckets


class Group(Protocol):
    """What the protocol uses of a process group (gloo's or NCCL's backend object)."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> Any: ...


def connect_store(address: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the publisher's store (the app's controller and every receiver)."""
    return dist.TCPStore(address, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def open_group(store: dist.Store, group: str, rank: int, world_size: int, timeout_s: float, backend: str) -> Group:
    """Join the sync's group as `rank` of `world_size` (blocks until every member joined, or
    fails after `timeout_s`); every later operation of the group fails after `timeout_s` too."""
    prefixed = dist.PrefixStore(f"{group}/pg/", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return cast(Group, dist.ProcessGroupNCCL(prefixed, rank, world_size, options))
    return cast(Group, dist.ProcessGroupGloo(prefixed, rank, world_size, timeout))


__all__ = ["WORLD_SIZE_KEY", "CollectiveTransfer", "Group", "connect_store", "meta_of", "open_group", "receive", "send"]


def meta_of(name: str, tensor: torch.Tensor) -> TensorMeta:
    """How `tensor` travels under `name`."""
    return TensorMeta(name=name, dtype=str(tensor.dtype).removeprefix("torch."), shape=list(tensor.shape))


def send(
    group: Group,
    transfer: CollectiveTransfer,
    state: Mapping[str, torch.Tensor],
    device: torch.device,
    on_bucket: Callable[[int, int], None] | None = None,
) -> None:
    """Rank 0: broadcast every tensor of `state` in `transfer`'s buckets; `on_bucket(i, count)`
    after bucket `i` of `count` has gone out."""
    buckets = plan_buckets(transfer)
    for n, bucket in enumerate(buckets):
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        for i, offset in zip(bucket.indexes, bucket.offsets, strict=True):
            meta = transfer.tensors[i]
            src = state[meta.name].detach().reshape(-1).view(torch.uint8)
            buf[offset : offset + meta.nbytes].copy_(src, non_blocking=True)
        _broadcast(group, buf)
        if on_bucket is not None:
            on_bucket(n, len(buckets))


def receive(group: Group, transfer: CollectiveTransfer, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Ranks 1..: every tensor of the transfer, bucket by bucket, as the broadcast delivers it
    (each tensor a view into its bucket's own buffer)."""
    for bucket in plan_buckets(transfer):
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        _broadcast(group, buf)
        for i, offset in zip(bucket.indexes, bucket.offsets, strict=True):
            meta = transfer.tensors[i]
            view = buf[offset : offset + meta.nbytes].view(getattr(torch, meta.dtype)).reshape(meta.shape)
            yield meta.name, view


def _broadcast(group: Group, buf: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([buf], opts).wait()
