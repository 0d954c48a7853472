"""The trainer's config (config/trainer.yaml), verl-style keys, with dotted-path overrides."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from profiling.config import (
    RAY_NSIGHT_LOG_DIR,
    GlobalProfilerConfig,
    ProfileOptions,
    StrictModel,
    VerlToolConfigs,
    describe_validation_error,
    distinct_ranks,
    relocate_note,
)
from profiling.weight_source import WeightSource, read_old_spelling

MAX_AGENT_TURNS = 16
"""Most turns per agent-loop episode (each turn's prompt holds the whole conversation so far)."""


class TrainerProfileOptions(ProfileOptions):
    """The trainer's `profiler:` section: the window options, which ranks record, and the keys of
    a verl role's `profiler` block (docs/configuration.md#verls-blocks)."""

    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)
    target: str | None = Field(
        None, alias="_target_", description="verl's Hydra instantiation hint; accepted and read by nothing here."
    )
    enable: bool = Field(
        True,
        description="Whether the trainer ranks record the profiled steps (false: only the rollout side "
        "does). verl's role key; its default there is false because every verl role opts in, here "
        "global_profiler's tool and steps are what switch profiling on.",
    )
    all_ranks: bool = Field(False, description="Every trainer rank records the profiled steps (ranks is then unused).")
    ranks: list[int] = Field(
        default_factory=list,
        description="The trainer ranks that record the profiled steps, each into step_<k>/trainer/rank_<r>/; "
        "[]: rank 0 (verl's meaning). Each must be below trainer.world_size.",
    )
    save_path: str | None = Field(
        None,
        description="verl's role key: here the trainer's traces always go under global_profiler.save_path "
        "(another path is accepted with a warning).",
    )
    relocate_results: bool | None = Field(
        None, description="verl's role key, as global_profiler.relocate_results (a no-op); null: that one."
    )
    finish_hook_cmd: str | None = Field(
        None, description="As global_profiler.finish_hook_cmd, for the trainer (set here, it wins)."
    )
    finish_hook_all_ranks: bool | None = Field(
        None, description="As global_profiler.finish_hook_all_ranks (set here, it wins); null: that one."
    )
    finish_hook_ranks: list[int] | None = Field(
        None, description="As global_profiler.finish_hook_ranks (set here, it wins); null: that one."
    )
    tool_config: VerlToolConfigs = Field(
        default_factory=VerlToolConfigs,
        description="verl's per-tool settings of the role; the block of the tool applies on top of "
        "global_profiler.global_tool_config's.",
    )

    @model_validator(mode="before")
    @classmethod
    def _null_tool_is_the_global_one(cls, data: Any) -> Any:
        # verl's role blocks say `tool: ${oc.select:global_profiler.tool,null}`: null is "the global one".
        if isinstance(data, dict) and "tool" in data and data["tool"] is None:
            data = {k: v for k, v in data.items() if k != "tool"}
        return data

    @model_validator(mode="after")
    def _ranks_are_ranks(self) -> TrainerProfileOptions:
        distinct_ranks(self.ranks, "profiler.ranks")
        if self.finish_hook_ranks is not None:
            distinct_ranks(self.finish_hook_ranks, "profiler.finish_hook_ranks")
        if self.all_ranks and self.ranks:
            raise ValueError(
                f"profiler.all_ranks is true and profiler.ranks is {self.ranks}: all_ranks selects every rank; "
                "remove one of them"
            )
        return self

    def selected(self, world_size: int) -> list[int]:
        """The ranks that record, of `world_size`."""
        if not self.enable:
            return []
        return list(range(world_size)) if self.all_ranks else sorted(self.ranks or [0])

    def window_options(self) -> ProfileOptions:
        """The options of one recording (the rank selection and verl's role keys left out)."""
        return ProfileOptions.model_validate(self.model_dump(include=set(ProfileOptions.model_fields)))


