"""The control plane's typed errors, importable without Ray (the trainer catches them too).

Each `ControlError` subclass is one HTTP status of docs/design.md#status-codes; the ingress
answers with it, and the error crosses Ray intact, so a trainer calling the app through a
DeploymentHandle gets the same status, message and replica reports.
"""

from __future__ import annotations

from typing import Any, ClassVar

from serve_app.api import ReplicaReport


class ControlError(Exception):
    """A control call that cannot be carried out; `status` is its HTTP status."""

    status: ClassVar[int]

    def __init__(self, detail: str, replicas: list[ReplicaReport] | None = None, *, retry_after_s: int | None = None):
        super().__init__(detail)
        self.detail, self.replicas = detail, replicas or []
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[Any, ...]:
        # The default pickling would pass only `detail` (handle calls pickle exceptions).
        return (type(self), (self.detail, self.replicas), {"retry_after_s": self.retry_after_s})


class NotFound(ControlError):
    """404: no such step or model."""

    status = 404


class Conflict(ControlError):
    """409: the call contradicts the app's state (another step active, an older version)."""

    status = 409


class Refused(ControlError):
    """422: the call cannot be carried out as given (the caller's options or inputs)."""

    status = 422


class BacklogFull(ControlError):
    """429: too many earlier steps are still exporting; retry after `retry_after_s`."""

    status = 429


class Unavailable(ControlError):
    """503: no replica could carry out the call (none reachable, none answered)."""

    status = 503


class InsufficientStorage(ControlError):
    """507: save_path cannot be written or read (unwritable, full, or a step's records lost)."""

    status = 507
