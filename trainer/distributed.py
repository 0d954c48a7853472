"""The trainer's ranks (`trainer.world_size` > 1): the process group, what the driving rank shares
with the others, and the clock exchange through it (docs/trainer.md#several-ranks).

Every rank runs the same loop in lockstep over one gloo process group (NCCL on GPUs would carry the
same calls): the driving rank (rank 0) takes each mini-batch from the rollout producers and
broadcasts it, every rank trains on its share, and at each sync every rank joins the full-state-dict
gather. A second group carries the profiling side (the driving rank's note and the clock pings),
so it never interleaves with training collectives.

The group forms on the launcher's store, which listens on loopback alone, with every key sealed
with a secret of the launch (serve_app/weights/collective.py's SealedStore): a process without it cannot
join. What the ranks share travels as JSON of a pydantic model, never as a pickle.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from pydantic import BaseModel, Field, ValidationError

from profiling.clock_exchange import PINGS, ClockReading, offset_from, reversed_offset
from profiling.manifest import ClockOffset, ParallelRank
from serve_app.weights import collective as weight_wire
from trainer.profiled_sync import DriverNote, RankRole

DRIVER_RANK = 0
"""The rank that drives the app and publishes: it holds the gathered full state dict."""
M = TypeVar("M", bound=BaseModel)


class Ranks(BaseModel):
    """This process's place among the trainer's ranks."""

    rank: int = Field(0, ge=0)
    world_size: int = Field(1, ge=1)
    selected: list[int] = Field(default_factory=lambda: [0])
    """The ranks that record the profiled steps (`profiler.ranks` / `profiler.all_ranks`)."""

    @property
    def drives(self) -> bool:
        return self.rank == DRIVER_RANK

    @property
    def records(self) -> bool:
        return self.rank in self.selected

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def role(self, parallel: ParallelRank | None = None) -> RankRole:
        """This rank's `RankRole` for its ProfiledWeightSync (`parallel`: its Megatron
        coordinates), linked to the other ranks by a GlooRankLink when there are several. That
        link makes a process group, a collective call: every rank calls `role()` at the same point."""
        return RankRole(
            rank=self.rank,
            drives=self.drives,
            records=self.records,
            ranks=self.selected,
            world_size=self.world_size,
            link=GlooRankLink(self) if self.distributed else None,
            parallel=parallel,
        )


class Rendezvous(BaseModel):
    """Where the ranks' process group forms: the launcher's store and the secret its keys are sealed with."""

    address: str = "127.0.0.1"
    port: int = Field(ge=1, le=65535)
    secret: str = Field(min_length=32, repr=False)


def host_rendezvous(timeout_s: float, address: str = "127.0.0.1") -> tuple[dist.TCPStore, Rendezvous]:
    """The launcher's store for its ranks, listening on `address` alone (loopback: the ranks are
    this machine's processes), and a fresh secret; the store serves while it is referenced."""
    store = weight_wire.host_store(address, 0, timeout_s)
    return store, Rendezvous(address=address, port=store.port, secret=weight_wire.new_secret())


def init_group(ranks: Ranks, rendezvous: Rendezvous, timeout_s: float) -> weight_wire.SealedStore:
    """Join the trainer's gloo process group on the launcher's store, sealed with the launch's
    secret; `timeout_s` bounds every collective, so a rank that stopped answering fails the others
    instead of hanging them. Returns the sealed store: keep it referenced until
    `dist.destroy_process_group()` (torch calls back into it)."""
    client = weight_wire.connect_store(rendezvous.address, rendezvous.port, timeout_s)
    store = weight_wire.SealedStore(client, rendezvous.secret)
    dist.init_process_group(
        "gloo", store=store, rank=ranks.rank, world_size=ranks.world_size, timeout=timedelta(seconds=timeout_s)
    )
    return store


