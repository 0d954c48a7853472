"""Where a weight version comes from: the one vocabulary of every place that names it, the HTTP
update's `source`, the app's and the trainer's `weight_transfer`, the desired state and the
manifest's `sync.transfer` (docs/design.md#weight-transfer). Each place takes the members that
apply to it, as a `Literal` of them."""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class WeightSource(StrEnum):
    """A weight version's source."""

    PATH = "path"
    """A safetensors file or directory the replicas read, named in POST /weights/update."""
    OBJECT_STORE = "object_store"
    """A state dict through Ray's object store (a trainer inside the cluster)."""
    COLLECTIVE = "collective"
    """A state dict broadcast to the replicas over a process group by the trainer's publishing rank."""
    EXTERNAL = "external"
    """The trainer's own transfer into the engines; the app is told the version afterwards."""
    PEER = "peer"
    """A copy from a replica that serves it (a replica that joins after a collective or external
    transfer, which no file holds)."""
    INITIAL = "initial"
    """The model the replicas loaded at start."""

    # A refusal lists the allowed values by repr: 'path', not <WeightSource.PATH: 'path'>.
    __repr__ = str.__repr__


OLD_PATH_SPELLING = "file"
"""How `weight_transfer` and manifests spelled `path` before the vocabularies were one; still
read, never written."""


def read_old_spelling(value: Any) -> Any:
    """`value` with the old spelling of `path` read as `path` (a `BeforeValidator`)."""
    return WeightSource.PATH if value == OLD_PATH_SPELLING else value
