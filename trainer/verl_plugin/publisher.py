"""What verl's trainer gathers at each sync, published to the app as one version
(docs/frameworks/verl.md#weights).

verl hands every trainer rank the same stream of `(name, tensor)` pairs (FSDP gathers each full
tensor across the ranks as the stream is read), and every rank must read it to its end. Rank 0
alone keeps a CPU copy and publishes it as version `global_steps` by the settings' transfer: a
safetensors file in the app's weights_dir (path), Ray's object store (object_store), or a
broadcast to the replicas (collective). A version the app serves already is not published again
(verl publishes version 0, the initial weights the app loaded too, before training, and may
repeat the last version at the end).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterable, Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from profiling.weight_source import WeightSource
from serve_app.api import UpdateWeightsResponse
from trainer.client import RolloutClient
from trainer.verl_plugin.settings import PluginSettings

log = logging.getLogger(__name__)

NamedTensors = Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]]
"""What verl gives a checkpoint engine's `send_weights`: a generator of `(name, tensor)`, sync or async."""
METRIC_PREFIX = "rollout_profiler/"
"""verl logs the metrics a sync returns under their keys."""


class VersionPublisher:
    """One trainer rank's part of each sync (the module docstring)."""

    def __init__(self, settings: PluginSettings, *, publishes: bool, bucket_bytes: int):
        """`publishes`: this is rank 0. `bucket_bytes`: the most bytes a collective broadcasts at
        once (verl's `update_weights_bucket_megabytes`)."""
        self._settings = settings
        self._publishes = publishes
        self._bucket_bytes = bucket_bytes
        self._client: RolloutClient | None = None
        self._served: int | None = None
        """The newest version the app serves, as far as this rank knows (None: not asked yet)."""
        self._previous_file: Path | None = None

    @property
    def client(self) -> RolloutClient:
        if self._client is None:  # made in the event loop verl runs send_weights in
            self._client = self._settings.client()
        return self._client

    async def publish(self, weights: NamedTensors, version: int | None) -> dict[str, float]:
        """Read `weights` to its end; on rank 0 publish them as `version`. verl's metrics of it."""
        t0 = time.perf_counter()
        state = await _collect(weights, keep=self._publishes)
        gather_s = time.perf_counter() - t0
        if not self._publishes:
            return {}
        if version is None:
            raise ValueError(
                "verl published weights without global_steps: the app keys every version by it; call "
                "CheckpointEngineManager.update_weights(global_steps=...)"
            )
        if self._served is None:
            self._served = (await self.client.status()).weight_version
        if version <= self._served:
            if version < self._served:
                raise ValueError(
                    f"verl publishes version {version}, older than the {self._served} the app serves: the app "
                    "keeps the newest; deploy the app anew for a new run (or resume verl from its latest checkpoint)"
                )
            log.info("version %s is served by the app already: not published again", version)
            return {f"{METRIC_PREFIX}gather_s": gather_s}
        t0 = time.perf_counter()
        answer = await self._publish(state, version)
        self._served = version
        update_s = time.perf_counter() - t0
        return {
            f"{METRIC_PREFIX}gather_s": gather_s,
            f"{METRIC_PREFIX}update_s": update_s,
            **({f"{METRIC_PREFIX}transfer_s": answer.transfer_s} if answer.transfer_s is not None else {}),
            **({f"{METRIC_PREFIX}load_s": answer.load_s} if answer.load_s is not None else {}),
        }

    async def _publish(self, state: dict[str, torch.Tensor], version: int) -> UpdateWeightsResponse:
        match self._settings.transfer:
            case WeightSource.PATH:
                return await self._by_path(state, version)
            case WeightSource.OBJECT_STORE:
                from trainer.in_cluster import InClusterWeights  # Ray Serve: only in this mode

                return await InClusterWeights(self._settings.app_name).update_weights(version, state)
            case WeightSource.COLLECTIVE:
                from trainer.collective import CollectiveWeights

                transport = CollectiveWeights(
                    self.client,
                    address=self._settings.collective_address,
                    bucket_bytes=self._bucket_bytes,
                    timeout_s=self._settings.timeout_s,
                )
                return await transport.update_weights(version, state)

    async def _by_path(self, state: dict[str, torch.Tensor], version: int) -> UpdateWeightsResponse:
        assert self._settings.weights_dir is not None  # the settings require it for path
        name = f"verl-v{version}.safetensors"
        path = Path(self._settings.weights_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file(state, str(tmp))
        tmp.replace(path)
        # Relative to weights_dir: the app may see the shared directory under another path.
        answer = await self.client.update_weights(version, name)
        # The served version's file stays: a replica that starts later loads it.
        if self._previous_file is not None:
            self._previous_file.unlink(missing_ok=True)
        self._previous_file = path
        return answer

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


async def _collect(weights: NamedTensors, *, keep: bool) -> dict[str, torch.Tensor]:
    """Read the stream to its end (every rank's part of the gather); with `keep`, a CPU copy of it."""
    state: dict[str, torch.Tensor] = {}
    if isinstance(weights, AsyncIterable):
        async for name, tensor in weights:
            if keep:
                state[name] = tensor.detach().to("cpu", copy=True)
    else:
        for name, tensor in weights:
            if keep:
                state[name] = tensor.detach().to("cpu", copy=True)
    return state
