"""Weights by collective: the wire protocol shared by the trainer's publishing rank and every
receiving engine worker (docs/design.md#weights-by-collective).

One sync is one group. The publishing rank hosts a `TCPStore`, listening on the address it names
alone; its `/weights/update` call names the store, a group name unique to the sync, a secret fresh
for the sync and the tensors. Every key of the group lives in the store sealed with that secret
(`SealedStore`), so only a process that presents it can find, read or plant one. The app assigns
each receiver (an embedded engine, or each worker of a vLLM engine) a rank from 1 on and writes the
group's world size into the store under `<group>/world_size`, where the publisher reads it. Every
member joins a process group built on the store under the group's prefix (not torch's default
group: a trainer rank already has one, and so does a vLLM worker); the tensors travel in buckets,
each one flat byte buffer broadcast from rank 0; every member then marks itself done in the store
and waits there for the others before it drops the group. A member that dies breaks the group,
and every other member's next operation (or that wait) fails within the group's timeout.

Pure torch, pydantic and `cryptography` (no Ray, no HTTP): the trainer imports it as well as the app.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import os
import secrets
import socket
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from serve_app.weights.buckets import plan_buckets
from serve_app.weights.collective_schema import WORLD_SIZE_KEY, CollectiveTransfer, TensorMeta

CHECK_KEY = "check"
"""Store key (under the group's prefix, its name in the clear) whose value the publisher seals
with the sync's secret, so a member holding another secret fails at once, naming that, instead
of waiting out its timeout."""
_NONCE_BYTES = 12


class Group(Protocol):
    """What the protocol uses of a sync's group (`open_group`'s)."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> Any: ...

    def leave(self) -> None:
        """Wait until every member is done with the group, so none drops it under another."""


class ForeignValue(RuntimeError):
    """A store value that was not sealed with this secret: another secret, or another process wrote it."""


def new_secret() -> str:
    """A fresh secret for one sync (or one set of trainer ranks): 256 random bits, hex."""
    return secrets.token_hex(32)


class SealedStore(dist.Store):
    """The part of `store` that only holders of `secret` can use (docs/design.md#closed-rendezvous).

    A TCPStore has no access control and lists its keys to any client, so a secret in a key prefix
    would be read by the first process that asks. Here every key is named by its HMAC under the
    secret and every value is encrypted and authenticated under it (AES-GCM, bound to its key):
    a process without the secret can neither find a key, read a value, nor write one a member
    accepts (a member reading such a value raises ForeignValue). Keep a reference to it as long as
    any process group built on it lives: torch calls back into this Python object."""

    def __init__(self, store: dist.Store, secret: str):
        super().__init__()
        key = secret.encode()
        self._store = store
        self._names = hmac.digest(key, b"store key names", hashlib.sha256)
        self._aead = AESGCM(hmac.digest(key, b"store values", hashlib.sha256))

    def name(self, key: str) -> str:
        """The name `key` has in the underlying store."""
        return hmac.digest(self._names, key.encode(), hashlib.sha256).hex()

    def seal(self, name: str, value: bytes) -> str:
        """`value` encrypted and authenticated for the underlying store's key `name` (base64:
        the store's bindings take text)."""
        nonce = os.urandom(_NONCE_BYTES)
        return base64.b64encode(nonce + self._aead.encrypt(nonce, value, name.encode())).decode()

    def open(self, name: str, sealed: bytes) -> bytes:
        """What `seal(name, value)` sealed; ForeignValue for anything else."""
        try:
            raw = base64.b64decode(sealed, validate=True)
            return self._aead.decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], name.encode())
        except (InvalidTag, ValueError):
            raise ForeignValue(
                f"store key {name[:16]}... holds a value not sealed with this secret: another process wrote it"
            ) from None

    def set(self, key: str, value: bytes | str) -> None:
        name = self.name(key)
        self._store.set(name, self.seal(name, value.encode() if isinstance(value, str) else value))

    def get(self, key: str) -> bytes:
        name = self.name(key)
        return self.open(name, self._store.get(name))

    def add(self, key: str, value: int) -> int:
        # A sealed counter cannot be added to by the store itself: compare-and-set until no other
        # member changed it in between ("" expects the key to be absent).
        name = self.name(key)
        while True:
            old = self._store.get(name) if self._store.check([name]) else b""
            total = (int(self.open(name, old)) if old else 0) + value
            new = self.seal(name, str(total).encode())
            if self._store.compare_set(name, old.decode(), new) == new.encode():
                return total

    def check(self, keys: list[str]) -> bool:
        return self._store.check([self.name(k) for k in keys])

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        names = [self.name(k) for k in keys]
        if timeout is None:
            self._store.wait(names)
        else:
            self._store.wait(names, timeout)


