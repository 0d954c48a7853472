"""The ingress's per-app settings that its route guards and error handlers read.

The FastAPI app and its handlers are built when the module is imported (the ingress class is
decorated then), before any app args exist; the ingress sets these once it starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from serve_app.control_token import read_control_token
from serve_app.net import is_loopback
from serve_app.redact import Redactor, app_redactor

if TYPE_CHECKING:
    from serve_app.config import AppArgs


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


def configure_for(args: AppArgs, host: str | None, request_timeout_s: float | None) -> str | None:
    """Set this process's settings for an HTTP front of the app with `args` listening on `host`
    (None: not known here); returns the control token (None: the app has none)."""
    token = read_control_token(args)
    configure(
        IngressSettings(
            access=Access(token=token, loopback_only=host is not None and is_loopback(host)),
            max_body_bytes=args.request_limits.max_body_bytes,
            request_timeout_s=request_timeout_s,
            redact=app_redactor(args),
        )
    )
    return token


def current() -> IngressSettings:
    return _current
