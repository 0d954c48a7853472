"""Every HTTP route of the app, one mixin per capability: what the ingress serves on Serve's port
and the replica listener on its own (docs/design.md#control-path). The control listener serves
the control part alone (serve_app/ingress/control_listener.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from serve_app.ingress.engine_profile_routes import EngineProfileRoutesMixin
from serve_app.ingress.openai_routes import OpenAIRoutesMixin
from serve_app.ingress.ops_routes import OpsRoutesMixin
from serve_app.ingress.profile_routes import ProfileRoutesMixin
from serve_app.ingress.sglang_routes import SglangRoutesMixin
from serve_app.ingress.vllm_routes import VllmRoutesMixin
from serve_app.ingress.weight_routes import WeightRoutesMixin


class AppRoutes(
    ProfileRoutesMixin,
    EngineProfileRoutesMixin,
    WeightRoutesMixin,
    SglangRoutesMixin,  # before the two it builds on
    OpenAIRoutesMixin,
    VllmRoutesMixin,
    OpsRoutesMixin,
):
    """The route handlers; a subclass sets the handles and settings they read."""

    ROUTES: ClassVar[dict[str, Callable[[Any], Any]]] = {
        **ProfileRoutesMixin.ENDPOINTS,
        **EngineProfileRoutesMixin.ENDPOINTS,
        **WeightRoutesMixin.ENDPOINTS,
        **SglangRoutesMixin.ENDPOINTS,
        **OpenAIRoutesMixin.ENDPOINTS,
        **VllmRoutesMixin.ENDPOINTS,
        **OpsRoutesMixin.ENDPOINTS,
    }
    """Each handler's name and how it is routed (every mixin's ENDPOINTS), in the order of the
    class's bases: the route reference (tools/openapi_doc.py) lists them in that order."""
