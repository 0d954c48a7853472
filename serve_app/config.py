"""The app's arguments: the `args:` block of config/serve.yaml, validated by pydantic."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from profiling.config import ProfileOptions, StrictModel
from serve_app.engines.tiny_model import TinyModelSpec


class VllmOptions(StrictModel):
    """`engine: vllm`: how each replica builds its `AsyncLLM` and vLLM's own profiler.

    The profiler defaults keep stop short (stop is on the weight-sync critical path): vLLM's
    own defaults (stack capture, gzip, the key_averages table) make its inline trace flush
    many times longer. We compress the moved trace ourselves, off the critical path.
    """

    dtype: str = "auto"
    max_model_len: int = Field(256, ge=16)
    enforce_eager: bool = True
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    profiler_with_stack: bool = False
    profiler_use_gzip: bool = False
    profiler_dump_time_table: bool = Field(
        False, description="vLLM's torch_profiler_dump_cuda_time_total (a *.profiler_out.txt table)."
    )
    profile_frontend: bool = Field(
        False, description="Also trace the AsyncLLM frontend (vLLM's ignore_frontend=false)."
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="More AsyncEngineArgs fields, e.g. tensor_parallel_size, as vLLM names them.",
    )


class SglangOptions(StrictModel):
    """`engine: sglang`: the SGLang server each replica drives over HTTP (its native API:
    /generate, /start_profile, /stop_profile, /update_weights_from_disk, /pause_generation,
    /continue_generation). SGLang writes the traces itself, into the replica's trace directory
    under save_path, so the server must see the replica's filesystem."""

    url: str | None = Field(
        None,
        description="An SGLang server already running for this replica, on the same filesystem; "
        "null launches one per replica. A server serves one replica: with a url, use num_replicas: 1.",
    )
    server_command: list[str] = Field(
        default_factory=lambda: ["python", "-m", "sglang.launch_server"],
        min_length=1,
        description="How a replica launches its server; it adds --model-path, --host 127.0.0.1, --port.",
    )
    server_args: list[str] = Field(
        default_factory=list, description="Extra server arguments, e.g. ['--tp-size', '2']."
    )
    startup_timeout_s: float = Field(
        600.0, gt=0, description="Longest wait for GET /health to answer 200 after launch."
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Per HTTP call to the server (generation, profiler, weight load)."
    )


class AppArgs(StrictModel):
    engine: Literal["transformers", "vllm", "sglang"] = "transformers"
    num_replicas: int = Field(2, ge=1)
    replica_num_cpus: float = Field(
        0.25, gt=0, description="Fractional CPUs per replica, so several fit on a small machine."
    )
    replica_num_gpus: float = Field(0, ge=0, description="GPUs per replica (vLLM/SGLang on GPU).")
    replica_env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables of the replica processes (e.g. VLLM_CPU_KVCACHE_SPACE).",
    )
    save_path: str = Field("/tmp/rollout-profiler/traces", description="Root of all step traces.")
    trace_collection: Literal["shared_fs", "ray"] = Field(
        "shared_fs",
        description="shared_fs: replicas write under save_path directly (one filesystem). ray: each "
        "replica writes under node_dir on its own node and ships its traces through Ray to the "
        "ingress's node, which holds save_path (nodes that share no filesystem).",
    )
    node_dir: str = Field(
        "/tmp/rollout-profiler/node",
        description="A directory on every node: traces before shipping (trace_collection: ray) and "
        "weights received through the Ray object store.",
    )
    max_replicas_per_node: int | None = Field(
        None, ge=1, description="Spread replicas over nodes (Serve's max_replicas_per_node)."
    )
    merge_on_complete: bool = Field(
        True, description="Merge each complete/partial step into merged.trace.json.gz in the background."
    )
    weights_dir: str = Field(
        "/tmp/rollout-profiler/weights",
        description="/weights/update may only read paths inside this directory.",
    )
    control_token: str | None = Field(
        None, description="If set, /profile/* and /weights/* need 'Authorization: Bearer <token>'."
    )
    profiler: ProfileOptions = Field(default_factory=ProfileOptions)
    model_path: str | None = Field(
        None, description="HF checkpoint directory; null builds the tiny Llama locally."
    )
    tiny_model: TinyModelSpec = Field(default_factory=TinyModelSpec)
    model_name: str = "tiny-llama"
    max_batch_size: int = Field(16, ge=1)
    control_timeout_s: float = Field(30.0, gt=0, description="Per control call, per replica.")
    export_timeout_s: float = Field(600.0, gt=0, description="Wait for a replica's trace export.")
    max_exporting_steps: int = Field(
        4,
        ge=1,
        description="Stopped steps whose traces may still be exporting before a new start is "
        "refused with 429 (unexported recordings are held in replica memory).",
    )
    hold_timeout_s: float = Field(
        60.0, gt=0, description="Longest a stop(pause=true) holds engine steps without an update."
    )
    min_free_disk_mb: float = Field(256.0, ge=0)
    vllm: VllmOptions = Field(default_factory=VllmOptions)
    sglang: SglangOptions = Field(default_factory=SglangOptions)

    @field_validator("save_path", "weights_dir", "node_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        # Replicas run in other working directories: pin relative paths where the app is built.
        return str(Path(v).expanduser().resolve())
