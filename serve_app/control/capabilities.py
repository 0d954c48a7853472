"""The controller's refusal of a call the app's engine cannot serve: a 422 before any replica is
asked, naming the engine and the capability it lacks (docs/engines.md#capabilities)."""

from __future__ import annotations

from serve_app.config import AppArgs
from serve_app.engines.options import Capability, CapabilityMissing
from serve_app.errors import Refused


def require(args: AppArgs, capability: Capability, what: str = "", fix: str = "") -> None:
    """Refused (422) unless the app's engine declares `capability`; `what` prefixes the message
    with the part of the call that needs it (e.g. "source external"), `fix` ends it with what to
    do instead."""
    try:
        args.engine_options.require(capability, fix)
    except CapabilityMissing as e:
        raise Refused(f"{what}: {e}" if what else str(e)) from None
