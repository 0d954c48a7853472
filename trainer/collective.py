"""Weights by collective, the trainer's side: the publishing rank broadcasts each version's tensors
to every replica over a process group (gloo on CPU, NCCL between GPUs), so no file is written
(docs/design.md#weights-by-collective).

`CollectiveWeights` hosts the store the groups form on, for its lifetime, listening on the address
it is given alone. Per version it seals a fresh group with a fresh secret, asks the app to publish
(`/weights/update` with source collective, the secret in the body) and, concurrently, waits for the
app to write the group's world size into the store, joins as rank 0 and sends the buckets; the app
answers once every replica loaded them, or failed naming who did not receive them. A process
without the secret can neither plant that world size nor join the group.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Literal

import torch

from profiling.weight_source import WeightSource
from serve_app.api import UpdateWeightsRequest, UpdateWeightsResponse
from serve_app.weights import collective as weight_wire
from serve_app.weights.collective_schema import CollectiveTransfer
from trainer.client import RolloutClient, RolloutError

_POLL_S = 0.01
"""How often the world size is looked for: short, so a refusal from the app ends the wait at once."""


class CollectiveWeights:
    """Publishes weight versions to the app behind `client` by broadcast, from this process; a
    ProfiledWeightSync takes it as `publisher=CollectivePublisher(CollectiveWeights(client, ...))`."""

    def __init__(
        self,
        client: RolloutClient,
        *,
        address: str = "127.0.0.1",
        port: int = 0,
        bucket_bytes: int = 64 << 20,
        backend: Literal["gloo", "nccl"] = "gloo",
        timeout_s: float = 60.0,
        on_bucket: Callable[[int, int], None] | None = None,
    ):
        """`address`: this host as every replica's node reaches it, and the only interface the
        store listens on (127.0.0.1: replicas on this machine alone); `port`: the store's (0: a
        free one). `bucket_bytes`: the most bytes broadcast at once (the receivers hold one bucket
        each in flight). `timeout_s`: longest wait for the app to set up a group, and for each
        group operation. `on_bucket(i, count)`: called (on the sending thread) after bucket `i`
        of `count` has gone out, e.g. for progress."""
        self._client = client
        self._address = address
        self._bucket_bytes = bucket_bytes
        self._backend: Literal["gloo", "nccl"] = backend
        self._timeout_s = timeout_s
        self._on_bucket = on_bucket
        self._device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
        self._store = weight_wire.host_store(address, port, timeout_s)

    @property
    def port(self) -> int:
        """The store's port."""
        return int(self._store.port)

    async def update_weights(
        self, version: int, state_dict: Mapping[str, torch.Tensor], *, resume: bool = True
    ) -> UpdateWeightsResponse:
        """Broadcast `state_dict` as `version` to every replica and return the app's answer, with
        `transfer_s` the broadcast's seconds (group setup included). RolloutError: the app
        refused (its status and message), or the broadcast failed (the app's answer names the
        replica that did not receive it; every replica keeps the old version)."""
        state = {name: t.detach() for name, t in state_dict.items()}
        transfer = CollectiveTransfer(
            address=self._address,
            port=self.port,
            group=f"v{version}-{uuid.uuid4().hex[:12]}",
            secret=weight_wire.new_secret(),
            backend=self._backend,
            bucket_bytes=self._bucket_bytes,
            tensors=[weight_wire.meta_of(name, t) for name, t in state.items()],
        )
        weight_wire.host_sync(self._store, transfer)
        request = UpdateWeightsRequest(
            version=version, source=WeightSource.COLLECTIVE, collective=transfer, resume=resume
        )
        answer = asyncio.ensure_future(self._client.publish_weights(request))
        try:
            world_size = await self._world_size(transfer, answer)
        except BaseException:
            answer.cancel()
            raise
        if world_size is None:  # the app answered before forming a group: a refusal
            response = await answer
            raise RolloutError("POST", "/weights/update", 0, "the app answered without a broadcast", response.replicas)
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(self._send, transfer, state, world_size)
        except Exception as e:
            response = await answer  # a refusal naming the replica that did not receive it raises here
            raise RolloutError(
                "POST", "/weights/update", 0, f"the broadcast failed ({e}) although the app answered", response.replicas
            ) from e
        transfer_s = time.perf_counter() - t0
        response = await answer
        return response.model_copy(update={"transfer_s": transfer_s})

    async def _world_size(
        self, transfer: CollectiveTransfer, answer: asyncio.Future[UpdateWeightsResponse]
    ) -> int | None:
        """The group's world size once the app wrote it (None: the app answered first)."""
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                size = weight_wire.read_world_size(self._store, transfer)
            except weight_wire.ForeignValue as e:
                detail = f"no group formed: another process overwrote the group's world size in this rank's store ({e})"
                raise RolloutError("POST", "/weights/update", 0, detail, []) from None
            if size is not None:
                return size
            if answer.done():
                return None
            if time.monotonic() >= deadline:
                raise RolloutError(
                    "POST", "/weights/update", 0, f"the app set up no group within {self._timeout_s:.0f}s", []
                )
            await asyncio.sleep(_POLL_S)

    def _send(self, transfer: CollectiveTransfer, state: dict[str, torch.Tensor], world_size: int) -> None:
        group = weight_wire.open_group(self._store, transfer, 0, world_size, self._timeout_s)
        try:
            weight_wire.send(group, transfer, state, self._device, self._on_bucket)
            return
        except Exception as e:  # noqa: BLE001 - raised below without its traceback, whose frames hold the group
            lines = str(e).strip().splitlines()
            failure = RuntimeError(f"{type(e).__name__}: {lines[0] if lines else ''}")
        # Dropping the group closes its connections: a receiver still waiting fails at once.
        del group
        raise failure
