"""The ingress's per-app settings that its route guards and error handlers read.

The FastAPI app and its handlers are built when the module is imported (the ingress class is
decorated then), before any app args exist; the ingress sets these once it starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve_app.redact import Redactor


@dataclass(frozen=True)
class Access:
    token: str | None = None
    """The bearer token of the control routes (None: no token)."""
    loopback_only: bool = False
    """The HTTP port listens on loopback only: requests must name a loopback host."""


@dataclass(frozen=True)
class IngressSettings:
    access: Access = field(default_factory=Access)
    max_body_bytes: int | None = None
    """Largest request body (None: no bound, before the ingress has started)."""
    request_timeout_s: float | None = None
    """The operator's bound on any request (Serve's `http_options.request_timeout_s`), held here
    too: a client's `x-request-timeout-seconds` header can shorten it at the proxy, not lift it."""
    redact: Redactor = field(default_factory=lambda: Redactor({}))
    """Takes absolute server paths out of error texts."""


_current = IngressSettings()


def configure(settings: IngressSettings) -> None:
    """Set this process's ingress settings (the ingress does it at start)."""
    global _current
    _current = settings


def current() -> IngressSettings:
    return _current
