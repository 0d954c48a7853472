"""Each engine's own settings (`args.transformers`, `args.vllm`, `args.sglang`) and the profiler
options it can record: one class per engine holds every rule about that engine's options. The
rules run when the app config is read (so `serve run` refuses a bad config before any replica
starts) and again on the options of each `/profile/start` (a 422 naming the option).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from profiling.config import NpuOptions, ProfileOptions, StrictModel, Tool

EngineName = Literal["transformers", "vllm", "sglang"]


class EngineOptions(StrictModel):
    """Base of the engine blocks. Field docstrings are the fields' documentation."""

    engine: ClassVar[EngineName]
    implementation: ClassVar[str]
    """`module:Class` of the engine, imported only when a replica builds it (an engine's module
    imports its engine's packages)."""
    tools: ClassVar[tuple[Tool, ...]]
    """The profiler tools this engine can record with."""
    unsupported_sampling: ClassVar[dict[str, str]] = {}
    """Generation request fields this engine cannot honour, each with why: a request that sets
    one is refused (422 naming the field and the engine), never served with it dropped."""

    @classmethod
    def profiler_problems(cls, options: ProfileOptions, built: ProfileOptions) -> list[str]:
        """Why this engine cannot record with `options` (empty: it can). `built`: the app's
        `profiler` settings, which the engine was built with."""
        if options.tool not in cls.tools:
            return [f"tool {options.tool!r} is not available with engine {cls.engine!r} (it records with {', '.join(cls.tools)})"]
        return []

    @classmethod
    def check_profiler(cls, options: ProfileOptions, built: ProfileOptions) -> None:
        """ValueError naming every problem of `profiler_problems`."""
        if problems := cls.profiler_problems(options, built):
            raise ValueError("; ".join(problems))


class TransformersOptions(EngineOptions):
    """`engine: transformers`, the embedded engine: HF transformers + torch in the replica's
    process, batched generation on one model thread, profiled in process."""

    engine = "transformers"
    implementation = "serve_app.engines.transformers_engine:TransformersEngine"
    tools = ("torch", "npu", "nsys")

    max_batch_size: int = Field(16, ge=1)
    """Sequences decoded together in one forward pass; more wait for the next batch."""


class VllmOptions(EngineOptions):
    """`engine: vllm`: how each replica builds its `AsyncLLM`. With `tool: torch` the replica
    profiles inside vLLM's workers with this project's own torch backend (a worker extension),
    so every start may set its own profiler options; `tool: nsys` uses vLLM's CUDA profiler,
    which is chosen when the engine is built."""

    engine = "vllm"
    implementation = "serve_app.engines.vllm_engine:VllmEngine"
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
    (`worker_extension_cls` is the replica's own)."""

    @classmethod
    def profiler_problems(cls, options: ProfileOptions, built: ProfileOptions) -> list[str]:
        problems = super().profiler_problems(options, built)
        if not problems and options.tool == "nsys" and built.tool != "nsys":
            problems.append(
                f"vLLM's CUDA profiler (tool 'nsys') is chosen when the engine is built, and this one "
                f"was built for tool {built.tool!r}: set args.profiler.tool: nsys in the app config and redeploy"
            )
        return problems


class SglangOptions(EngineOptions):
    """`engine: sglang`: the SGLang server each replica drives over HTTP (its native API:
    /generate, /start_profile, /stop_profile, /update_weights_from_disk, /pause_generation,
    /continue_generation). SGLang writes the traces itself, into the replica's trace directory
    under save_path, so the server must see the replica's filesystem."""

    engine = "sglang"
    implementation = "serve_app.engines.sglang_engine:SglangEngine"
    tools = ("torch", "nsys", "npu")

    url: str | None = None
    """An SGLang server already running for this replica, on the same filesystem; null launches
    one per replica. A server serves one replica: with a url, num_replicas must be 1."""
    server_command: list[str] = Field(default_factory=lambda: ["python", "-m", "sglang.launch_server"], min_length=1)
    """How a replica launches its server; it adds --model-path, --host 127.0.0.1, --port."""
    server_args: list[str] = Field(default_factory=list)
    """Extra server arguments, e.g. ['--tp-size', '2']."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """Longest wait for GET /health to answer 200 after launch."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Per HTTP call to the server (generation, profiler, weight load)."""

    @classmethod
    def profiler_problems(cls, options: ProfileOptions, built: ProfileOptions) -> list[str]:
        problems = super().profiler_problems(options, built)
        if options.with_memory:
            problems.append(
                "with_memory is not available with engine 'sglang': SGLang's MEM activity writes a CUDA "
                "memory snapshot whose file name does not carry the profile prefix; set with_memory: false"
            )
        if options.tool == "npu" and options.npu != NpuOptions():
            problems.append(
                "with engine 'sglang', SGLang configures torch_npu's profiler itself (Level1, "
                "PipeUtilization AI-core metrics, text export): profiler.npu settings cannot be "
                "applied; remove them"
            )
        return problems


ENGINE_OPTIONS: dict[str, type[EngineOptions]] = {
    cls.engine: cls for cls in (TransformersOptions, VllmOptions, SglangOptions)
}
"""Each engine's options class, by the `engine:` value that selects it."""
