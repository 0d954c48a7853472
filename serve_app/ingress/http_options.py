"""Serve's HTTP options, read where a Serve controller is reachable."""

from __future__ import annotations

import ray
from ray.serve.config import HTTPOptions


def serve_http_options() -> HTTPOptions | None:
    """Serve's HTTP options (its proxies' host, the operator's request timeout), when a Serve
    controller is reachable from here (the builder of `serve run config.yaml` and `serve deploy`
    runs where it is; None elsewhere)."""
    if not ray.is_initialized():
        return None
    from ray.serve.context import _get_global_client  # no public API reads the HTTP options

    try:
        client = _get_global_client(raise_if_no_controller_running=False)
    except Exception:  # noqa: BLE001 - no controller to ask: the ingress checks again when it starts
        return None
    return None if client is None else client.http_config
