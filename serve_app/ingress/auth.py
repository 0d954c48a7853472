"""Who may drive the app: the control token of /profile/* and /weights/*, and where requests may
come from.

* The token comes from an environment variable or a file named in the app's args
  (`serve_app/control_token.py`), never from the args themselves.
* An app whose HTTP port listens beyond loopback refuses to start without a token: anyone who
  reaches the port could otherwise ratchet the served version, hold generation or block the
  trainer's steps.
* An app bound to loopback answers only requests that address it by a loopback name (or as
  0.0.0.0, `UNSPECIFIED_HOSTS`): a page in a browser on the same machine cannot reach it through
  DNS rebinding.
"""

from __future__ import annotations

import secrets

from fastapi import Header, HTTPException

from serve_app.ingress.settings import current
from serve_app.net import is_loopback

UNSPECIFIED_HOSTS = frozenset({"0.0.0.0", "::"})
"""Host names the loopback guard accepts besides loopback ones: a client on this machine that
addresses the app as 0.0.0.0 reaches it on loopback (TRL's `VLLMClient` and GRPOConfig default
to host 0.0.0.0). A rebinding page sends its own name as Host, never these, and browsers have
refused to send any request to 0.0.0.0 since 2024, so the guard against DNS rebinding holds.
Never a reason to treat a *bound* 0.0.0.0 as loopback (`check_exposure`)."""


class AccessError(ValueError):
    """The app cannot start with this access configuration; the message names the fix."""


def check_exposure(http_host: str | None, token: str | None) -> None:
    """Refuse an HTTP port beyond loopback without a token (`http_host`: Serve's HTTP host,
    None when it cannot be known here)."""
    if http_host is not None and token is None and not is_loopback(http_host):
        raise AccessError(
            f"Serve's HTTP host is {http_host!r}, beyond loopback, and no control token is set: anyone who "
            "reaches the port could drive profiling and weight updates. Set control_token_env (or "
            "control_token_file) in the app's args, or bind http_options.host to 127.0.0.1"
        )


async def require_loopback_host(host: str | None = Header(None, include_in_schema=False)) -> None:
    """Every route: on a loopback-only app, the request must address it by a loopback name."""
    # async: FastAPI runs a plain-def dependency in its thread pool, a thread hop per request.
    if not current().access.loopback_only:
        return
    name = _host_name(host or "")
    if not is_loopback(name) and name not in UNSPECIFIED_HOSTS:
        raise HTTPException(
            status_code=403,
            detail=f"Host {name!r} is not a loopback name: this app listens on loopback only and answers "
            "requests to localhost, 127.0.0.1 or 0.0.0.0 (a guard against DNS rebinding)",
        )


async def require_control_token(authorization: str | None = Header(None)) -> None:
    """The control routes: the bearer token, when the app has one."""
    token = current().access.token
    if token is None:
        return
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), token.encode()):
        raise HTTPException(
            status_code=401,
            detail="control routes need 'Authorization: Bearer <token>' (the token of the app's "
            "control_token_env or control_token_file)",
            headers={"WWW-Authenticate": "Bearer"},
        )


def _host_name(host: str) -> str:
    """The name of a Host header, without its port (`[::1]:8000` -> `::1`)."""
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
