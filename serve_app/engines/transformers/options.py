"""The options of `engine: transformers`."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from serve_app.engines.options import Capability, EngineOptions


class TransformersOptions(EngineOptions):
    """`engine: transformers`, the embedded engine: HF transformers + torch in the replica's
    process, batched generation on one model thread, profiled in process."""

    engine = "transformers"
    implementation = "serve_app.engines.transformers.engine:TransformersEngine"
    capabilities = frozenset(
        {
            Capability.GENERATE,
            Capability.PROFILE,
            Capability.PAUSE,
            Capability.LOAD_PATH,
            Capability.RECEIVE_COLLECTIVE,
            Capability.ABORT,
        }
    )
    lacks: ClassVar[dict[Capability, str]] = {
        Capability.ADOPT_EXTERNAL: "it keeps no weight version of its own, so it cannot confirm that the "
        "trainer moved the weights into it; publish through source path or collective",
        Capability.ENGINE_TRANSFER: "its weights load only through the app: publish through POST "
        "/weights/update with source path or collective (the app's own group), or deploy engine vllm or sglang",
    }
    tools = ("torch", "npu", "nsys")

    max_batch_size: int = Field(16, ge=1)
    """Sequences decoded together in one forward pass; more wait for the next batch."""
