"""The weight half of the engine controller's policy: every weight source (a path, a collective
transfer, an external one) goes through one switch (`_switch`), which pauses the engine between
two engine steps, loads, and applies `resume` (docs/design.md#exact-attribution).

A mixin of `EngineController` (serve_app/engines/controller.py), after Ray Serve LLM's one mixin
per capability: the attributes below are the controller's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, TypeVar

from profiling.session import ProfileSession
from serve_app.engines.adapter import (
    AdoptsExternal,
    CallsEngine,
    EngineAdapter,
    LoadsPath,
    LoadsWeights,
    PassCounts,
    ReceivesCollective,
    TransferRefused,
    TransfersThroughEngine,
    as_capability,
)
from serve_app.engines.admission_hold import AdmissionHold
from serve_app.engines.options import Capability, EngineOptions
from serve_app.weights.checkpoint import StateDict, check_checkpoint
from serve_app.weights.collective_schema import CollectiveTransfer

log = logging.getLogger(__name__)
T = TypeVar("T")


class AdoptRefused(ValueError):
    """Source external on an engine that keeps no weight version of its own (nothing to compare)."""


class AdoptConflict(ValueError):
    """Source external naming a version other than the one the engine reports."""


class _Adopted:
    """What `_switch` gets for a source-external update: the weights are in the engine already."""


_ADOPTED = _Adopted()


class WeightControl:
    """Weight updates from every source, and the engine's own API, on the controller."""

    adapter: EngineAdapter
    model_dir: Path
    weight_version: int
    _options: type[EngineOptions]
    _control: asyncio.Lock
    _admission: AdmissionHold
    _session: ProfileSession

    def _capability(self, capability: Capability, protocol: type[T]) -> T:
        """The adapter as `protocol`; the refusal naming the engine and `capability` when the
        engine does not declare it (no adapter method has run)."""
        self._options.require(capability)
        return as_capability(self.adapter, protocol)

    async def update_weights(self, version: int, path: str | None, resume: bool) -> float:
        """Load `path` as `version` between engine steps; returns seconds spent. Afterwards
        admission is open if `resume`, else held until the next start (or the hold timeout)."""
        t0 = time.perf_counter()
        if path is None or version == self.weight_version:
            await self._switch(version, None, resume)
            return time.perf_counter() - t0
        loader = self._capability(Capability.LOAD_PATH, LoadsPath)
        async with self._admission.covering_load():
            # Names, dtypes and shapes from the headers, before any tensor is read or the engine paused.
            await asyncio.to_thread(check_checkpoint, Path(path), self.model_dir)
            weights = await loader.read_weights(Path(path))
            await self._switch(version, weights, resume)
        return time.perf_counter() - t0

    async def receive_weights(
        self, transfer: CollectiveTransfer, first_rank: int, world_size: int, timeout_s: float
    ) -> float:
        """Receive a collective transfer (serve_app/weights/collective.py) and stage it, without
        touching the served weights; returns seconds spent. Runs outside the control lock, like
        reading a path, so generation goes on meanwhile. A failure leaves nothing staged."""
        receiver = self._capability(Capability.RECEIVE_COLLECTIVE, ReceivesCollective)
        t0 = time.perf_counter()
        try:
            async with self._admission.covering_load():
                await receiver.receive_weights(transfer, first_rank, world_size, timeout_s)
        except BaseException:
            await receiver.drop_staged()
            raise
        return time.perf_counter() - t0

    async def load_staged(self, version: int, resume: bool) -> float:
        """Load what `receive_weights` staged as `version`, as `update_weights` loads a path (the
        same pause, hold and resume), then forget it; returns seconds spent."""
        receiver = self._capability(Capability.RECEIVE_COLLECTIVE, ReceivesCollective)
        t0 = time.perf_counter()
        try:
            async with self._admission.covering_load():
                weights = await receiver.staged_weights() if version != self.weight_version else None
                await self._switch(version, weights, resume)
        finally:
            await receiver.drop_staged()
        return time.perf_counter() - t0

    async def drop_staged(self) -> None:
        """Forget staged weights (the transfer failed on another member): the old version serves on."""
        if self._options.has(Capability.RECEIVE_COLLECTIVE):
            await as_capability(self.adapter, ReceivesCollective).drop_staged()

    async def adopt_weights(self, version: int, resume: bool) -> None:
        """Record `version` as served without loading anything: the trainer moved the weights
        itself (source external). Only when the engine itself reports `version`; the admission
        hold is applied as by `update_weights`. ValueError naming the reported version and the fix."""
        adopts = self._options.has(Capability.ADOPT_EXTERNAL)
        reported = await as_capability(self.adapter, AdoptsExternal).reported_version() if adopts else None
        if reported is None:
            raise AdoptRefused(
                f"engine {self._options.engine} keeps no weight version of its own, so it cannot confirm that "
                f"the trainer moved version {version} into it: publish through source path or collective"
            )
        if reported != version:
            raise AdoptConflict(
                f"the engine reports weight version {reported}, not {version}: finish the transfer of version "
                f"{version} into the engine (and set its weight version) before publishing it"
            )
        async with self._admission.covering_load():  # the trainer's own load just ended: a hold counts from here
            await self._switch(version, _ADOPTED, resume)

    async def weights_snapshot(self) -> StateDict:
        """The served weights as CPU tensors (for a replica that joins after a collective transfer)."""
        return await self._capability(Capability.RECEIVE_COLLECTIVE, ReceivesCollective).weights_snapshot()

    async def engine_rpc(self, method: str, *args: object, **kwargs: object) -> object:
        """Call a method of the engine's own API (vLLM: its AsyncLLM's, e.g. collective_rpc)."""
        return await self._capability(Capability.ENGINE_RPC, CallsEngine).engine_rpc(method, *args, **kwargs)

    # -- the engine's own weight-update group, driven over HTTP (docs/design.md#engine-transfer) --
    async def transfer_init(self, body: dict[str, Any], rank_offset: int | None) -> None:
        """Join the trainer's group (the engine's own init call with `body`), this engine's
        workers from rank `rank_offset` on."""
        await self._transfers().transfer_init(body, rank_offset)

    async def transfer_begin(self) -> None:
        """Open one update of the weights through the group; only while the sync's hold holds
        the engine: no engine step may run on partly loaded weights."""
        transfers = self._transfers()
        if not self._admission.held:
            raise TransferRefused(
                "a weight update through the engine's own API opens only while generation is held (the app "
                "holds it first); this replica is not held: start the update again"
            )
        await transfers.transfer_begin()

    async def transfer_send(self, body: dict[str, Any] | list[dict[str, Any]], first_worker: int) -> None:
        """Receive and load one chunk of the update; the hold's deadline waits for it."""
        transfers = self._transfers()
        async with self._admission.covering_load():
            await transfers.transfer_send(body, first_worker)

    async def transfer_end(self, version: int) -> None:
        """Close the update with the engine's weights labelled `version`; the hold's deadline
        waits for it (engines finish their reload here)."""
        transfers = self._transfers()
        async with self._admission.covering_load():
            await transfers.transfer_end(version)

    async def transfer_close(self, body: dict[str, Any]) -> None:
        """Leave the trainer's group."""
        await self._transfers().transfer_close(body)

    def _transfers(self) -> TransfersThroughEngine:
        transfers = self._capability(Capability.ENGINE_TRANSFER, TransfersThroughEngine)
        if (why := transfers.transfer_problem()) is not None:
            raise TransferRefused(why)
        return transfers

    async def _switch(self, version: int, weights: Any, resume: bool) -> None:
        """Make `version` the served one between engine steps, then apply `resume`: the policy
        every weight source shares. `weights` None: nothing to load (the same version again);
        `_ADOPTED`: the engine holds `version` already, only the bookkeeping of a load is done;
        else what the adapter's `read_weights` or `staged_weights` gave."""
        async with self._control:
            paused_here = False
            if weights is not None and version != self.weight_version:
                replaced = self.weight_version
                self._session.note_weight_load()
                # No engine step between the old version's and the new one's (an engine that
                # cannot pause loads between its own steps; one already paused, by the sync's
                # hold or a client's pause, stays so).
                if not (self._admission.held or self._admission.client_held) and self._options.has(Capability.PAUSE):
                    await self._admission.pause_engine()
                    paused_here = True
                try:
                    if isinstance(weights, _Adopted):
                        await as_capability(self.adapter, AdoptsExternal).adopted(version)
                    else:
                        await as_capability(self.adapter, LoadsWeights).load_weights(weights, version)
                except BaseException:
                    if paused_here:  # keep serving the old weights; the load error is the answer
                        try:
                            await self._admission.resume_engine()
                        except Exception:
                            log.exception("resuming the engine after a failed weight load failed")
                    raise
                self.weight_version = version
                await self._count_outside(replaced)
            if not resume:
                # Hold for the /profile/start that follows, straight from the load's pause: not
                # one engine step may run unprofiled on `version` in between.
                await self._admission.hold()
            elif paused_here:
                await self._admission.resume_engine()
            else:
                await self._admission.release()

    async def _count_outside(self, replaced: int) -> None:
        """Record, in the entry of the window that recorded weights `replaced` alone, how many
        forward passes on them ran outside it (docs/design.md#exact-attribution)."""
        counts: PassCounts | None = self.adapter.pass_counts()
        step = self._session.step_started_on(replaced)
        if counts is not None and step is not None:
            outside = counts.run.get(replaced, 0) - counts.recorded.get(replaced, 0)
            # The entry is rewritten on disk: off the event loop.
            await asyncio.to_thread(self._session.annotate, step, forward_steps_outside=outside)
