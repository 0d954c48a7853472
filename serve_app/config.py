"""The app's arguments: the `args:` block of config/serve.yaml, validated by pydantic."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from profiling.config import ProfileOptions, StrictModel
from serve_app.engines.tiny_model import TinyModelSpec


class AppArgs(StrictModel):
    engine: Literal["transformers"] = "transformers"
    num_replicas: int = Field(2, ge=1)
    replica_num_cpus: float = Field(
        0.25, gt=0, description="Fractional CPUs per replica, so several fit on a small machine."
    )
    save_path: str = Field("/tmp/rollout-profiler/traces", description="Root of all step traces.")
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
    hold_timeout_s: float = Field(
        60.0, gt=0, description="Longest a stop(pause=true) holds engine steps without an update."
    )
    min_free_disk_mb: float = Field(256.0, ge=0)

    @field_validator("save_path", "weights_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        # Replicas run in other working directories: pin relative paths where the app is built.
        return str(Path(v).expanduser().resolve())
