"""The options of `engine: vllm` (read without importing vLLM)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from profiling.config import ProfileOptions
from serve_app.engines.options import Capability, EngineOptions

VLLM_MIN_HEAD_DIM = 32
"""vLLM's CPU attention needs head_dim >= 32."""


class VllmOptions(EngineOptions):
    """`engine: vllm`: how each replica builds its `AsyncLLM`. With `tool: torch` the replica
    profiles inside vLLM's workers with this project's own torch backend (a worker extension),
    so every start may set its own profiler options; `tool: nsys` uses vLLM's CUDA profiler,
    which is chosen when the engine is built."""

    engine = "vllm"
    implementation = "serve_app.engines.vllm.engine:VllmEngine"
    capabilities = frozenset(Capability)
    tools = ("torch", "nsys")

    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "auto"
    """vLLM's `dtype` (auto, float32, bfloat16, float16)."""
    max_model_len: int = Field(256, ge=16)
    """Longest prompt + completion, in tokens."""
    enforce_eager: bool = True
    """No CUDA graphs: faster start, and every engine step shows in the trace."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Share of the GPU's memory vLLM may take (weights + KV cache)."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """More AsyncEngineArgs fields, e.g. tensor_parallel_size, as vLLM names them
    (`worker_extension_cls` is the replica's own; `disable_log_stats` is true unless set here)."""

    @classmethod
    def profiler_problems(cls, options: ProfileOptions, built: ProfileOptions) -> list[str]:
        problems = super().profiler_problems(options, built)
        if not problems and options.tool == "nsys" and built.tool != "nsys":
            problems.append(
                f"vLLM's CUDA profiler (tool 'nsys') is chosen when the engine is built, and this one "
                f"was built for tool {built.tool!r}: set args.profiler.tool: nsys in the app config and redeploy"
            )
        return problems

    @classmethod
    def app_problems(cls, args: dict[str, Any]) -> dict[str, str]:
        spec = args.get("tiny_model")
        if spec is not None and spec.head_dim < VLLM_MIN_HEAD_DIM:
            return {
                "tiny_model": f"head_dim (hidden_size / num_attention_heads) is {spec.head_dim}; engine 'vllm' "
                f"needs >= {VLLM_MIN_HEAD_DIM} (its CPU attention)"
            }
        return {}
