"""The engines an app can run, by the `engine:` value that selects each: one line per engine.

Only options classes are imported here (no engine's own packages), so reading a config needs
none of them installed.
"""

from __future__ import annotations

from typing import Literal

from serve_app.engines.options import EngineOptions
from serve_app.engines.sglang.options import SglangOptions
from serve_app.engines.transformers.options import TransformersOptions
from serve_app.engines.vllm.options import VllmOptions

EngineName = Literal["transformers", "vllm", "sglang"]
"""The `engine:` values: the keys of `ENGINE_OPTIONS`."""
DEFAULT_ENGINE: EngineName = "transformers"
"""The engine of an app that names none: the embedded one, which runs anywhere (on CPU)."""

ENGINE_OPTIONS: dict[str, type[EngineOptions]] = {
    cls.engine: cls for cls in (TransformersOptions, VllmOptions, SglangOptions)
}
"""Each engine's options class, by the `engine:` value that selects it."""