def share_from_driver(payload: M | None, model: type[M], ranks: Ranks, group: Any = None) -> M:
    """The driving rank's `payload` (None on the others) on every rank, as `model`'s JSON over
    `group` (None: the default group): data, never a pickle, so no rank runs what another sends.
    Blocking: call it where the group's other collectives run (the model thread for the default
    group). ValueError: what arrived is not `model`'s JSON."""
    if ranks.drives:
        if payload is None:
            raise ValueError(f"the driving rank must share a {model.__name__}, not None")
        _broadcast_bytes(payload.model_dump_json().encode(), group)
        return payload
    try:
        return model.model_validate_json(_broadcast_bytes(None, group))
    except ValidationError as e:
        raise ValueError(
            f"rank {ranks.rank}: what the driving rank shared is not a {model.__name__}'s JSON "
            f"({e.errors()[0]['msg']}); every rank must run the same trainer code"
        ) from None


def _broadcast_bytes(data: bytes | None, group: Any) -> bytes:
    """The driving rank's `data` (None on the others) on every rank: its length, then its bytes."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=DRIVER_RANK, group=group)
    if data is not None:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=DRIVER_RANK, group=group)
    return buf.numpy().tobytes()


class GlooRankLink:
    """The profiling side's link between the ranks (trainer.profiled_sync.RankLink): at each
    window stop the driving rank broadcasts its note (its clock against the app's, the sync's cost)
    and answers clock pings from every other selected rank, which composes its own clock against
    the app's through the driving rank's: no rank but the driving one talks to the app."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks
        # Created by every rank, in the same order (a collective call of its own).
        self._group = dist.new_group(backend="gloo")

    async def from_driver(self, note: DriverNote | None) -> tuple[DriverNote, ClockOffset | None]:
        return await asyncio.to_thread(self._exchange, note)

    async def window_opened(self) -> None:
        await asyncio.to_thread(dist.barrier, group=self._group)

    def _exchange(self, note: DriverNote | None) -> tuple[DriverNote, ClockOffset | None]:
        r = self.ranks
        got = share_from_driver((note or DriverNote()) if r.drives else None, DriverNote, r, self._group)
        others = [x for x in r.selected if x != DRIVER_RANK]
        if r.drives:
            for other in others:
                answer_pings(other, self._group)
            return got, got.clock_offset
        if not r.records:
            return got, None
        mine = reversed_offset(offset_from(ping_driver(self._group)))
        return got, compose(mine, got.clock_offset)


def ping_driver(group: Any, pings: int = PINGS) -> list[ClockReading]:
    """This rank brackets `pings` readings of the driving rank's clock with its own. The driving
    rank reads its clock only after receiving the ping, so its reading lies within the bracket."""
    readings = []
    ping, answer = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    for _ in range(pings):
        sent = time.time_ns()
        dist.send(ping, dst=DRIVER_RANK, group=group)
        dist.recv(answer, src=DRIVER_RANK, group=group)
        readings.append(ClockReading(sent, int(answer.item()), time.time_ns()))
    return readings


def answer_pings(rank: int, group: Any, pings: int = PINGS) -> None:
    """The driving rank's side of `ping_driver` for `rank`."""
    ping = torch.zeros(1, dtype=torch.int64)
    for _ in range(pings):
        dist.recv(ping, src=rank, group=group)
        dist.send(torch.tensor([time.time_ns()], dtype=torch.int64), dst=rank, group=group)


def compose(to_driver: ClockOffset, driver_to_app: ClockOffset | None) -> ClockOffset | None:
    """This rank's clock against the app's, through the driving rank's: the offsets add, and so do
    their bounds (None: the driving rank's was not measured)."""
    if driver_to_app is None:
        return None
    return ClockOffset(
        offset_ns=to_driver.offset_ns + driver_to_app.offset_ns,
        bound_ns=to_driver.bound_ns + driver_to_app.bound_ns,
        samples=to_driver.samples,
    )

