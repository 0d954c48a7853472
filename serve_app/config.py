"""The app's arguments: the `args:` block of config/serve.yaml, validated when it is read.

Every rule that ties two keys together is checked here, by the builder, so `serve run` and
`serve deploy` refuse a bad config before any replica starts, naming the keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from profiling.config import ProfileOptions, StrictModel
from serve_app.engines.options import (
    ENGINE_OPTIONS,
    EngineName,
    EngineOptions,
    SglangOptions,
    TransformersOptions,
    VllmOptions,
)
from serve_app.tiny_model import TinyModelSpec

VLLM_MIN_HEAD_DIM = 32
"""vLLM's CPU attention needs head_dim >= 32."""


class AppArgs(StrictModel):
    """Field docstrings are the fields' documentation (docs/configuration.md is generated from them)."""

    engine: EngineName = "transformers"
    """The engine each replica runs: transformers (embedded, on CPU), vllm or sglang."""
    num_replicas: int = Field(2, ge=1)
    """Rollout replicas (Serve replicas of RolloutReplica), each with its own engine."""
    replica_num_cpus: float = Field(0.25, gt=0)
    """Fractional CPUs per replica, so several fit on a small machine."""
    replica_num_gpus: float = Field(0, ge=0)
    """GPUs per replica (vLLM/SGLang on GPU)."""
    replica_env: dict[str, str] = Field(default_factory=dict)
    """Environment variables of the replica processes (e.g. VLLM_CPU_KVCACHE_SPACE)."""
    save_path: str = "/tmp/rollout-profiler/traces"
    """Root of all step traces (step_<k>/ directories and their manifests)."""
    trace_collection: Literal["shared_fs", "ray"] = "shared_fs"
    """shared_fs: replicas write under save_path directly (one filesystem). ray: each replica
    writes under node_dir on its own node and ships its traces through Ray to the ingress's
    node, which holds save_path (nodes that share no filesystem)."""
    node_dir: str = "/tmp/rollout-profiler/node"
    """A directory on every node: traces before shipping (trace_collection: ray) and weights
    received through the Ray object store."""
    max_replicas_per_node: int | None = Field(None, ge=1)
    """Spread replicas over nodes (Serve's max_replicas_per_node); null: no limit."""
    merge_on_complete: bool = True
    """Merge each complete or partial step into merged.trace.json.gz in the background."""
    weights_dir: str = "/tmp/rollout-profiler/weights"
    """/weights/update may only read paths inside this directory."""
    control_token: str | None = None
    """If set, /profile/* and /weights/* need 'Authorization: Bearer <token>'."""
    profiler: ProfileOptions = Field(default_factory=ProfileOptions)
    """The replicas' profiler settings; a /profile/start may override some of them."""
    model_path: str | None = None
    """HF checkpoint directory every replica loads; null builds the tiny Llama locally."""
    tiny_model: TinyModelSpec = Field(default_factory=TinyModelSpec)
    """Shape of the tiny Llama built when model_path is null."""
    model_name: str = "tiny-llama"
    """The served model's name in /v1/models and completions."""
    control_timeout_s: float = Field(30.0, gt=0)
    """Per control call, per replica: a replica that does not answer in time is reported failed."""
    export_timeout_s: float = Field(600.0, gt=0)
    """Longest wait for a replica's trace export before its entry is recorded as lost."""
    max_exporting_steps: int = Field(4, ge=1)
    """Stopped steps whose traces may still be exporting before a new start is refused with 429
    (unexported recordings are held in replica memory)."""
    hold_timeout_s: float = Field(60.0, gt=0)
    """Longest a stop(pause=true) or update(resume=false) holds engine steps without the
    update or start that ends the hold."""
    min_free_disk_mb: float = Field(256.0, ge=0)
    """A start is refused with 507 when save_path has less free space than this."""
    transformers: TransformersOptions = Field(default_factory=TransformersOptions)
    """Settings of engine: transformers (set only with that engine)."""
    vllm: VllmOptions = Field(default_factory=VllmOptions)
    """Settings of engine: vllm (set only with that engine)."""
    sglang: SglangOptions = Field(default_factory=SglangOptions)
    """Settings of engine: sglang (set only with that engine)."""

    @field_validator("save_path", "weights_dir", "node_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        # Replicas run in other working directories: pin relative paths where the app is built.
        return str(Path(v).expanduser().resolve())

    @field_validator("profiler")
    @classmethod
    def _engine_records_it(cls, profiler: ProfileOptions, info: ValidationInfo) -> ProfileOptions:
        if (engine := info.data.get("engine")) is not None:
            ENGINE_OPTIONS[engine].check_profiler(profiler, profiler)
        return profiler

    @field_validator("tiny_model")
    @classmethod
    def _engine_runs_it(cls, spec: TinyModelSpec, info: ValidationInfo) -> TinyModelSpec:
        if info.data.get("engine") == "vllm" and spec.head_dim < VLLM_MIN_HEAD_DIM:
            raise ValueError(
                f"head_dim (hidden_size / num_attention_heads) is {spec.head_dim}; engine 'vllm' needs "
                f">= {VLLM_MIN_HEAD_DIM} (its CPU attention)"
            )
        return spec

    @field_validator("transformers", "vllm", "sglang")
    @classmethod
    def _only_for_its_engine(cls, options: EngineOptions, info: ValidationInfo) -> EngineOptions:
        # Runs only for a block the config sets: a block of another engine would do nothing.
        engine = info.data.get("engine")
        if engine is not None and engine != info.field_name:
            raise ValueError(
                f"settings of engine {info.field_name!r}, but engine is {engine!r}: remove them, "
                f"or set engine: {info.field_name}"
            )
        return options

    @field_validator("sglang")
    @classmethod
    def _one_replica_per_server(cls, options: SglangOptions, info: ValidationInfo) -> SglangOptions:
        replicas = info.data.get("num_replicas")
        if options.url is not None and replicas is not None and replicas != 1:
            raise ValueError(
                f"url names one SGLang server, which serves one replica, but num_replicas is {replicas}: "
                "set num_replicas: 1, or url: null to launch a server per replica"
            )
        return options

    @property
    def engine_options(self) -> EngineOptions:
        """The settings block of the selected engine."""
        options: EngineOptions = getattr(self, self.engine)
        return options
