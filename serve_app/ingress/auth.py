"""Bearer-token guard for the control routes (/profile/*, /weights/*)."""

from __future__ import annotations

import secrets

from fastapi import Header, HTTPException

_token: str | None = None


def configure(token: str | None) -> None:
    """Set this process's control token (the ingress does it at start; None: no auth)."""
    global _token
    _token = token


async def require_control_token(authorization: str | None = Header(None)) -> None:
    # async: FastAPI runs a plain-def dependency in its thread pool, a thread hop on every control call.
    if _token is None:
        return
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), _token.encode()):
        raise HTTPException(
            status_code=401,
            detail="control routes need 'Authorization: Bearer <control_token>' (the token set in the app's args)",
            headers={"WWW-Authenticate": "Bearer"},
        )
