"""The options of `engine: sglang` (read without importing SGLang)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from profiling.config import NpuOptions, ProfileOptions
from serve_app.engines.options import Capability, EngineOptions


class SglangOptions(EngineOptions):
    """`engine: sglang`: the SGLang server each replica drives over HTTP (its native API:
    /generate, /start_profile, /stop_profile, /update_weights_from_disk, /pause_generation,
    /continue_generation). SGLang writes the traces itself, into the replica's trace directory
    under save_path, so the server must see the replica's filesystem."""

    engine = "sglang"
    implementation = "serve_app.engines.sglang.engine:SglangEngine"
    capabilities = frozenset(Capability) - {Capability.RECEIVE_COLLECTIVE}
    transfer_dialect = "sglang"
    lacks: ClassVar[dict[Capability, str]] = {
        # SGLang loads what update_weights_from_distributed receives at once, so it cannot stage a
        # broadcast until every replica has it (docs/design.md#weights-by-collective).
        Capability.RECEIVE_COLLECTIVE: "SGLang loads a broadcast as it arrives, so a replica that fails "
        "mid-transfer would leave the others on mixed weights; use weight_transfer: path, or move the "
        "weights with SGLang's own update_weights_from_distributed and publish them with source external "
        "(docs/sglang.md#the-trainers-own-transfer)"
    }
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

    @classmethod
    def app_problems(cls, args: dict[str, Any]) -> dict[str, str]:
        options, replicas = args.get("sglang"), args.get("num_replicas")
        if isinstance(options, SglangOptions) and options.url is not None and replicas not in (None, 1):
            return {
                "sglang": f"url names one SGLang server, which serves one replica, but num_replicas is {replicas}: "
                "set num_replicas: 1, or url: null to launch a server per replica"
            }
        return {}
