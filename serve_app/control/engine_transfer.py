"""A trainer's weight transfer through the engines' own weight-update API, driven over HTTP as the
engine's own server is driven (vLLM's /init_weight_transfer_engine, /start_weight_update,
/update_weights, /finish_weight_update; SGLang's /init_weights_update_group, /begin_weight_update,
/update_weights_from_distributed, /end_weight_update): docs/design.md#engine-transfer.

* The group: every live replica's engine joins the trainer's group at once. The trainer sees the
  app as one server whose engine workers are every replica's in turn (replicas ordered by id),
  from the trainer's `rank_offset` on, so each replica is handed its own offset.
* One update (begin, chunks, end) is one sync of the app. Begin is the sync's stop: the app's own
  schedule stops the window that the update ends, with the hold, and when nothing stops the hold
  is taken alone; no engine step runs until the update is published (vLLM's layerwise reload puts
  a layer on the meta device until all its weights have come). Each chunk reaches every member
  at once. End closes the engines' update with the version labelled, publishes it as source
  external does (every replica must report it), and the schedule starts the next window before
  generation resumes.
* The hold lasts while calls come: hold_timeout_s after the last one with no further call, the
  update is given up: before generation resumes, every engine closes its update still labelled
  with the served version (vLLM's layerwise reload puts back the served tensors of every layer no
  chunk reached), and the trainer's next call is told.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from profiling.weight_source import WeightSource
from serve_app.api import ReplicaReport, ScheduleActions, UpdateWeightsRequest, UpdateWeightsResponse
from serve_app.config import AppArgs
from serve_app.control.capabilities import require
from serve_app.control.fleet import Fleet
from serve_app.control.profile_control import ProfileControl
from serve_app.control.server_schedule import ServerSchedule
from serve_app.control.weight_control import WeightControl
from serve_app.engines.options import Capability
from serve_app.errors import Conflict, ControlError, Refused, Unavailable
from serve_app.generate_api import version_of_label

log = logging.getLogger(__name__)

ChunkBody = dict[str, Any] | list[dict[str, Any]]
"""One chunk's fields as the engine takes them; a list: one entry per engine worker of the app."""


@dataclass
class _Update:
    """One update in progress, from its begin to its end."""

    took_hold: bool
    """Whether this update began the hold (and so ends it), or found one in place."""
    stopped_step: int | None
    """The window the app's schedule stopped at the begin."""
    version: int | None = None
    """The version a chunk named (SGLang's `weight_version`); None: the served version + 1."""


