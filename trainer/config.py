"""The trainer's config (config/trainer.yaml), verl-style keys, with dotted-path overrides."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from profiling.config import GlobalProfilerConfig, ProfileOptions, StrictModel, describe_validation_error

MAX_AGENT_TURNS = 16
"""Most turns per agent-loop episode (each turn's prompt holds the whole conversation so far)."""


class TrainerSection(StrictModel):
    total_versions: int = Field(30, ge=1, description="Weight versions to publish.")
    trigger_parameter_sync_step: int = Field(2, ge=1, description="Mini-batches per version.")
    mini_batch_size: int = Field(
        16,
        ge=2,
        description="Samples per optimizer step (dropped stale samples do not count); at least 2: "
        "advantages are normalised within the mini-batch.",
    )
    lr: float = Field(0.01, gt=0, description="Adam learning rate of the policy.")
    seed: int = Field(0, description="Seed of torch's RNG in the trainer process, set before the policy loads.")
    clip_ratio: float = Field(0.2, gt=0, description="PPO-style ratio clip for stale samples.")
    reward_text: str = Field(" the", description="Reward: share of completion tokens equal to this token.")
    model_path: str | None = Field(None, description="Initial HF checkpoint; null: the app's tiny Llama.")
    weights_dir: str = Field("outputs/weights", description="Where published versions are written.")
    keep_versions: int = Field(3, ge=1, description="Published weight files kept on disk.")


class RolloutSection(StrictModel):
    url: str | None = Field(None, description="A running app; null starts one from serve_config.")
    serve_config: str = Field(
        "config/serve.yaml",
        description="Serve config whose first application is started when url is null; its args get "
        "save_path, weights_dir and model_path from this config.",
    )
    control_token: str | None = Field(
        None,
        description="The token of the app at url (its control_token_env or control_token_file), sent "
        "as a Bearer token; unused when the trainer starts the app (it reads that app's).",
    )
    max_staleness: int = Field(2, ge=0, description="Drop samples older than this many versions.")
    max_tokens: int = Field(16, ge=1, description="Completion tokens generated per prompt (the requests' max_tokens).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the completion requests.")
    concurrency: int = Field(
        4, ge=1, description="Producers running at once: completion requests in flight, or agent-loop episodes."
    )
    prompts_per_request: int = Field(
        4,
        ge=1,
        description="Prompts per /v1/completions request; each completion is one training sample "
        "(mode completions only).",
    )
    mode: Literal["completions", "agent_loop"] = Field(
        "completions",
        description="How producers sample: completions (one /v1/completions request per batch of prompts, "
        "one sample per completion), or agent_loop (multi-turn chat episodes through "
        "/v1/chat/completions, one sample per turn: docs/trainer.md#the-agent-loop).",
    )
    agent_turns: int = Field(
        3,
        ge=1,
        le=MAX_AGENT_TURNS,
        description="agent_loop: assistant turns per episode; a scripted environment reply follows each "
        "turn but the last.",
    )
    agent_episodes_path: str | None = Field(
        None,
        description="agent_loop: append every finished episode (its messages, and per turn the prompt and "
        "answer token ids, logprobs and weight-version spans) to this file as one JSON line; null: not "
        "recorded.",
    )

    @model_validator(mode="after")
    def _agent_keys_need_agent_mode(self) -> RolloutSection:
        """An episodes file that would stay empty is a mistake worth naming."""
        if self.agent_episodes_path is not None and self.mode != "agent_loop":
            raise ValueError(
                f"agent_episodes_path is set but mode is {self.mode!r}: episodes are only recorded "
                "with mode agent_loop; set rollout.mode=agent_loop or remove agent_episodes_path"
            )
        return self


class TrainerConfig(StrictModel):
    global_profiler: GlobalProfilerConfig = Field(
        default_factory=GlobalProfilerConfig,
        description="verl's global_profiler: the profiled steps (trainer and rollout side), the "
        "trainer-side tool, and the traces' root.",
    )
    profiler: ProfileOptions = Field(
        default_factory=ProfileOptions,
        description="Trainer-side window options; its tool is global_profiler.tool's.",
    )
    trainer: TrainerSection = Field(
        default_factory=TrainerSection,
        description="The training loop: versions to publish, mini-batches, optimizer, published weights.",
    )
    rollout: RolloutSection = Field(
        default_factory=RolloutSection, description="The rollout app the trainer samples from, and how it samples."
    )
    profile_export_timeout_s: float = Field(
        600.0, gt=0, description="At the end, how long to wait for profiled steps' traces."
    )

    @model_validator(mode="after")
    def _one_trainer_tool(self) -> TrainerConfig:
        """global_profiler.tool (verl's key) selects the trainer-side profiler; profiler.tool
        may repeat it but not contradict it."""
        chosen = self.global_profiler.tool
        if chosen is None:
            return self
        if "tool" in self.profiler.model_fields_set and self.profiler.tool != chosen:
            raise ValueError(
                f"global_profiler.tool is {chosen!r} but profiler.tool is {self.profiler.tool!r}: the trainer "
                "records with one tool; remove profiler.tool or make them agree"
            )
        self.profiler = self.profiler.merged(tool=chosen)
        return self


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key."""


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply `a.b.c=value` (value parsed as YAML: 6, [1,2,5], null, true) to nested `data`."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r} is not of the form key.path=value")
    parts = key.strip().split(".")
    node = data
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: '{p}' is not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {override!r}: value is not valid YAML ({e})") from e


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainerConfig:
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise ConfigError(f"cannot read config {path}: {e.strerror}") from e
    for o in overrides:
        apply_override(data, o)
    try:
        return TrainerConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"invalid config: {describe_validation_error(e)}") from None
