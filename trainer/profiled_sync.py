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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel

from profiling.config import ProfileOptions
from profiling.manifest import ManifestEntry, SyncCost
from profiling.schedule import StepSchedule, SyncPlan
from profiling.session import ProfileSession, SessionSpec
from profiling.step_stats import Staleness
from profiling.store import TraceStore
from trainer.client import RolloutClient, RolloutError

if TYPE_CHECKING:  # Ray only for trainers that publish through the object store
    import torch

    from trainer.in_cluster import InClusterWeights

T = TypeVar("T")
Weights = str | Path | Mapping[str, "torch.Tensor"]
"""What a sync publishes: a weights path (HTTP), or a state dict (in-cluster, object store)."""
log = logging.getLogger(__name__)


class SyncReport(BaseModel):
    """What one sync did and what it cost on the critical path."""

    plan: SyncPlan
    cost: SyncCost


class ProfiledWeightSync:
    def __init__(
        self,
        schedule: StepSchedule,
        client: RolloutClient,
        *,
        save_path: str | None,
        options: ProfileOptions | None = None,
        rank: int = 0,
        model_executor: Executor | None = None,
        merge_on_complete: bool = False,
        in_cluster: InClusterWeights | None = None,
    ):
        """`save_path`: where the trainer writes its own traces (None: rollout side only).
        `in_cluster`: for a trainer in the app's Ray cluster, publishing state dicts through the
        object store (then `sync`'s `publish` returns the state dict instead of a path).
        `model_executor`: the single thread that runs the trainer's model; trainer profiling
        is started and stopped there (torch.profiler records per thread).
        `merge_on_complete`: merge a step's traces when this process completes its manifest."""
        self.schedule = schedule
        self.client = client
        self.in_cluster = in_cluster
        self.options = options or ProfileOptions()
        self.active: int | None = None
        self._executor = model_executor or ThreadPoolExecutor(1, thread_name_prefix="trainer-model")
        self._session = (
            ProfileSession(
                store=TraceStore(save_path, merge_on_complete=merge_on_complete),
                entry_identity=ManifestEntry(role="trainer", rank=rank),
                exporter=ThreadPoolExecutor(1, thread_name_prefix="trainer-export"),
            )
            if save_path
            else None
        )
        self._version = 0
        self._staleness: dict[int, Staleness] = {}
        """Window label -> staleness of the samples its mini-batches consumed so far."""

    async def __aenter__(self) -> ProfiledWeightSync:
        await self.begin()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.end()

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
    async def begin(self, version: int = 0) -> None:
        """Training starts with `version` loaded: start step 1 if it is profiled."""
        self._version = version
        label = self.schedule.begin() if version == 0 else None
        if label is not None:
            await self.client.start_profile(label, steps=list(self.schedule.window_steps(label)))
            await self._start_trainer(label)
            self.active = label

    async def sync(self, version: int, publish: Callable[[], Awaitable[Weights]] | str | Path) -> SyncReport:
        """Publish `version`: write the weights (`publish` returns their path, or with
        `in_cluster` the state dict itself), then stop -> update_weights -> start as the
        schedule says."""
        plan = self.schedule.sync(version)
        weights = publish if isinstance(publish, (str, Path)) else await publish()
        if not isinstance(weights, (str, Path)) and self.in_cluster is None:  # before any call
            raise TypeError(
                "publish returned a state dict, but this ProfiledWeightSync has no in_cluster "
                "channel: pass in_cluster=InClusterWeights(app_name), or return a weights path"
            )
        cost = SyncCost(began_at=time.time())
        if plan.stop_step is not None:
            t0 = time.perf_counter()
            await self.client.stop_profile(plan.stop_step, pause=True)
            cost.stop_s = time.perf_counter() - t0
            self.active = None
        t0 = time.perf_counter()
        await self._update_weights(version, weights, resume=plan.start_step is None)
        cost.update_s = time.perf_counter() - t0
        self._version = version
        if plan.start_step is not None:
            t0 = time.perf_counter()
            await self.client.start_profile(plan.start_step, steps=list(self.schedule.window_steps(plan.start_step)))
            cost.start_s = time.perf_counter() - t0
            self.active = plan.start_step
        # Trainer-side window: off the rollout's critical path (nothing trains during a sync).
        if plan.update_inside_window and (session := self._session) is not None:
            await self._on_model_thread(lambda: session.mark_weight_update(version, lambda: None))
        if plan.stop_step is not None:
            await self._stop_trainer(plan.stop_step, cost)
        if plan.start_step is not None:
            await self._start_trainer(plan.start_step)
        return SyncReport(plan=plan, cost=cost)

    async def _update_weights(self, version: int, weights: Weights, *, resume: bool) -> None:
        if isinstance(weights, (str, Path)):
            await self.client.update_weights(version, str(weights), resume=resume)
        else:
            assert self.in_cluster is not None  # checked in sync(), before the stop
            await self.in_cluster.update_weights(version, weights, resume=resume)

    async def end(self) -> None:
        """Stop whatever is active (also after an exception); never raises for a dead app."""
        label, self.active = self.active, None
        if label is None:
            return
        try:
            await self.client.stop_profile(label)
        except Exception as e:  # noqa: BLE001 - cleanup must reach the trainer side too
            log.error("could not stop rollout profiling of step %s: %s", label, e)
        await self._stop_trainer(label, None)

    # -- trainer-side profiling --------------------------------------------------------------
    async def _start_trainer(self, label: int) -> None:
        if (session := self._session) is None:
            return
        spec = SessionSpec(step=label, steps=list(self.schedule.window_steps(label)), options=self.options)
        await self._on_model_thread(lambda: session.start(spec, self._version))

    async def _stop_trainer(self, label: int, cost: SyncCost | None) -> None:
        if self._session is None:
            return
        session = self._session
        await self._on_model_thread(lambda: session.stop(label))
        if cost is not None:  # first: the clock exchange below may not finish (the job ending)
            session.annotate(label, sync=cost)
        try:
            # After the sync's calls, off the rollout's critical path: the merge needs this
            # process's clock against the app's (docs/analysis.md#how-clocks-are-aligned).
            session.annotate(label, clock_offset=await self.client.clock_offset())
        except (RolloutError, ValueError) as e:
            log.warning("step %s: the trainer's clock was not measured against the app's: %s", label, e)

    async def wait_exported(self, timeout_s: float = 120.0) -> None:
        """Block until the trainer's trace exports are written (call before reading manifests)."""
        if self._session is not None:
            for label in [w[0] for w in self.schedule.windows]:
                await asyncio.to_thread(self._session.wait_exported, label, timeout_s)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
