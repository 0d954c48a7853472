"""Weight updates for a trainer in the same Ray cluster as the rollout app: the state dict goes
into the Ray object store once and every replica, on every node, fetches it from there, so no
shared filesystem is needed. Trainers outside the cluster use RolloutClient.update_weights with
a path instead."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import ray
import torch
from pydantic import BaseModel
from ray import serve

from serve_app.api import UpdateWeightsResponse
from serve_app.errors import ControlError
from trainer.client import RolloutError


class AppCluster(BaseModel):
    """Where a trainer process finds the app inside its Ray cluster (the main job's
    `trainer.weight_transfer: object_store`)."""

    address: str
    """The cluster's GCS address (`ray.get_runtime_context().gcs_address` in a driver of it)."""
    app_name: str
    """The Serve application's name."""

    @contextlib.contextmanager
    def joined(self) -> Iterator[None]:
        """This process (a trainer rank, which Ray never started in) as a driver of the cluster
        while the block runs, and out of it after. The main job's own process, which started the
        local app, is a driver already and does not call this."""
        # The replicas' logs stay in their own files, as the local app's driver keeps them.
        ray.init(address=self.address, log_to_driver=False)
        try:
            yield
        finally:
            ray.shutdown()


class InClusterWeights:
    """Publishes weight versions to the app named `app_name` through its DeploymentHandle; a
    ProfiledWeightSync takes it as `publisher=InClusterPublisher(InClusterWeights(app_name))`."""

    def __init__(self, app_name: str = "rollout"):
        self._handle = serve.get_app_handle(app_name)

    async def update_weights(
        self, version: int, state_dict: Mapping[str, torch.Tensor], *, resume: bool = True
    ) -> UpdateWeightsResponse:
        """Put `state_dict` (CPU copies) in the object store and load it as `version` on every
        replica; raises RolloutError with the app's status and message when it is refused."""
        ref = ray.put({name: t.detach().cpu() for name, t in state_dict.items()})
        try:
            return await self._handle.update_weights_in_cluster.remote(version, [ref], resume)
        except ControlError as e:
            raise RolloutError("HANDLE", "update_weights_in_cluster", e.status, e.detail, e.replicas) from e