def host_store(address: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A store's server (the publisher's; the trainer ranks' rendezvous), listening on `address`
    alone (`port` 0: a free one). TCPStore's own server listens on every interface whatever host
    it is given, so it takes over a socket bound here."""
    family, kind, proto, _, where = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(where)
        listener.listen()
    except OSError as e:
        listener.close()
        raise OSError(
            f"cannot listen on {address}:{port} ({e.strerror}): name an address of this host (127.0.0.1 "
            "when every member runs on it), and a free port or 0"
        ) from e
    bound: int = listener.getsockname()[1]
    # The store takes the socket over and closes it with itself.
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(
        address, bound, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=listener.detach()
    )


def connect_store(address: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of a store `host_store` serves (the app's controller and every receiver; each trainer rank)."""
    return dist.TCPStore(address, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def host_sync(store: dist.Store, transfer: CollectiveTransfer) -> None:
    """The publisher, before it posts the sync: seal the group's check key with the sync's secret."""
    name = f"{transfer.group}/{CHECK_KEY}"
    store.set(name, SealedStore(store, transfer.secret).seal(name, b""))


def member_store(store: dist.Store, transfer: CollectiveTransfer, timeout_s: float) -> SealedStore:
    """The sync's part of the publisher's `store`, once its check key shows that the publisher
    sealed the group with this transfer's secret (the controller and every receiver)."""
    name = f"{transfer.group}/{CHECK_KEY}"
    try:
        store.wait([name], datetime.timedelta(seconds=timeout_s))
    except dist.DistStoreError as e:  # its wait's timeout
        raise TimeoutError(
            f"the store at {transfer.address}:{transfer.port} has no group {transfer.group} (timed out after "
            f"{timeout_s:.0f}s): the publisher did not open this sync there"
        ) from e
    sealed = SealedStore(store, transfer.secret)
    try:
        sealed.open(name, store.get(name))
    except ForeignValue:
        raise PermissionError(
            f"the store at {transfer.address}:{transfer.port} sealed group {transfer.group} with another "
            "secret than this request's: the request is not the publisher's, or another process overwrote "
            "the group's check key; publish again"
        ) from None
    return sealed


def announce(store: dist.Store, transfer: CollectiveTransfer, world_size: int, timeout_s: float) -> None:
    """The app's controller: tell the publisher the group's world size, sealed in its store."""
    member_store(store, transfer, timeout_s).set(f"{transfer.group}/{WORLD_SIZE_KEY}", str(world_size))


def read_world_size(store: dist.Store, transfer: CollectiveTransfer) -> int | None:
    """The publisher: the group's world size, once the app wrote it (None: not yet). ForeignValue:
    another process overwrote it, so no group forms."""
    sealed, key = SealedStore(store, transfer.secret), f"{transfer.group}/{WORLD_SIZE_KEY}"
    return int(sealed.get(key)) if sealed.check([key]) else None


class _SyncGroup:
    """A sync's process group with the sealed store it was built on, which must outlive it."""

    def __init__(self, group: Any, store: SealedStore, group_name: str, rank: int, world_size: int, timeout_s: float):
        self._group, self._store = group, store  # torch calls back into the store while the group lives
        self._left = [f"{group_name}/left/{r}" for r in range(world_size)]
        self._rank, self._timeout = rank, datetime.timedelta(seconds=timeout_s)

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> Any:
        return self._group.broadcast(tensors, opts)

    def leave(self) -> None:
        # A member done early must not close its connections while a slower one is still
        # connecting to it: gloo's mesh setup fails that one with "Connection closed by peer".
        # The store, not the group, holds the barrier, so no pair is in use when the group drops.
        self._store.set(self._left[self._rank], "")
        try:
            self._store.wait(self._left, self._timeout)
        except dist.DistStoreError as e:
            raise TimeoutError(
                f"not every member of the sync's group finished within {self._timeout.total_seconds():.0f}s"
            ) from e


def open_group(store: dist.Store, transfer: CollectiveTransfer, rank: int, world_size: int, timeout_s: float) -> Group:
    """Join the sync's group as `rank` of `world_size` (blocks until every member joined, or
    fails after `timeout_s`); every later operation of the group fails after `timeout_s` too.
    The group forms on the store's part sealed with the transfer's secret: a process without it
    cannot take a member's place. PermissionError: the publisher sealed the group with another secret."""
    sealed = member_store(store, transfer, timeout_s)
    prefixed = dist.PrefixStore(f"{transfer.group}/pg/", sealed)
    timeout = datetime.timedelta(seconds=timeout_s)
    group: Any
    if transfer.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return _SyncGroup(group, sealed, transfer.group, rank, world_size, timeout_s)


__all__ = [
    "CHECK_KEY",
    "WORLD_SIZE_KEY",
    "CollectiveTransfer",
    "ForeignValue",
    "Group",
    "SealedStore",
    "announce",
    "connect_store",
    "host_store",
    "host_sync",
    "member_store",
    "meta_of",
    "new_secret",
    "open_group",
    "read_world_size",
    "receive",
    "send",
]


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
    group.leave()


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
    group.leave()


def _broadcast(group: Group, buf: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([buf], opts).wait()
