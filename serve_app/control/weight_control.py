"""Weight control behind `/weights/update` and its in-cluster forms: the version rule, the path
rule (inside weights_dir), the collective transfer's group (docs/design.md#weights-by-collective),
the trainer's own transfer (source external), the fan-out, and the served version in the desired
state (docs/design.md#status-codes)."""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from profiling.weight_source import WeightSource
from serve_app.api import (
    CollectiveTransfer,
    EngineRpcReport,
    InClusterWeightsRequest,
    Outcome,
    ReplicaReport,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
    receive_bound_s,
)
from serve_app.config import AppArgs
from serve_app.control.capabilities import require
from serve_app.control.fleet import Fleet
from serve_app.desired_state import DesiredState, ObjectStoreWeights, PathWeights, PeerWeights, Weights
from serve_app.engines.options import Capability
from serve_app.errors import Conflict, Refused, Unavailable
from serve_app.metrics import timed_call
from serve_app.weights import collective as weight_wire
from serve_app.weights.checkpoint import resolve_weights_path
from serve_app.weights.safetensors_file import WeightsError


class WeightControl:
    def __init__(self, fleet: Fleet, args: AppArgs):
        self._fleet = fleet
        self._args = args
        self._weights_dir = args.weights_dir

    async def update_weights(self, req: UpdateWeightsRequest) -> UpdateWeightsResponse:
        """Publish `req.version` on every replica from its `source`: the file at `req.path`
        (inside weights_dir), a collective transfer, or the trainer's own transfer (external)."""
        if not req.resume:
            require(self._args, Capability.PAUSE, "resume: false")
        # The request's own validation gives each source the field it needs.
        match req.source:
            case WeightSource.COLLECTIVE:
                assert req.collective is not None
                return await self._by_collective(req.version, req.collective, req.resume)
            case WeightSource.EXTERNAL:
                require(self._args, Capability.ADOPT_EXTERNAL, "source external")
                return await self._adopt(req.version, req.resume)
            case WeightSource.PATH:
                assert req.path is not None
                return await self._by_path(req.version, req.path, req.resume)

    async def precheck(self, version: int, path: str | None) -> None:
        """The refusals an update meets before it reaches a replica (an older version: 409; a
        path that is not a checkpoint inside weights_dir: 422), checked ahead of it, so the
        app's own schedule does not stop a step for an update that cannot happen. The update
        checks them again, under the control lock."""
        desired = await self._fleet.desired()
        if version < desired.weight_version:
            raise Conflict(f"version {version} is older than the served version {desired.weight_version}")
        if path is not None:
            try:
                await asyncio.to_thread(resolve_weights_path, path, self._weights_dir)
            except WeightsError as e:
                raise Refused(f"path: {e}") from e

    async def _by_path(self, version: int, path_given: str, resume: bool) -> UpdateWeightsResponse:
        require(self._args, Capability.LOAD_PATH, "source path")
        async with self._fleet.lock, timed_call("update_weights"):
            try:
                path = str(resolve_weights_path(path_given, self._weights_dir))
            except WeightsError as e:
                raise Refused(f"path: {e}") from e
            desired = await self._check_version(version, path)
            reports = await self._fleet.broadcast("update_weights", version, path, resume)
            return await self._loaded(desired, version, resume, reports, PathWeights(path=path))

    async def update_weights_in_cluster(
        self, req: InClusterWeightsRequest, refs: list[ray.ObjectRef]
    ) -> UpdateWeightsResponse:
        """Load the state dict behind `refs[0]` (put in the object store by a trainer in the same
        Ray cluster) as `req.version` on every replica, on every node, without a shared disk."""
        if not req.resume:
            require(self._args, Capability.PAUSE, "resume: false")
        require(self._args, Capability.LOAD_PATH, "weights through the object store")
        async with self._fleet.lock, timed_call("update_weights"):
            desired = await self._check_version(req.version, None)
            if len(refs) != 1 or not isinstance(refs[0], ray.ObjectRef):
                raise Refused("refs: pass [ray.put(state_dict)], a list holding one ObjectRef")
            reports = await self._fleet.broadcast("update_weights_in_cluster", req.version, refs, req.resume)
            return await self._loaded(desired, req.version, req.resume, reports, ObjectStoreWeights(), refs=refs)

    async def _by_collective(self, version: int, transfer: CollectiveTransfer, resume: bool) -> UpdateWeightsResponse:
        """Every live replica joins the sync's group and stages the broadcast; only when every one
        of them has it do they load it, else none does (docs/design.md#weights-by-collective)."""
        async with self._fleet.lock, timed_call("update_weights"):
            if self._args.weight_transfer != WeightSource.COLLECTIVE:
                raise Refused(
                    f"source collective needs the app's weight_transfer: collective (it is "
                    f"{self._args.weight_transfer}): set it in the app's args, or publish through a path"
                )
            if transfer.backend != self._args.collective_backend:
                raise Refused(
                    f"collective.backend is {transfer.backend}, but the app's collective_backend is "
                    f"{self._args.collective_backend}: use the app's"
                )
            desired = await self._check_version(version, None)
            members = sorted((r for r in await self._fleet.broadcast("status") if r.ok), key=lambda r: r.replica_id)
            if not members:
                raise Unavailable(f"no replica is live to receive version {version}")
            first_ranks: dict[str, int] = {}
            world_size = 1  # rank 0: the trainer's publishing rank
            for r in members:
                first_ranks[r.replica_id] = world_size
                world_size += r.transfer_ranks or 1
            timeout_s = self._args.control_timeout_s
            try:
                await asyncio.wait_for(asyncio.to_thread(_announce, transfer, world_size, timeout_s), timeout_s)
            except PermissionError as e:  # the store is there, the group sealed with another secret
                raise Refused(f"collective: {e}") from None
            except Exception as e:  # noqa: BLE001 - the caller's address: a 422 naming it
                raise Refused(
                    f"collective: cannot reach the trainer's store at {transfer.address}:{transfer.port} "
                    f"({type(e).__name__}); give an address every replica's node can reach"
                ) from None
            reports = await self._fleet.broadcast(
                "receive_weights",
                version,
                transfer,
                first_ranks,
                world_size,
                timeout_s=receive_bound_s(transfer, timeout_s),
            )
            answered = {r.replica_id for r in reports}
            failed = [r for r in reports if not r.ok] + [
                ReplicaReport(replica_id=rid, ok=False, error="did not answer: died or removed")
                for rid in first_ranks
                if rid not in answered
            ]
            if failed:
                await self._fleet.broadcast("drop_staged")
                named = "; ".join(f"{r.replica_id}: {r.error}" for r in failed)
                raise Unavailable(
                    f"the collective transfer of version {version} did not reach every replica, so none loads "
                    f"it and version {desired.weight_version} keeps serving: {named}; publish again (the next "
                    "sync counts the live replicas anew)",
                    reports,
                )
            loaded = await self._fleet.broadcast("load_staged", version, resume)
            response = await self._loaded(desired, version, resume, loaded, PeerWeights())
            response.transfer_s = max((r.transfer_s or 0.0) for r in reports)
            return response

    async def _adopt(self, version: int, resume: bool) -> UpdateWeightsResponse:
        """The trainer moved the weights itself: publish `version` once every replica's engine
        reports it (nothing is loaded), with the hold semantics of any update."""
        async with self._fleet.lock, timed_call("update_weights"):
            desired = await self._fleet.desired()
            if version < desired.weight_version:
                raise Conflict(f"version {version} is older than the served version {desired.weight_version}")
            if version == desired.weight_version and not isinstance(desired.weights, PeerWeights):
                raise Conflict(
                    f"version {version} is served already, from other weights; publish them as a new version"
                )
            reports = await self._fleet.broadcast("adopt_weights", version, resume)
            if refused := [r for r in reports if r.outcome is Outcome.REFUSED]:
                raise Refused(f"source external: {refused[0].error}", reports)
            if failed := [r for r in reports if not r.ok]:
                named = "; ".join(f"{r.replica_id}: {r.error}" for r in failed)
                raise Conflict(
                    f"not every replica reports version {version}, so it is not published (version "
                    f"{desired.weight_version} stays the app's): {named}",
                    reports,
                )
            return await self._loaded(desired, version, resume, reports, PeerWeights())

    async def engine_rpc(
        self, method: str, args: list[Any], kwargs: dict[str, Any], timeout_s: float | None
    ) -> list[EngineRpcReport]:
        """`method(*args, **kwargs)` of every replica's engine; one report per replica."""
        require(self._args, Capability.ENGINE_RPC)
        reports = await self._fleet.broadcast("engine_rpc", method, args, kwargs, timeout_s=timeout_s)
        if not any(r.ok for r in reports):
            detail = "; ".join(f"{r.replica_id}: {r.error}" for r in reports)
            raise Unavailable(f"no replica ran engine rpc {method}: {detail}", reports)
        return [r if isinstance(r, EngineRpcReport) else EngineRpcReport(**r.model_dump()) for r in reports]

    async def _check_version(self, version: int, path: str | None) -> DesiredState:
        """409 for an older version, and for the served version with other weights (`path`
        None: weights through the object store, which cannot be compared): a version names one
        set of weights, which replicas that join later load too."""
        desired = await self._fleet.desired()
        if version < desired.weight_version:
            raise Conflict(f"version {version} is older than the served version {desired.weight_version}")
        if version == desired.weight_version and (path is None or desired.weights != PathWeights(path=path)):
            raise Conflict(f"version {version} is served already, from other weights; publish them as a new version")
        return desired

    async def _loaded(
        self,
        desired: DesiredState,
        version: int,
        resume: bool,
        reports: list[ReplicaReport],
        weights: Weights,
        *,
        refs: list[ray.ObjectRef] | None = None,
    ) -> UpdateWeightsResponse:
        """Publish the new served version once any replica loaded it (else 422, old one serves)."""
        ok = [r for r in reports if r.ok]
        if not ok:
            detail = next((r.error for r in reports if r.error), "no replica loaded the weights")
            raise Refused(f"weights not loaded, version {desired.weight_version} keeps serving: {detail}", reports)
        if refs is not None:  # before the state that points at them: joiners read both
            self._fleet.weights_refs = refs
        loaded_new = version != desired.weight_version
        desired.weight_version, desired.weights = version, weights
        desired.paused = not resume
        # A hold kept across a load counts from the load's end (the replicas renew theirs then too).
        await self._fleet.publish(desired, renew_hold=loaded_new)
        transfer_s = [r.transfer_s for r in ok if r.transfer_s is not None]
        return UpdateWeightsResponse(
            version=version,
            replicas=reports,
            load_s=max((r.load_s or 0.0) for r in ok),
            transfer_s=max(transfer_s) if transfer_s else None,
        )


def _announce(transfer: CollectiveTransfer, world_size: int, timeout_s: float) -> None:
    """Tell the publisher the group's world size, in its own store, sealed with the sync's secret
    (PermissionError: the publisher sealed the group with another one)."""
    store = weight_wire.connect_store(transfer.address, transfer.port, timeout_s)
    weight_wire.announce(store, transfer, world_size, timeout_s)
