"""The trainer's ranks (`trainer.world_size` > 1): the process group, what the driving rank shares
with the others, and the clock exchange through it (docs/trainer.md#several-ranks).

Every rank runs the same loop in lockstep over one gloo process group (NCCL on GPUs would carry the
same calls): the driving rank (rank 0) takes each mini-batch from the rollout producers and
broadcasts it, every rank trains on its share, and at each sync every rank joins the full-state-dict
gather. A second group carries the profiling side (the driving rank's note and the clock pings),
so it never interleaves with training collectives.
"""

from __future__ import annotations

import asyncio
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, Field

from profiling.clock_exchange import PINGS, ClockReading, offset_from, reversed_offset
from profiling.manifest import ClockOffset
from trainer.profiled_sync import DriverNote

DRIVER_RANK = 0
"""The rank that drives the app and publishes: it holds the gathered full state dict."""


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


def free_port() -> int:
    """A free TCP port on loopback for the process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def init_group(ranks: Ranks, port: int, timeout_s: float) -> None:
    """Join the trainer's gloo process group (rendezvous at 127.0.0.1:`port`); `timeout_s` bounds
    every collective, so a rank that stopped answering fails the others instead of hanging them."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=ranks.rank,
        world_size=ranks.world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def share_from_driver(payload: Any, ranks: Ranks) -> Any:
    """The driving rank's `payload` (a mini-batch), on every rank (blocking: call it on the model
    thread, where the training collectives run)."""
    box = [payload if ranks.drives else None]
    dist.broadcast_object_list(box, src=DRIVER_RANK)
    return box[0]


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
        box = [note.model_dump_json() if r.drives and note is not None else None]
        dist.broadcast_object_list(box, src=DRIVER_RANK, group=self._group)
        got = DriverNote.model_validate_json(box[0]) if box[0] is not None else DriverNote()
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