class MegatronSection(StrictModel):
    """`trainer.megatron`: the layout of the Megatron backend (docs/trainer.md#megatron)."""

    tensor_parallel_size: int = Field(
        1, ge=1, description="Ranks each layer's weights are split over (megatron's tensor parallelism)."
    )
    pipeline_parallel_size: int = Field(
        1,
        ge=1,
        description="Pipeline stages the layers are split into (megatron's 1F1B schedule); the layers must "
        "divide evenly.",
    )
    micro_batch_size: int = Field(
        1,
        ge=1,
        description="Samples per micro-batch of megatron's schedule; a data-parallel replica's share of a "
        "mini-batch must be a multiple of it.",
    )


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
        description="Trainer processes: 1 trains in this process (backend fsdp); more launches that many ranks "
        "(torch.distributed, gloo), the policy sharded with FSDP2 or laid out by trainer.megatron; rank 0 drives "
        "the app and publishes (docs/trainer.md#several-ranks).",
    )
    backend: Literal["fsdp", "megatron"] = Field(
        "fsdp",
        description="The policy's training backend: fsdp (the Hugging Face Llama, FSDP2-sharded over several "
        "ranks), or megatron (megatron-core's GPTModel in Llama form, tensor- and pipeline-parallel as "
        "trainer.megatron says, data parallel over the rest of world_size; `pip install -e \".[megatron]\"`; "
        "docs/trainer.md#megatron).",
    )
    megatron: MegatronSection = Field(
        default_factory=MegatronSection, description="backend megatron: its parallel layout."
    )
    weight_transfer: Annotated[
        Literal[WeightSource.PATH, WeightSource.OBJECT_STORE, WeightSource.COLLECTIVE],
        BeforeValidator(read_old_spelling),
    ] = Field(
        WeightSource.PATH,
        description="How published versions reach the replicas: path (a safetensors file in weights_dir, "
        "its path sent to POST /weights/update; `file`, the old spelling, is read as path), object_store "
        "(rank 0 joins the local app's Ray cluster and puts the state dict in its object store; needs "
        "rollout.url unset), or collective (rank 0 broadcasts the state dict to the replicas over a process "
        "group; the app's weight_transfer must be collective too).",
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


    @property
    def launches_ranks(self) -> bool:
        """Whether the job trains in rank processes of a process group (trainer/launch.py): with
        several ranks, and always with Megatron, whose parallel groups are made from one."""
        return self.world_size > 1 or self.backend == "megatron"


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
    def _object_store_in_the_apps_cluster(self) -> TrainerConfig:
        """The object store is reached from inside the app's Ray cluster: the local app's."""
        if self.trainer.weight_transfer == WeightSource.OBJECT_STORE and self.rollout.url is not None:
            raise ValueError(
                f"trainer.weight_transfer object_store needs the trainer in the app's Ray cluster, but rollout.url "
                f"is set ({self.rollout.url}): the main job joins only the cluster of the app it starts; unset "
                "rollout.url, or use path or collective (a trainer of your own in the app's cluster publishes "
                "with InClusterPublisher: docs/trainer.md#weight-transfer-modes)"
            )
        return self

    @model_validator(mode="after")
    def _ranks_fit_the_world(self) -> TrainerConfig:
        """profiler.ranks and the finish hook's ranks name ranks of trainer.world_size; every rank
        gets part of a mini-batch."""
        world = self.trainer.world_size
        hook_key = "profiler" if self.profiler.finish_hook_ranks is not None else "global_profiler"
        checked = (("profiler.ranks", self.profiler.ranks), (f"{hook_key}.finish_hook_ranks", self._hook_ranks()))
        for key, ranks in checked:
            if beyond := [r for r in ranks if r >= world]:
                raise ValueError(
                    f"{key} {ranks} names rank(s) {beyond}, but trainer.world_size is "
                    f"{world} (ranks 0..{world - 1}): lower the ranks or raise trainer.world_size"
                )
        if self.trainer.backend == "megatron":
            self._megatron_layout_fits()
        elif self.trainer.mini_batch_size < world:
            raise ValueError(
                f"trainer.mini_batch_size {self.trainer.mini_batch_size} is below trainer.world_size {world}: "
                "each rank trains on its share of a mini-batch; raise mini_batch_size"
            )
        return self

    def _megatron_layout_fits(self) -> None:
        t, m = self.trainer, self.trainer.megatron
        model_parallel = m.tensor_parallel_size * m.pipeline_parallel_size
        if t.world_size % model_parallel:
            raise ValueError(
                f"trainer.world_size {t.world_size} is not a multiple of trainer.megatron.tensor_parallel_size "
                f"{m.tensor_parallel_size} x pipeline_parallel_size {m.pipeline_parallel_size} = {model_parallel}: "
                "data parallel takes the rest of the ranks; make world_size a multiple of it"
            )
        replicas = t.world_size // model_parallel
        if t.mini_batch_size % (replicas * m.micro_batch_size):
            raise ValueError(
                f"trainer.mini_batch_size {t.mini_batch_size} does not split into {replicas} data-parallel "
                f"share(s) of whole micro-batches of trainer.megatron.micro_batch_size {m.micro_batch_size}: "
                f"make it a multiple of {replicas * m.micro_batch_size}"
            )

    def _hook_ranks(self) -> list[int]:
        p, g = self.profiler, self.global_profiler
        return p.finish_hook_ranks if p.finish_hook_ranks is not None else g.finish_hook_ranks

    def window_options(self) -> ProfileOptions:
        """The options of one trainer recording: the `profiler` keys, then the selected tool's block
        of global_profiler.global_tool_config, then the role's own `profiler.tool_config` block."""
        tool = self.global_profiler.tool
        options = self.profiler.window_options()
        options = self.global_profiler.global_tool_config.apply(tool, options)
        return self.profiler.tool_config.apply(tool, options)

    def finish_hook(self) -> FinishHook | None:
        """The finish hook (`finish_hook_cmd` and the ranks it runs for, verl's selection), or None."""
        p, g = self.profiler, self.global_profiler
        cmd = p.finish_hook_cmd if "finish_hook_cmd" in p.model_fields_set else g.finish_hook_cmd
        if not cmd or not g.profiles:
            return None
        world = self.trainer.world_size
        all_ranks = p.finish_hook_all_ranks if p.finish_hook_all_ranks is not None else g.finish_hook_all_ranks
        # verl: every rank, the listed ones, else the profiled ranks.
        ranks = list(range(world)) if all_ranks else sorted(self._hook_ranks()) or p.selected(world)
        return FinishHook(cmd=cmd, ranks=ranks, tool=str(g.tool), save_path=g.save_path)

    def notes(self) -> list[str]:
        """One warning per key that is accepted but has no effect here (verl's keys this project
        does not implement, and steps without a tool), to be logged once by the job."""
        g, p = self.global_profiler, self.profiler
        out = g.notes()
        if self.trainer.backend != "megatron" and "megatron" in self.trainer.model_fields_set:
            out.append(
                f"trainer.megatron is set but trainer.backend is {self.trainer.backend!r}: the layout has no "
                "effect; set trainer.backend=megatron or remove trainer.megatron"
            )
        if not g.profiles:
            return out
        out += p.tool_config.notes(g.tool, "profiler.tool_config")
        out += relocate_note(p.relocate_results, "profiler")
        if p.save_path is not None and Path(p.save_path).resolve() != Path(g.save_path).resolve():
            out.append(
                f"profiler.save_path is {p.save_path!r}, which is not implemented here: the trainer's traces go "
                f"under global_profiler.save_path ({g.save_path!r}), beside the rollout's; the key has no effect"
            )
        if (selected := self.finish_hook()) is not None and not selected.ranks:
            out.append(
                "finish_hook_cmd is set but selects no trainer rank (profiler.enable is false and neither "
                "finish_hook_ranks nor finish_hook_all_ranks is set): it does not run; set finish_hook_ranks"
            )
        return out


class FinishHook(BaseModel):
    """What runs after the last profiled step (trainer/finish_hook.py)."""

    cmd: str
    ranks: list[int]
    """The trainer ranks it runs for, once each (VERL_PROFILE_RANK)."""
    tool: str
    save_path: str
    role: str = "trainer"
    ray_nsight_dir: str = RAY_NSIGHT_LOG_DIR


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
    """The config of the file at `path` (None: the defaults) with `overrides` applied, verl's
    `${oc.select:...}` references resolved, validated; ConfigError names what is wrong."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise ConfigError(f"cannot read config {path}: {e.strerror}") from e
    for o in overrides:
        apply_override(data, o)
    data = resolve_interpolations(data)
    try:
        return TrainerConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"invalid config: {describe_validation_error(e)}") from None


_REFERENCE = re.compile(r"\$\{(.*)\}", re.DOTALL)
_KEY_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_MISSING = object()


def resolve_interpolations(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with verl's OmegaConf references resolved against it: a value that is all of
    `${oc.select:key.path,default}` (default: null when left out; it may be a reference itself) or
    `${key.path}`, as verl's role blocks write them (`tool: ${oc.select:global_profiler.tool,null}`).
    A key the config does not set gives the default (OmegaConf's oc.select), so a role block
    pasted alone reads verl's defaults. Any other `${...}` is a ConfigError naming the key."""

    def walk(node: Any, where: str) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, f"{where}.{k}" if where else str(k)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(node)]
        if isinstance(node, str) and "${" in node:
            return reference(node, where, depth=0)
        return node

    def lookup(path: str) -> Any:
        node: Any = data
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return _MISSING
            node = node[part]
        return node

    def reference(text: str, where: str, depth: int) -> Any:
        m = _REFERENCE.fullmatch(text.strip())
        body = m.group(1).strip() if m else ""
        select = body.startswith("oc.select:")
        key, sep, default = _split_default(body[len("oc.select:") :]) if select else (body, "", "")
        if depth > 16 or not _KEY_PATH.fullmatch(key.strip()):
            raise ConfigError(
                f"'{where}': {text!r} is an OmegaConf interpolation this loader does not resolve (it reads "
                "`${oc.select:key.path,default}` and `${key.path}` only): write the value"
            )
        found = lookup(key.strip())
        if found is _MISSING:
            if not select:
                raise ConfigError(f"'{where}': {text!r} refers to {key.strip()!r}, which this config does not set")
            if not sep:
                return None
            default = default.strip()
            return reference(default, where, depth + 1) if "${" in default else yaml.safe_load(default)
        return reference(found, where, depth + 1) if isinstance(found, str) and "${" in found else found

    resolved: dict[str, Any] = walk(data, "")
    return resolved


def _split_default(args: str) -> tuple[str, str, str]:
    """`key,default` split at the first comma outside a nested `${...}` (partition's result)."""
    depth = 0
    for i, ch in enumerate(args):
        if args.startswith("${", i):
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "," and depth == 0:
            return args[:i], ",", args[i + 1 :]
    return args, "", ""
