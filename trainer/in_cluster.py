"""Weight updates for a trainer in the same Ray cluster as the rollout app: the state dict goes
into the Ray object store once and every replica, on every node, fetches it from there, so no
shared filesystem is needed. Trainers outside the cluster use RolloutClient.update_weights with
a path instead."""

from __future__ import annotations

from collections.abc import Mapping

import ray
import torch
from ray import serve

from serve_app.api import UpdateWeightsResponse
from serve_app.errors import ControlError
from trainer.client import RolloutError


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
