"""The trainer's config (config/trainer.yaml), verl-style keys, with dotted-path overrides."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BeforeValidator, Field, ValidationError, model_validator

from profiling.config import GlobalProfilerConfig, ProfileOptions, StrictModel, describe_validation_error
from profiling.weight_source import WeightSource, read_old_spelling

MAX_AGENT_TURNS = 16
"""Most turns per agent-loop episode (each turn's prompt holds the whole conversation so far)."""


class TrainerProfileOptions(ProfileOptions):
    """The trainer's `profiler:` section: the window options, and which ranks record (verl's keys)."""

    all_ranks: bool = Field(False, description="Every trainer rank records the profiled steps (ranks is then unused).")
    ranks: list[int] = Field(
        default_factory=lambda: [0],
        description="The trainer ranks that record the profiled steps, each into step_<k>/trainer/rank_<r>/ "
        "(all_ranks: every rank). Each must be below trainer.world_size.",
    )

    @model_validator(mode="after")
    def _ranks_are_ranks(self) -> TrainerProfileOptions:
        if any(r < 0 for r in self.ranks) or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"profiler.ranks {self.ranks} must list distinct ranks, each 0 or more")
        if self.all_ranks and "ranks" in self.model_fields_set:
            raise ValueError(
                f"profiler.all_ranks is true and profiler.ranks is {self.ranks}: all_ranks selects every rank; "
                "remove one of them"
            )
        return self

    def selected(self, world_size: int) -> list[int]:
        """The ranks that record, of `world_size`."""
        return list(range(world_size)) if self.all_ranks else sorted(self.ranks)

    def window_options(self) -> ProfileOptions:
        """The options of one recording (the rank selection left out)."""
        return ProfileOptions.model_validate(self.model_dump(exclude={"all_ranks", "ranks"}))


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
    world_size: int = Field(
        1,
        ge=1,
        description="Trainer processes: 1 trains in this process; more launches that many ranks "
        "(torch.distributed, gloo), the policy sharded with FSDP2; rank 0 drives the app and publishes "
        "(docs/trainer.md#several-ranks).",
    )
    weight_transfer: Annotated[
        Literal[WeightSource.PATH, WeightSource.COLLECTIVE], BeforeValidator(read_old_spelling)
    ] = Field(
        WeightSource.PATH,
        description="How published versions reach the replicas: path (a safetensors file in weights_dir, "
        "its path sent to POST /weights/update; `file`, the old spelling, is read as path), or collective "
        "(rank 0 broadcasts the state dict to the replicas over a process group; the app's weight_transfer "
        "must be collective too).",
    )
    collective_address: str = Field(
        "127.0.0.1",
        description="weight_transfer collective: the publishing rank's address the replicas dial, and the only "
        "interface its store listens on.",
    )
    bucket_mb: float = Field(64.0, gt=0, description="weight_transfer collective: MiB of tensors per broadcast bucket.")
    dist_timeout_s: float = Field(
        120.0,
        gt=0,
        description="world_size > 1: how long a collective between the trainer's ranks may wait for a "
        "rank (a rank that died is seen sooner, when its connections close).",
    )


class RolloutSection(StrictModel):
    url: str | None = Field(
        None,
        description="A running app (its replica listener for RL-scale generation, e.g. http://127.0.0.1:8002, "
        "or Serve's port); null starts one from serve_config.",
    )
    serve_config: str = Field(
        "config/serve.yaml",
        description="Serve config whose first application is started when url is null; its args get "
        "save_path, weights_dir and model_path from this config.",
    )
    control_url: str | None = Field(
        None,
        description="The control listener of the app at url (its control_listener args, e.g. "
        "http://127.0.0.1:8001), where control calls go so they never wait behind generation; null: "
        "they go to url. Unused when the trainer starts the app (it reads that app's).",
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
    profiler: TrainerProfileOptions = Field(
        default_factory=TrainerProfileOptions,
        description="Trainer-side window options and the ranks that record; its tool is global_profiler.tool's.",
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
        self.profiler = self.profiler.model_copy(update={"tool": chosen})
        return self

    @model_validator(mode="after")
    def _ranks_fit_the_world(self) -> TrainerConfig:
        """profiler.ranks name ranks of trainer.world_size; every rank gets part of a mini-batch."""
        world = self.trainer.world_size
        if beyond := [r for r in self.profiler.ranks if r >= world]:
            raise ValueError(
                f"profiler.ranks {self.profiler.ranks} names rank(s) {beyond}, but trainer.world_size is "
                f"{world} (ranks 0..{world - 1}): lower the ranks or raise trainer.world_size"
            )
        if self.trainer.mini_batch_size < world:
            raise ValueError(
                f"trainer.mini_batch_size {self.trainer.mini_batch_size} is below trainer.world_size {world}: "
                "each rank trains on its share of a mini-batch; raise mini_batch_size"
            )
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
