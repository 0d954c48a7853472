"""The options of `engine: vllm` (read without importing vLLM)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from profiling.config import ProfileOptions
from serve_app.engines.options import Capability, EngineOptions, TransferDialect

VLLM_MIN_HEAD_DIM = 32
"""vLLM's CPU attention needs head_dim >= 32."""
CPU_TRANSFER_BACKEND = "rollout_gloo"
"""The replica's own vLLM weight-transfer backend, over gloo (serve_app/engines/vllm/gloo_transfer.py);
vLLM's own backends (nccl, ipc, ...) need CUDA."""
NO_WEIGHT_TRANSFER_ENGINE = (
    "the replicas' vLLM engines were built without a weight-transfer engine: set "
    "args.vllm.engine_args.weight_transfer_config ({backend: nccl} on GPUs, "
    f"{{backend: {CPU_TRANSFER_BACKEND}}} on CPU) and redeploy"
)
"""Why engine vllm, as configured, has no weight-transfer group to join."""


class VllmOptions(EngineOptions):
    """`engine: vllm`: how each replica builds its `AsyncLLM`. With `tool: torch` the replica
    profiles inside vLLM's workers with this project's own torch backend (a worker extension),
    so every start may set its own profiler options; `tool: nsys` uses vLLM's CUDA profiler,
    which is chosen when the engine is built."""

    engine = "vllm"
    implementation = "serve_app.engines.vllm.engine:VllmEngine"
    capabilities = frozenset(Capability)
    tools = ("torch", "nsys")
    transfer_dialect = "vllm"

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
    (`worker_extension_cls` is the replica's own; `disable_log_stats` is true unless set here).
    `weight_transfer_config: {backend: nccl}` (GPUs) or `{backend: rollout_gloo}` (CPU) gives each
    engine vLLM's weight-transfer engine, which a trainer then drives through the app's
    /init_weight_transfer_engine ... /finish_weight_update (docs/engines.md#vllm-weight-transfer-routes)."""

    @field_validator("engine_args")
    @classmethod
    def _transfer_config_readable(cls, engine_args: dict[str, Any]) -> dict[str, Any]:
        config = engine_args.get("weight_transfer_config")
        if config is not None and not (
            isinstance(config, dict) and isinstance(config.get("backend", "nccl"), str) and set(config) <= {"backend"}
        ):
            raise ValueError(
                f"weight_transfer_config must be {{backend: <name>}} (nccl on GPUs, {CPU_TRANSFER_BACKEND} on CPU), "
                f"not {config!r}"
            )
        return engine_args

    @property
    def transfer_backend(self) -> str | None:
        """vLLM's weight-transfer backend each engine is built with (vLLM's default name: nccl);
        None: the engines have no weight-transfer engine."""
        config = self.engine_args.get("weight_transfer_config")
        return None if config is None else str(config.get("backend", "nccl"))

    def transfer_refusal(self, dialect: TransferDialect) -> str | None:
        refusal = super().transfer_refusal(dialect)
        return NO_WEIGHT_TRANSFER_ENGINE if refusal is None and self.transfer_backend is None else refusal

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
        problems = {}
        spec = args.get("tiny_model")
        if spec is not None and spec.head_dim < VLLM_MIN_HEAD_DIM:
            problems["tiny_model"] = (
                f"head_dim (hidden_size / num_attention_heads) is {spec.head_dim}; engine 'vllm' needs >= "
                f"{VLLM_MIN_HEAD_DIM} (its CPU attention)"
            )
        options = args.get("vllm")
        backend = options.transfer_backend if isinstance(options, VllmOptions) else None
        if backend not in (None, CPU_TRANSFER_BACKEND) and not args.get("replica_num_gpus"):
            problems["vllm"] = (
                f"engine_args.weight_transfer_config: vLLM's {backend} weight-transfer backend needs a CUDA GPU in "
                "every replica (vLLM answers 'Cannot access accelerator device when none is available.'), and "
                f"replica_num_gpus is 0: give each replica a GPU, or use backend {CPU_TRANSFER_BACKEND} on CPU"
            )
        return problems
