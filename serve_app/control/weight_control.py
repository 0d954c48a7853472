"""Weight control behind `/weights/update` and its in-cluster form: the version rule, the path
rule (inside weights_dir), the fan-out, and the served version in the desired state
(docs/design.md#status-codes)."""

from __future__ import annotations

import ray

from serve_app.api import InClusterWeightsRequest, ReplicaReport, UpdateWeightsRequest, UpdateWeightsResponse
from serve_app.config import AppArgs
from serve_app.control.fleet import Fleet
from serve_app.desired_state import DesiredState
from serve_app.errors import Conflict, Refused
from serve_app.metrics import timed_call
from serve_app.weights import WeightsError, resolve_weights_path


class WeightControl:
    def __init__(self, fleet: Fleet, args: AppArgs):
        self._fleet = fleet
        self._weights_dir = args.weights_dir

    async def update_weights(self, req: UpdateWeightsRequest) -> UpdateWeightsResponse:
        """Load the weights at `req.path` (inside weights_dir) as `req.version` on every replica."""
        async with self._fleet.lock, timed_call("update_weights"):
            try:
                path = str(resolve_weights_path(req.path, self._weights_dir))
            except WeightsError as e:
                raise Refused(f"path: {e}") from e
            desired = await self._check_version(req.version, path)
            reports = await self._fleet.broadcast("update_weights", req.version, path, req.resume)
            return await self._loaded(desired, req.version, req.resume, reports, path=path)

    async def update_weights_in_cluster(
        self, req: InClusterWeightsRequest, refs: list[ray.ObjectRef]
    ) -> UpdateWeightsResponse:
        """Load the state dict behind `refs[0]` (put in the object store by a trainer in the same
        Ray cluster) as `req.version` on every replica, on every node, without a shared disk."""
        async with self._fleet.lock, timed_call("update_weights"):
            desired = await self._check_version(req.version, None)
            if len(refs) != 1 or not isinstance(refs[0], ray.ObjectRef):
                raise Refused("refs: pass [ray.put(state_dict)], a list holding one ObjectRef")
            reports = await self._fleet.broadcast("update_weights_in_cluster", req.version, refs, req.resume)
            return await self._loaded(desired, req.version, req.resume, reports, refs=refs)

    async def _check_version(self, version: int, path: str | None) -> DesiredState:
        """409 for an older version, and for the served version with other weights (`path`
        None: weights through the object store, which cannot be compared): a version names one
        set of weights, which replicas that join later load too."""
        desired = await self._fleet.desired()
        if version < desired.weight_version:
            raise Conflict(f"version {version} is older than the served version {desired.weight_version}")
        if version == desired.weight_version and (path is None or path != desired.weights_path):
            raise Conflict(f"version {version} is served already, from other weights; publish them as a new version")
        return desired

    async def _loaded(
        self,
        desired: DesiredState,
        version: int,
        resume: bool,
        reports: list[ReplicaReport],
        *,
        path: str | None = None,
        refs: list[ray.ObjectRef] | None = None,
    ) -> UpdateWeightsResponse:
        """Publish the new served version once any replica loaded it (else 422, old one serves)."""
        ok = [r for r in reports if r.ok]
        if not ok:
            detail = next((r.error for r in reports if r.error), "no replica loaded the weights")
            raise Refused(f"weights not loaded, version {desired.weight_version} keeps serving: {detail}", reports)
        if refs is not None:  # before the state that points at them: joiners read both
            await self._fleet.set_weights_refs(refs)
        desired.weight_version, desired.weights_path = version, path
        desired.weights_in_object_store = refs is not None
        desired.paused = not resume
        await self._fleet.publish(desired)
        return UpdateWeightsResponse(version=version, replicas=reports, load_s=max((r.load_s or 0.0) for r in ok))