class EngineTransfer:
    """The trainer's group and the update in progress; one per controller (in memory: a
    controller that restarts forgets both, and the trainer forms its group again)."""

    def __init__(
        self, fleet: Fleet, profile: ProfileControl, weights: WeightControl, schedule: ServerSchedule, args: AppArgs
    ):
        self._fleet, self._profile, self._weights, self._schedule = fleet, profile, weights, schedule
        self._args = args
        self._lock = asyncio.Lock()
        """One group call at a time, in the order they come."""
        self._members: dict[str, int] | None = None
        """The group's replicas, each with the index of its first engine worker among the app's."""
        self._update: _Update | None = None
        self._given_up = False
        """An update was given up since the trainer's last call: its next call is told so."""
        fleet.before_hold_expires = self._give_up

    def refuse_while_open(self, what: str) -> None:
        """Conflict (409) while an update through the engines' API is in progress: `what` would
        act on partly loaded weights or interleave with it."""
        if self._update is not None:
            raise Conflict(
                f"{what} cannot run while a weight update through the engine's own API is in progress (begun by "
                "/start_weight_update or /begin_weight_update): finish it (/finish_weight_update, /end_weight_update) "
                "first"
            )

    async def init(self, body: dict[str, Any], rank_offset: int | None, world_size: int | None) -> list[ReplicaReport]:
        """Every live replica joins the trainer's group with `body` (the engine's init fields),
        its workers from rank `rank_offset` + the workers of the replicas before it (None: `body`
        places them); answers once every one has joined (the trainer joins meanwhile)."""
        require(self._args, Capability.ENGINE_TRANSFER, "a trainer's weight-update group")
        async with self._lock:
            self.refuse_while_open("forming the group again")
            live = sorted((r for r in await self._fleet.broadcast("status") if r.ok), key=lambda r: r.replica_id)
            if not live:
                raise Unavailable("no replica is running to join the trainer's weight-update group")
            first_workers, workers = {}, 0
            for r in live:
                first_workers[r.replica_id] = workers
                workers += r.transfer_ranks or 1
            offsets = None
            if rank_offset is not None:
                if world_size is not None and rank_offset + workers > world_size:
                    raise Refused(
                        f"the app's engines take {workers} ranks of the trainer's group ({len(live)} replicas, "
                        f"{workers} engine workers: GET /get_world_size) from rank_offset {rank_offset} on, but "
                        f"world_size is {world_size}: make world_size at least {rank_offset + workers}"
                    )
                offsets = {rid: rank_offset + first for rid, first in first_workers.items()}
            self._members = None
            reports = await self._fleet.broadcast("transfer_init", body, offsets)
            self._all_done(reports, set(first_workers), "joined the trainer's weight-update group")
            self._members = first_workers
            return reports

    async def begin(self) -> list[ReplicaReport]:
        """Open one update: the app's schedule stops the window it ends (with the hold), or the
        hold is taken alone, then every member's engine opens its update."""
        async with self._lock:
            members = await self._live_members()
            if self._update is not None:
                raise Conflict("a weight update is open already: finish it before starting another")
            self._given_up = False
            desired = await self._fleet.desired()
            took_hold = not desired.paused
            stopped = await self._schedule.stop_ending(desired.weight_version + 1)
            if not (await self._fleet.desired()).paused:
                await self._profile.hold()
            self._update = _Update(took_hold=took_hold, stopped_step=stopped)
            try:
                reports = await self._covered("transfer_begin")
                self._all_done(reports, members, "opened the weight update")
            except ControlError:
                # Nothing changed: the engines that opened close on the served version, and
                # generation goes on.
                self._update = None
                await self._fleet.broadcast("transfer_end", desired.weight_version)
                if took_hold:
                    await self._schedule.release()
                raise
            return reports

    async def send(self, body: ChunkBody, label: str | None) -> list[ReplicaReport]:
        """One chunk into every member's engine at once (each receives the trainer's broadcast).
        `label`: the version the chunk names (SGLang's `weight_version`), published at the end."""
        async with self._lock:
            update = await self._open()
            if label is not None:
                update.version = await self._version(label)
            assert self._members is not None  # an update opens only in a group
            reports = await self._covered(
                "transfer_send", body, self._members, timeout_s=(2 + _tensors(body)) * self._args.control_timeout_s
            )
            self._all_done(
                reports,
                set(self._members),
                "received the chunk (the engines hold partly loaded weights: send the update again, or publish "
                "a version through /weights/update)",
            )
            return reports

    async def end(self, label: str | None) -> UpdateWeightsResponse:
        """Close the update on every member with its version labelled (`label`, else the one a
        chunk named, else the served version + 1), publish that version (every replica must
        report it), and start the window the schedule begins there, which ends the hold."""
        async with self._lock:
            update = await self._open()
            served = (await self._fleet.desired()).weight_version
            version = await self._version(label) if label is not None else update.version or served + 1
            assert self._members is not None
            reports = await self._covered("transfer_end", version)
            self._all_done(reports, set(self._members), f"closed the update to version {version}")
            self._update = None
            try:
                # A window that the version assumed at the begin did not end (the trainer named a later one).
                actions = ScheduleActions(stopped_step=await self._schedule.stop_ending(version) or update.stopped_step)
                response = await self._weights.update_weights(
                    UpdateWeightsRequest(version=version, source=WeightSource.EXTERNAL, resume=False)
                )
                response.schedule = await self._schedule.start_beginning(version, actions)
            finally:
                if update.took_hold and (await self._fleet.desired()).paused:
                    await self._schedule.release()
            return response

    async def close(self, body: dict[str, Any]) -> list[ReplicaReport]:
        """Every member's engine leaves the trainer's group."""
        require(self._args, Capability.ENGINE_TRANSFER, "a trainer's weight-update group")
        async with self._lock:
            self.refuse_while_open("leaving the group")
            reports = await self._fleet.broadcast("transfer_close", body)
            self._members = None
            return reports

    async def _live_members(self) -> set[str]:
        """The group's members, which must be exactly the live replicas: a replica that started
        after the group formed has no rank in it, and one that left breaks it."""
        require(self._args, Capability.ENGINE_TRANSFER, "a trainer's weight-update group")
        if self._members is None:
            raise Conflict(
                "the replicas are in no trainer's weight-update group (or a replica failed to join it): form it "
                "first (/init_weight_transfer_engine, /init_weights_update_group)"
            )
        members = set(self._members)
        live = {r.replica_id for r in await self._fleet.broadcast("status") if r.ok}
        if live != members:
            joined, left = sorted(live - members), sorted(members - live)
            changes = "; ".join(
                part
                for part in (
                    f"started since: {', '.join(joined)}" if joined else "",
                    f"gone since: {', '.join(left)}" if left else "",
                )
                if part
            )
            raise Conflict(f"the replicas changed since the trainer's group formed ({changes}): form the group again")
        return members

    async def _open(self) -> _Update:
        """The update in progress; Conflict when none is, or when it was given up."""
        if self._update is None and self._given_up:
            self._given_up = False
            raise Conflict(
                f"the weight update was given up: no call came within hold_timeout_s ({self._args.hold_timeout_s:g} "
                "s), so every engine closed it on the served version and generation went on: start the update again"
            )
        if self._update is None:
            raise Conflict("no weight update is open: start one (/start_weight_update, /begin_weight_update) first")
        return self._update

    async def _give_up(self) -> None:
        """The hold's deadline came with an update open (called under the fleet's lock, so no
        call of the update runs meanwhile): every member closes it on the served version."""
        if self._update is None:
            return
        self._update, self._given_up = None, True
        served = (await self._fleet.desired()).weight_version
        log.warning(
            "a weight update through the engines' API was given up: no call came within hold_timeout_s; the engines "
            "close it on version %d",
            served,
        )
        reports = await self._fleet.broadcast("transfer_end", served)
        self._all_done(reports, set(self._members or ()), f"closed the given-up update on version {served}")

    async def _version(self, label: str) -> int:
        """The app's version a label names, newer than the served one."""
        version = version_of_label(label)
        if version is None:
            raise Refused(
                f'weight version {label!r} names no version of this app: its versions are "default" (the weights '
                "the engine started with) and positive integers"
            )
        served = (await self._fleet.desired()).weight_version
        if version <= served:
            raise Conflict(f"version {version} is not newer than the served version {served}")
        return version

    async def _covered(self, method: str, *args: Any, timeout_s: float | None = None) -> list[ReplicaReport]:
        """`method` on every replica as a weight load runs: under the fleet's lock, so the hold's
        deadline cannot end it meanwhile, and the hold counting from its end."""
        async with self._fleet.lock:
            await self._open()  # given up while this call waited for the lock
            reports = await self._fleet.broadcast(method, *args, timeout_s=timeout_s)
            desired = await self._fleet.desired()
            if desired.paused:
                await self._fleet.publish(desired, renew_hold=True)
            return reports

    @staticmethod
    def _all_done(reports: list[ReplicaReport], members: set[str], done: str) -> None:
        """Unavailable (503) naming every member that has not `done`."""
        answered = {r.replica_id for r in reports if r.ok}
        failed = [f"{r.replica_id}: {r.error}" for r in reports if not r.ok]
        failed += [f"{rid}: did not answer" for rid in sorted(members - answered - {r.replica_id for r in reports})]
        if failed:
            raise Unavailable(f"not every replica {done}: {'; '.join(failed)}", reports)


def _tensors(body: ChunkBody) -> int:
    """Tensors a chunk carries (each one broadcast, each bounded by the group's own timeout)."""
    first = body[0] if isinstance(body, list) and body else body
    names = first.get("names") if isinstance(first, dict) else None
    return len(names) if isinstance(names, list) else 1
