"""The profiled weight sync: the one object that calls stop -> update_weights -> start in order.

    async with ProfiledWeightSync(schedule, client, ...) as sync:   # begin(): start step 1
        ... train, with sync.fit_step(version) around each mini-batch ...
        await sync.sync(k, publish)                                  # at each new version
    # end(): whatever is active is stopped, also on an exception

At the sync publishing version k (docs/design.md#sync-order): if step k is profiled, stop it with admission
held; update the weights (keeping the hold if step k+1 is profiled); start step k+1 if profiled.
A sync whose steps are not profiled makes no profiling call at all. The trainer's own
torch.profiler window per profiled step covers the mini-batches that produce version k and is
written to step_<k>/trainer/rank_<r>/ with the sync's critical-path cost.

With several trainer ranks (docs/trainer.md#several-ranks) every rank runs one, in lockstep: the
driving rank (`drives=True`) makes the app's calls; the others learn the plan from the schedule
alone, make no HTTP call, and profile the same steps when they are selected (`records`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar, get_args

from pydantic import BaseModel

from profiling.config import ProfileOptions
from profiling.manifest import ClockOffset, ManifestEntry, SyncCost, TrainerRecord, Transfer
from profiling.schedule import StepSchedule, SyncPlan
from profiling.session import ProfileSession, SessionSpec
from profiling.step_stats import Staleness
from profiling.store import TraceStore
from serve_app.api import UpdateWeightsResponse
from trainer.client import RolloutClient, RolloutError

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
Weights = str | Path | Mapping[str, "torch.Tensor"]
"""What a sync publishes: a weights path (HTTP), or a state dict (for a `transport`)."""
Publish = Callable[[], Awaitable["Weights | None"]] | str | Path
"""`sync`'s `publish`: a weights path, or an async callable returning one or a state dict (None on
a rank that only joins the gather)."""
UpdateFn = Callable[[int], Awaitable[object]]
"""A trainer's own weight transfer: `await update(version)` moves version's weights to the engines."""
log = logging.getLogger(__name__)


class StateDictTransport(Protocol):
    """Moves a state dict to every replica as `version`: InClusterWeights (mode `object_store`,
    trainer/in_cluster.py) or CollectiveWeights (mode `collective`, trainer/collective.py)."""

    mode: str
    """The manifest's `sync.transfer` for it: object_store or collective."""

    async def update_weights(
        self, version: int, state_dict: Mapping[str, torch.Tensor], *, resume: bool
    ) -> UpdateWeightsResponse: ...


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


class SyncReport(BaseModel):
    """What one sync did and what it cost on the critical path."""

    plan: SyncPlan
    cost: SyncCost


