"""The desired state of the rollout fleet, and its durable record (docs/design.md#desired-state).

The controller (serve_app/controller.py) is its only writer and its only reader of record;
replicas ask the controller for it when they start and at their health checks. The record lives
in Ray's GCS key-value store (every node reaches it, and it outlives any actor), keyed by the app
and by the deployment of the app, so:

* a controller that restarts (crashed, killed, moved to another node) reads back the version, where
  the weights came from, the active step and the hold it left;
* a new deployment of the app (`serve run`, `serve deploy`: the application builder makes a new
  deployment id) starts clean, unless its args say `resume_state: true`, when it takes over the
  record the app's last deployment left in this Ray cluster.

The record does not outlive the Ray cluster (GCS's store lives in the head node's memory unless
GCS fault tolerance backs it with Redis).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator
from ray.experimental import internal_kv

from profiling.manifest import Driver
from profiling.session import SessionSpec
from profiling.weight_source import WeightSource
from serve_app.api import ClientPauseMode, ScheduleSpec

log = logging.getLogger(__name__)

_NAMESPACE = "rollout_profiler"


class InitialWeights(BaseModel):
    """The engine's own weights, as it started: nothing was published."""

    source: Literal[WeightSource.INITIAL] = WeightSource.INITIAL


class PathWeights(BaseModel):
    """The served weights are the file (or checkpoint directory) at `path`."""

    source: Literal[WeightSource.PATH] = WeightSource.PATH
    path: str


class ObjectStoreWeights(BaseModel):
    """The served weights came through the Ray object store (the controller keeps their ref)."""

    source: Literal[WeightSource.OBJECT_STORE] = WeightSource.OBJECT_STORE


class PeerWeights(BaseModel):
    """The served weights came by collective or by the trainer's own transfer: no file holds
    them, so a replica that starts copies them from a peer replica serving `weight_version`."""

    source: Literal[WeightSource.PEER] = WeightSource.PEER


Weights = Annotated[InitialWeights | PathWeights | ObjectStoreWeights | PeerWeights, Field(discriminator="source")]
"""Where the served weights came from, which decides how a replica that starts loads them."""


class ClientPause(BaseModel):
    """A client's pause (vLLM's `/pause`) in effect: its mode, and when it ends on its own."""

    mode: ClientPauseMode
    until: float
    """Unix seconds: the pause ends then unless the client resumes first (client_pause_max_s)."""

    def left_s(self) -> float:
        """Seconds until it ends on its own (0: over)."""
        return max(0.0, self.until - time.time())


class DesiredState(BaseModel):
    active: SessionSpec | None = None
    active_since: float | None = None
    """Unix seconds when `active` started: a restarted controller re-arms the step's
    max_duration_s watchdog for the time it has left."""
    weight_version: int = 0
    weights: Weights = InitialWeights()
    """Where the served weights of `weight_version` came from."""
    paused: bool = False
    """The sync's admission hold (a stop with pause, an update with resume false)."""
    client_pause: ClientPause | None = None
    driver: Driver | None = None
    """Who drives the steps: `server` once the app's own schedule started a window, `client` for
    good once a client called /profile/start or /profile/stop (docs/design.md#who-drives)."""
    schedule: ScheduleSpec | None = None
    """The schedule a request gave the app (`POST /profile/schedule`; None: none, the args' if any)."""

    @model_validator(mode="before")
    @classmethod
    def _earlier_record(cls, data: Any) -> Any:
        # A record written before `weights` existed (resume_state across an upgrade) spelled it
        # as three fields.
        if not isinstance(data, dict) or "weights" in data or not _EARLIER_FIELDS & data.keys():
            return data
        earlier = {k: data[k] for k in _EARLIER_FIELDS if k in data}
        rest = {k: v for k, v in data.items() if k not in _EARLIER_FIELDS}
        if earlier.get("weights_in_object_store"):
            weights: dict[str, Any] = {"source": WeightSource.OBJECT_STORE}
        elif earlier.get("weights_from_peer"):
            weights = {"source": WeightSource.PEER}
        elif earlier.get("weights_path"):
            weights = {"source": WeightSource.PATH, "path": earlier["weights_path"]}
        else:
            weights = {"source": WeightSource.INITIAL}
        return {**rest, "weights": weights}


_EARLIER_FIELDS = frozenset({"weights_path", "weights_in_object_store", "weights_from_peer"})


class DesiredStateRecord:
    """The durable record of one deployment of an app: `load` once, then `save` each change.

    Every call is a small GCS request, run off the event loop."""

    def __init__(self, app_name: str, deployment_id: str):
        self._app = app_name
        self._key = f"{app_name}/deployments/{deployment_id}"
        self._latest = f"{app_name}/latest"

    async def load(self, resume: bool) -> DesiredState:
        """This deployment's state: its own record (the controller restarted), else with `resume`
        the record of the app's last deployment, else a clean state. The first load makes this
        deployment the app's latest and drops the records of deployments before it."""
        return await asyncio.to_thread(self._load, resume)

    async def save(self, state: DesiredState) -> None:
        await asyncio.to_thread(_put, self._key, state.model_dump_json())

    def _load(self, resume: bool) -> DesiredState:
        own = _get(self._key)
        if own is not None:
            log.info("desired state read back from this deployment's record (the controller restarted)")
            return DesiredState.model_validate_json(own)
        previous = _get(self._latest)
        state = DesiredState()
        if resume and previous is not None and (record := _get(previous)) is not None:
            state = DesiredState.model_validate_json(record)
            log.warning(
                "resume_state: taking over the desired state of the app's last deployment (weight version %s, "
                "active step %s)",
                state.weight_version,
                state.active.step if state.active else None,
            )
        _put(self._key, state.model_dump_json())
        _put(self._latest, self._key)
        for key in _list(f"{self._app}/deployments/"):
            if key != self._key:  # earlier deployments: none reads them again
                _delete(key)
        return state


def _get(key: str) -> str | None:
    value = internal_kv._internal_kv_get(key, namespace=_NAMESPACE)
    return None if value is None else value.decode()


def _put(key: str, value: str) -> None:
    internal_kv._internal_kv_put(key, value, overwrite=True, namespace=_NAMESPACE)


def _list(prefix: str) -> list[str]:
    return [k.decode() for k in internal_kv._internal_kv_list(prefix, namespace=_NAMESPACE)]


def _delete(key: str) -> None:
    internal_kv._internal_kv_del(key, namespace=_NAMESPACE)
