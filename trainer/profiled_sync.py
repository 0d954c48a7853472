"""The profiled weight sync: the one object that calls stop -> update_weights -> start in order.

    async with ProfiledWeightSync(schedule, client, save_path=...) as sync:   # begin(): start step 1
        ... train, with sync.fit_step(version) around each mini-batch ...
        await sync.sync(k, publish)                                  # at each new version
    # end(): whatever is active is stopped, also on an exception

At the sync publishing version k (docs/design.md#sync-order): if step k is profiled, stop it with admission
held; update the weights (keeping the hold if step k+1 is profiled); start step k+1 if profiled.
A sync whose steps are not profiled makes no profiling call at all. The trainer's own
torch.profiler window per profiled step covers the mini-batches that produce version k and is
written to step_<k>/trainer/rank_<r>/ with the sync's critical-path cost.

How the weights travel is the `WeightPublisher` it is given, one per transfer mode
(docs/trainer.md#weight-transfer-modes): `PathPublisher` (a weights file, the default),
`InClusterPublisher` (the Ray object store), `CollectivePublisher` (a broadcast to the replicas) or
`ExternalPublisher` (the trainer's own transfer). One object per mode, so no two modes can be asked
for at once.

With several trainer ranks (docs/trainer.md#several-ranks) every rank runs one, in lockstep, each
with its `RankRole`: the driving rank (`drives=True`) makes the app's calls; the others learn the
plan from the schedule alone, make no HTTP call, and profile the same steps when they are selected
(`records`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

from pydantic import BaseModel

from profiling.config import ProfileOptions
from profiling.manifest import ClockOffset, ManifestEntry, ParallelRank, SyncCost, TrainerRecord, Transfer
from profiling.schedule import StepSchedule, SyncPlan
from profiling.session import ProfileSession, SessionSpec
from profiling.step_stats import Staleness
from profiling.store import TraceStore
from profiling.weight_source import WeightSource
from serve_app.api import UpdateWeightsResponse
from trainer.client import RolloutClient, RolloutError

if TYPE_CHECKING:
    import torch

    from trainer.collective import CollectiveWeights
    from trainer.in_cluster import InClusterWeights

T = TypeVar("T")
Weights = str | Path | Mapping[str, "torch.Tensor"]
"""What a sync publishes: a weights path (PathPublisher), or a state dict (InClusterPublisher,
CollectivePublisher)."""
Publish = Callable[[], Awaitable["Weights | None"]] | str | Path
"""`sync`'s `publish`: a weights path, or an async callable returning one or a state dict (None on
a rank that only joins the gather)."""
UpdateFn = Callable[[int], Awaitable[object]]
"""A trainer's own weight transfer: `await update(version)` moves version's weights to the engines."""
log = logging.getLogger(__name__)
_NO_WEIGHTS = (
    "sync() got no weights to publish: pass publish (a path, or an async callable returning one or a state "
    "dict), or construct ProfiledWeightSync with publisher=ExternalPublisher(update) for your own transfer"
)


class WeightPublisher(ABC):
    """How a sync's weights reach the replicas, between its stop and its start: one subclass per
    transfer mode (docs/trainer.md#weight-transfer-modes). Only the driving rank's is used."""

    transfer: ClassVar[Transfer]
    """The manifest's `sync.transfer` for it."""

    @abstractmethod
    def check(self, weights: Weights | None) -> None:
        """Raise TypeError when `weights` (what `publish` gave) cannot be published this way. Called
        before the sync's first call to the app: a sync that cannot update the weights stops no step."""

    @abstractmethod
    async def update_weights(
        self, app: RolloutClient, version: int, weights: Weights | None, *, resume: bool
    ) -> UpdateWeightsResponse:
        """Load `weights` (checked) as `version` on every replica of the app behind `app`; the
        answer's `transfer_s` and `load_s` are the sync's. `resume`: end the hold on generation
        afterwards (False: the next step's start ends it). RolloutError: the app refused."""


class PathPublisher(WeightPublisher):
    """Weight files (mode file, the default): `publish` writes a checkpoint inside the app's
    `weights_dir` and returns its path; the replicas read it (`/weights/update` with the path)."""

    transfer = WeightSource.PATH

    def check(self, weights: Weights | None) -> None:
        self._path(weights)

    async def update_weights(
        self, app: RolloutClient, version: int, weights: Weights | None, *, resume: bool
    ) -> UpdateWeightsResponse:
        return await app.update_weights(version, self._path(weights), resume=resume)

    @staticmethod
    def _path(weights: Weights | None) -> str:
        if weights is None:
            raise TypeError(_NO_WEIGHTS)
        if not isinstance(weights, (str, Path)):
            raise TypeError(
                "publish returned a state dict, but this ProfiledWeightSync publishes weight files: pass "
                "publisher=InClusterPublisher(transport=InClusterWeights(app_name)) or "
                "CollectivePublisher(transport=CollectiveWeights(client, ...)), or return a weights path"
            )
        return str(weights)


class StateDictTransport(Protocol):
    """Moves a state dict to every replica as `version`: InClusterWeights (trainer/in_cluster.py)
    or CollectiveWeights (trainer/collective.py)."""

    async def update_weights(
        self, version: int, state_dict: Mapping[str, torch.Tensor], *, resume: bool
    ) -> UpdateWeightsResponse: ...


class StateDictPublisher(WeightPublisher):
    """The publishers to which `publish` returns the state dict itself (the full one, on the
    driving rank), moved by `transport`: nothing is written to disk."""

    def __init__(self, transport: StateDictTransport):
        self.transport = transport

    def check(self, weights: Weights | None) -> None:
        self._state_dict(weights)

    async def update_weights(
        self, app: RolloutClient, version: int, weights: Weights | None, *, resume: bool
    ) -> UpdateWeightsResponse:
        return await self.transport.update_weights(version, self._state_dict(weights), resume=resume)

    def _state_dict(self, weights: Weights | None) -> Mapping[str, torch.Tensor]:
        if weights is None:
            raise TypeError(_NO_WEIGHTS)
        if isinstance(weights, (str, Path)):
            raise TypeError(
                f"publish returned a path, but this ProfiledWeightSync publishes state dicts "
                f"({type(self).__name__}): return the state dict, or publish weight files with PathPublisher()"
            )
        return weights


class InClusterPublisher(StateDictPublisher):
    """Through the Ray object store (mode object_store), for a trainer in the app's Ray cluster: every
    replica, on every node, fetches the state dict from there (docs/multi_node.md)."""

    transfer = WeightSource.OBJECT_STORE

    def __init__(self, transport: InClusterWeights):
        """`transport`: `InClusterWeights(app_name)` (trainer/in_cluster.py)."""
        super().__init__(transport)


class CollectivePublisher(StateDictPublisher):
    """By broadcast over a process group made per sync (mode collective; the app needs
    `weight_transfer: collective`: docs/design.md#weights-by-collective)."""

    transfer = WeightSource.COLLECTIVE

    def __init__(self, transport: CollectiveWeights):
        """`transport`: `CollectiveWeights(client, address=...)` (trainer/collective.py)."""
        super().__init__(transport)


class ExternalPublisher(WeightPublisher):
    """The trainer's own transfer (mode external: its NCCL group with the engines, CUDA IPC, an
    engine RPC): `await update(version)` moves the weights, then the app is told the version
    (`/weights/update` with source external) and checks that every replica's engine reports it.
    `sync`'s `publish` is then not needed."""

    transfer = WeightSource.EXTERNAL

    def __init__(self, update: UpdateFn):
        self.update = update

    def check(self, weights: Weights | None) -> None:
        """Anything: `update` moves the weights, so what a `publish` returned is not used."""

    async def update_weights(
        self, app: RolloutClient, version: int, weights: Weights | None, *, resume: bool
    ) -> UpdateWeightsResponse:
        t0 = time.perf_counter()
        await self.update(version)
        transfer_s = time.perf_counter() - t0
        answer = await app.adopt_weights(version, resume=resume)
        return answer.model_copy(update={"transfer_s": transfer_s})


class DriverNote(BaseModel):
    """What the driving rank tells the other ranks at a window's stop."""

    clock_offset: ClockOffset | None = None
    """The driving rank's clock against the app's (None: not measured)."""
    sync: SyncCost | None = None
    """The cost of the sync that stopped the window, as the driving rank measured it."""


class RankLink(Protocol):
    """How the ranks of one trainer reach the driving rank (trainer/distributed.py's GlooRankLink)."""

    async def from_driver(self, note: DriverNote | None) -> tuple[DriverNote, ClockOffset | None]:
        """Called by every rank at each window stop, in lockstep. The driving rank passes its note;
        every rank gets it back, with its own clock against the app's (composed through the driving
        rank's; None where it does not record, or not measured)."""
        ...

    async def window_opened(self) -> None:
        """Called by every rank when a window starts: returns once the driving rank has started it
        on the app (and written its trainer record), so no rank writes into the step's directory
        before the app's start, which moves an earlier run of the step aside."""
        ...


@dataclass(frozen=True)
class RankRole:
    """This process's part among the trainer's ranks (docs/trainer.md#several-ranks). The default is
    a trainer of one rank, which drives and records; `Ranks.role()` (trainer/distributed.py) makes
    one for a rank of a process group."""

    rank: int = 0
    """This process's trainer rank: it records into step_<k>/trainer/rank_<rank>/."""
    drives: bool = True
    """Whether it drives the app (the profiling and weight calls): one rank does, and the others
    may have no client."""
    records: bool = True
    """Whether it records the profiled steps."""
    ranks: Sequence[int] | None = None
    """The ranks that record (the driving rank writes them into each window's trainer record, so a
    selected rank that dies is named); None: this rank if it records."""
    world_size: int = 1
    """The trainer's ranks in all."""
    link: RankLink | None = None
    """The other ranks (several ranks: the driving rank's note and clock at each stop)."""
    parallel: ParallelRank | None = None
    """Megatron backend: this rank's tensor-, pipeline- and data-parallel ranks, for its entries."""


class SyncReport(BaseModel):
    """What one sync did and what it cost on the critical path."""

    plan: SyncPlan
    cost: SyncCost


class ProfiledWeightSync:
    """One trainer rank's profiled weight syncs: each sync's stop -> update_weights -> start, and
    the trainer's own profiling windows (the module's docstring)."""

    def __init__(
        self,
        schedule: StepSchedule,
        client: RolloutClient | None,
        *,
        save_path: str | None,
        publisher: WeightPublisher | None = None,
        role: RankRole | None = None,
        options: ProfileOptions | None = None,
        model_executor: Executor | None = None,
        merge_on_complete: bool = False,
    ):
        """`client`: the app's (None only where `role` does not drive).
        `save_path`: where the trainer writes its own traces (None: rollout side only).
        `publisher`: how the weights reach the replicas, and so what `sync`'s `publish` returns
        (None: `PathPublisher()`, a weights path).
        `role`: this process's trainer rank (None: `RankRole()`, the only rank).
        `options`: the trainer's profiling windows (None: ProfileOptions' defaults).
        `model_executor`: the single thread that runs the trainer's model; trainer profiling
        is started and stopped there (torch.profiler records per thread).
        `merge_on_complete`: merge a step's traces when this process completes its manifest."""
        role = role or RankRole()
        if role.drives and client is None:
            raise ValueError(
                "the driving rank needs a RolloutClient: pass client, or RankRole(drives=False) on other ranks"
            )
        self.schedule = schedule
        self.client = client
        self.publisher = publisher or PathPublisher()
        self.role = role
        self.options = options or ProfileOptions()
        self.active: int | None = None
        self._executor = model_executor or ThreadPoolExecutor(1, thread_name_prefix="trainer-model")
        self._store = TraceStore(save_path, merge_on_complete=merge_on_complete) if save_path else None
        self._record = TrainerRecord(
            ranks=sorted(role.ranks) if role.ranks is not None else ([role.rank] if role.records else []),
            world_size=role.world_size,
            driver_rank=role.rank if role.drives else None,
        )
        self._session = (
            ProfileSession(
                store=self._store,
                entry_identity=ManifestEntry(role="trainer", rank=role.rank, parallel=role.parallel),
                exporter=ThreadPoolExecutor(1, thread_name_prefix="trainer-export"),
            )
            if self._store is not None and role.records
            else None
        )
        self._version = 0
        self._gather_s: float | None = None
        self._staleness: dict[int, Staleness] = {}
        """Window label -> staleness of the samples its mini-batches consumed so far."""

    async def __aenter__(self) -> ProfiledWeightSync:
        await self.begin()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        await self.end(failed=exc_type is not None)

    # -- the trainer's model thread ----------------------------------------------------------
    @contextlib.contextmanager
    def fit_step(self, version: int) -> Iterator[None]:
        """Wrap one mini-batch (call it on the model executor's thread)."""
        if self._session is None:
            yield
            return
        with self._session.forward_step(version):
            yield

    def consumed(self, version: int, lags: list[int], dropped: int = 0) -> None:
        """The mini-batches producing `version` consumed samples `lags` versions old (and
        dropped `dropped` as too stale): recorded as the `staleness` of the trainer's entry of the
        profiled window holding step `version` (nothing when that step is not profiled)."""
        label = self.schedule.window_label(version)
        if label is None or self._session is None:
            return
        so_far = self._staleness.pop(label, Staleness()).plus(lags, dropped)
        if version != self.schedule.window_steps(label)[-1]:
            self._staleness[label] = so_far  # a continuous window: later steps add to it
        self._session.annotate(label, staleness=so_far)

    async def _on_model_thread(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def _app(self) -> RolloutClient:
        assert self.client is not None  # checked in __init__: the driving rank has one
        return self.client

    async def begin(self, version: int = 0) -> None:
        """Training starts with `version` loaded: start step 1 if it is profiled."""
        self._version = version
        label = self.schedule.begin() if version == 0 else None
        if label is not None:
            if self.role.drives:
                await self._app.start_profile(label, steps=list(self.schedule.window_steps(label)))
            await self._start_trainer(label)
            self.active = label

    async def sync(self, version: int, publish: Publish | None = None) -> SyncReport:
        """Publish `version`: write the weights (`publish` returns what the publisher moves: their
        path, or the state dict itself; an ExternalPublisher needs none), then stop ->
        update_weights -> start as the schedule says. On a rank that does not drive, `publish`
        still runs (it may be its part of a collective gather) and the app is not called."""
        plan = self.schedule.sync(version)
        cost = SyncCost(transfer=self.publisher.transfer if self.role.drives else None)
        weights: Weights | None = None
        if publish is not None:
            t0 = time.perf_counter()
            self._gather_s = None
            weights = publish if isinstance(publish, (str, Path)) else await publish()
            cost.publish_s = time.perf_counter() - t0
            cost.gather_s = self._gather_s
        if self.role.drives:
            self.publisher.check(weights)  # before any call
            cost.began_at = time.time()
            if plan.stop_step is not None:
                t0 = time.perf_counter()
                await self._app.stop_profile(plan.stop_step, pause=True)
                cost.stop_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            answer = await self.publisher.update_weights(self._app, version, weights, resume=plan.start_step is None)
            cost.transfer_s, cost.load_s = answer.transfer_s, answer.load_s
            cost.update_s = time.perf_counter() - t0
            if plan.start_step is not None:
                t0 = time.perf_counter()
                await self._app.start_profile(plan.start_step, steps=list(self.schedule.window_steps(plan.start_step)))
                cost.start_s = time.perf_counter() - t0
        if plan.stop_step is not None:
            self.active = None
        self._version = version
        if plan.start_step is not None:
            self.active = plan.start_step
        # Trainer-side window: off the rollout's critical path (nothing trains during a sync).
        if plan.update_inside_window and (session := self._session) is not None:
            await self._on_model_thread(lambda: session.mark_weight_update(version, lambda: None))
        if plan.stop_step is not None:
            await self._stop_trainer(plan.stop_step, cost)
        if plan.start_step is not None:
            await self._start_trainer(plan.start_step)
        return SyncReport(plan=plan, cost=cost)

    def gathered(self, seconds: float) -> None:
        """The publish being run gathered the state dict from the ranks' shards in `seconds`
        (called from the publish): the sync's cost carries it as `gather_s`."""
        self._gather_s = seconds

    async def end(self, *, failed: bool = False) -> None:
        """Stop whatever is active (also after an exception); never raises for a dead app.
        `failed`: training ended by an exception; the other ranks may be gone, so this rank
        does not wait for them."""
        label, self.active = self.active, None
        if label is None:
            return
        if self.role.drives:
            try:
                await self._app.stop_profile(label)
            except Exception as e:  # noqa: BLE001 - cleanup must reach the trainer side too
                log.error("could not stop rollout profiling of step %s: %s", label, e)
        await self._stop_trainer(label, None, alone=failed)

    # -- trainer-side profiling --------------------------------------------------------------
    async def _start_trainer(self, label: int) -> None:
        if self.role.drives and self._store is not None and self._record.ranks:
            # The ranks that will record, before any of them does: a selected rank that never
            # finishes its entry is then awaited, and named when it dies.
            mine = self._record
            await asyncio.to_thread(
                self._store.update_trainer_record, label, lambda r: mine.model_copy(update={"failures": r.failures})
            )
        if self.role.link is not None:
            await self.role.link.window_opened()
        if (session := self._session) is None:
            return
        spec = SessionSpec(step=label, steps=list(self.schedule.window_steps(label)), options=self.options)
        await self._on_model_thread(lambda: session.start(spec, self._version))

    async def _stop_trainer(self, label: int, cost: SyncCost | None, *, alone: bool = False) -> None:
        session = self._session
        if session is not None:
            await self._on_model_thread(lambda: session.stop(label))
            if cost is not None and self.role.drives:  # first: the clock exchange below may not finish
                session.annotate(label, sync=cost)
        # After the sync's calls, off the rollout's critical path: the merge needs this
        # process's clock against the app's (docs/analysis.md#how-clocks-are-aligned).
        offset = await self._driver_clock() if self.role.drives and (session is not None or self.role.link) else None
        if self.role.link is not None and not alone:
            note, offset = await self.role.link.from_driver(
                DriverNote(clock_offset=offset, sync=cost) if self.role.drives else None
            )
            if session is not None and not self.role.drives and note.sync is not None:
                session.annotate(label, sync=note.sync)
        if session is not None and offset is not None:
            session.annotate(label, clock_offset=offset)

    async def _driver_clock(self) -> ClockOffset | None:
        try:
            return await self._app.clock_offset()
        except (RolloutError, ValueError) as e:
            log.warning("the trainer's clock was not measured against the app's: %s", e)
            return None

    async def wait_exported(self, timeout_s: float = 120.0) -> None:
        """Block until the trainer's trace exports are written (call before reading manifests)."""
        if self._session is not None:
            for label in [w[0] for w in self.schedule.windows]:
                await asyncio.to_thread(self._session.wait_exported, label, timeout_s)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