class ProfiledWeightSync:
    def __init__(
        self,
        schedule: StepSchedule,
        client: RolloutClient | None,
        *,
        save_path: str | None,
        options: ProfileOptions | None = None,
        rank: int = 0,
        drives: bool = True,
        records: bool = True,
        ranks: Sequence[int] | None = None,
        world_size: int = 1,
        link: RankLink | None = None,
        model_executor: Executor | None = None,
        merge_on_complete: bool = False,
        transport: StateDictTransport | None = None,
        update: UpdateFn | None = None,
    ):
        """`save_path`: where the trainer writes its own traces (None: rollout side only).
        `rank`, `drives`, `records`: this process's trainer rank; whether it drives the app (its
        profiling and weight calls: one rank does, `client` may be None on the others); whether it
        records the profiled steps into step_<k>/trainer/rank_<rank>/.
        `ranks`, `world_size`: the ranks that record and the ranks in all (the driving rank writes
        them into each window's trainer record, so a selected rank that dies is named); default:
        this rank if it records.
        `link`: the other ranks (several ranks: the driving rank's note and clock at each stop).
        `transport`: publish state dicts through it (then `sync`'s `publish` returns the state dict
        instead of a path). `update`: the trainer moves the weights itself (`await update(version)`)
        and the app is told the version afterwards; `publish` is then not needed.
        `model_executor`: the single thread that runs the trainer's model; trainer profiling
        is started and stopped there (torch.profiler records per thread).
        `merge_on_complete`: merge a step's traces when this process completes its manifest."""
        if drives and client is None:
            raise ValueError("the driving rank needs a RolloutClient: pass client, or drives=False on other ranks")
        if transport is not None and update is not None:
            raise ValueError("pass transport (a state dict the app moves) or update (your own transfer), not both")
        if transport is not None and transport.mode not in get_args(Transfer):
            raise ValueError(f"transport.mode {transport.mode!r} is not one of {list(get_args(Transfer))}")
        self.schedule = schedule
        self.client = client
        self.transport = transport
        self.update = update
        self.rank, self.drives = rank, drives
        self.link = link
        self.options = options or ProfileOptions()
        self.active: int | None = None
        self._executor = model_executor or ThreadPoolExecutor(1, thread_name_prefix="trainer-model")
        self._store = TraceStore(save_path, merge_on_complete=merge_on_complete) if save_path else None
        self._record = TrainerRecord(
            ranks=sorted(ranks) if ranks is not None else ([rank] if records else []),
            world_size=world_size,
            driver_rank=rank if drives else None,
        )
        self._session = (
            ProfileSession(
                store=self._store,
                entry_identity=ManifestEntry(role="trainer", rank=rank),
                exporter=ThreadPoolExecutor(1, thread_name_prefix="trainer-export"),
            )
            if self._store is not None and records
            else None
        )
        self._version = 0
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
            if self.drives:
                await self._app.start_profile(label, steps=list(self.schedule.window_steps(label)))
            await self._start_trainer(label)
            self.active = label

    async def sync(self, version: int, publish: Publish | None = None) -> SyncReport:
        """Publish `version`: write the weights (`publish` returns their path, or with a
        `transport` the state dict itself; with `update` it is not needed), then stop ->
        update_weights -> start as the schedule says. On a rank that does not drive, `publish`
        still runs (it may be its part of a collective gather) and the app is not called."""
        plan = self.schedule.sync(version)
        cost = SyncCost(transfer=self._transfer_mode())
        weights: Weights | None = None
        if publish is not None:
            t0 = time.perf_counter()
            weights = publish if isinstance(publish, (str, Path)) else await publish()
            cost.publish_s = time.perf_counter() - t0
        if self.drives:
            self._check_publishable(weights)  # before any call
            cost.began_at = time.time()
            if plan.stop_step is not None:
                t0 = time.perf_counter()
                await self._app.stop_profile(plan.stop_step, pause=True)
                cost.stop_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            await self._update_weights(version, weights, cost, resume=plan.start_step is None)
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

    def _transfer_mode(self) -> Transfer | None:
        if not self.drives:
            return None
        if self.update is not None:
            return "external"
        if self.transport is not None:
            mode: Transfer = self.transport.mode  # type: ignore[assignment]  # checked in __init__
            return mode
        return "file"

    def _check_publishable(self, weights: Weights | None) -> None:
        if self.update is not None:
            return
        if weights is None:
            raise TypeError(
                "sync() got no weights to publish: pass publish (a path, or an async callable returning "
                "one or a state dict), or construct ProfiledWeightSync with update= for your own transfer"
            )
        if not isinstance(weights, (str, Path)) and self.transport is None:
            raise TypeError(
                "publish returned a state dict, but this ProfiledWeightSync has no transport: pass "
                "transport=InClusterWeights(app_name) or CollectiveWeights(client, ...), or return a weights path"
            )

    async def _update_weights(self, version: int, weights: Weights | None, cost: SyncCost, *, resume: bool) -> None:
        if self.update is not None:
            t0 = time.perf_counter()
            await self.update(version)
            cost.transfer_s = time.perf_counter() - t0
            cost.load_s = (await self._app.adopt_weights(version, resume=resume)).load_s
            return
        if isinstance(weights, (str, Path)):
            answer = await self._app.update_weights(version, str(weights), resume=resume)
        else:
            assert self.transport is not None and weights is not None  # checked before the stop
            answer = await self.transport.update_weights(version, weights, resume=resume)
        cost.transfer_s, cost.load_s = answer.transfer_s, answer.load_s

    async def end(self, *, failed: bool = False) -> None:
        """Stop whatever is active (also after an exception); never raises for a dead app.
        `failed`: training ended by an exception; the other ranks may be gone, so this rank
        does not wait for them."""
        label, self.active = self.active, None
        if label is None:
            return
        if self.drives:
            try:
                await self._app.stop_profile(label)
            except Exception as e:  # noqa: BLE001 - cleanup must reach the trainer side too
                log.error("could not stop rollout profiling of step %s: %s", label, e)
        await self._stop_trainer(label, None, alone=failed)

    # -- trainer-side profiling --------------------------------------------------------------
    async def _start_trainer(self, label: int) -> None:
        if self.drives and self._store is not None and self._record.ranks:
            # The ranks that will record, before any of them does: a selected rank that never
            # finishes its entry is then awaited, and named when it dies.
            mine = self._record
            await asyncio.to_thread(
                self._store.update_trainer_record, label, lambda r: mine.model_copy(update={"failures": r.failures})
            )
        if self.link is not None:
            await self.link.window_opened()
        if (session := self._session) is None:
            return
        spec = SessionSpec(step=label, steps=list(self.schedule.window_steps(label)), options=self.options)
        await self._on_model_thread(lambda: session.start(spec, self._version))

    async def _stop_trainer(self, label: int, cost: SyncCost | None, *, alone: bool = False) -> None:
        session = self._session
        if session is not None:
            await self._on_model_thread(lambda: session.stop(label))
            if cost is not None and self.drives:  # first: the clock exchange below may not finish
                session.annotate(label, sync=cost)
        # After the sync's calls, off the rollout's critical path: the merge needs this
        # process's clock against the app's (docs/analysis.md#how-clocks-are-aligned).
        offset = await self._driver_clock() if self.drives and (session is not None or self.link) else None
        if self.link is not None and not alone:
            note, offset = await self.link.from_driver(
                DriverNote(clock_offset=offset, sync=cost) if self.drives else None
            )
            if session is not None and not self.drives and note.sync is not None:
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
