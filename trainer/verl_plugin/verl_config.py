"""What the plugin reads of verl's own config when verl starts its rollout
(docs/frameworks/verl.md#what-the-plugin-honours): the verl settings it cannot honour, refused
by name, and the step schedule it gives the app, from verl's `global_profiler`.

verl runs its rollout profiling as a schedule over parameter versions (`global_profiler.steps`,
`profile_continuous_steps`: step k's rollout is generation on weights k-1) when a tool is set and
the rollout's profiler is enabled for the replica. The app runs the same schedule itself, inside
each weight update (docs/design.md#who-drives), so verl's own start and stop calls are not needed
to key the traces. Pure: reads verl's config objects by attribute, imports no verl.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from profiling.config import GlobalProfilerConfig, describe_validation_error
from serve_app.api import ScheduleSpec
from trainer.verl_plugin.settings import PLUGIN_NAME, PluginConfigError

ROLLOUT = "actor_rollout_ref.rollout"
NAIVE_BACKEND = "naive"
"""verl's checkpoint engine of the synchronous (hybrid-engine) trainer."""


def refusals(rollout: Any, model: Any) -> list[str]:
    """The settings of verl's rollout (`RolloutConfig`) and model (`HFModelConfig`) config that the
    plugin cannot honour, each named with why and the fix (empty: none)."""
    out = []
    if rollout.mode != "async":
        out.append(f"{ROLLOUT}.mode is {rollout.mode!r}: the app is a server; use async")
    if getattr(rollout.disaggregation, "enabled", False):
        out.append(f"{ROLLOUT}.disaggregation.enabled: the app runs no prefill/decode split; set it false")
    if rollout.enable_rollout_routing_replay:
        out.append(f"{ROLLOUT}.enable_rollout_routing_replay: the app reports no routed experts; set it false")
    mtp = getattr(rollout, "mtp", None)
    if mtp is not None and getattr(mtp, "enable", False) and getattr(mtp, "enable_rollout", False):
        out.append(f"{ROLLOUT}.mtp.enable_rollout: the app's engines run no speculative decoding; set it false")
    profiler = rollout.profiler
    tool_config = getattr(profiler, "tool_config", None) or {}
    for tool in ("torch", "npu"):
        block = _get(tool_config, tool)
        for key in ("profile_token_start", "profile_token_end"):
            if _get(block, key) is not None:
                out.append(
                    f"{ROLLOUT}.profiler.tool_config.{tool}.{key} is set: the app records each profiled step "
                    "whole (cap it with the app's profiler.max_forward_steps instead); set it null"
                )
    lora_rank = getattr(model, "lora_rank", 0) or _get(getattr(model, "lora", None), "rank") or 0
    if lora_rank and not _get(getattr(model, "lora", None), "merge"):
        out.append(
            "actor_rollout_ref.model.lora_rank is set without actor_rollout_ref.model.lora.merge: the app "
            "loads full weights; merge LoRA into them (lora.merge: true)"
        )
    return out


def check_backend(rollout: Any, *, hybrid: bool) -> None:
    """The checkpoint engine the plugin needs for the trainer verl runs: its own (`rollout_profiler`)
    where verl syncs a separate rollout (fully-async, separated), verl's `naive` where the trainer
    ranks hold the rollout (the synchronous trainer's hybrid engine). PluginConfigError otherwise."""
    backend = rollout.checkpoint_engine.backend
    wanted = NAIVE_BACKEND if hybrid else PLUGIN_NAME
    if backend != wanted:
        where = "the synchronous trainer's hybrid engine" if hybrid else "a rollout separate from the trainer"
        raise PluginConfigError(
            f"{ROLLOUT}.checkpoint_engine.backend is {backend!r}, but with {where} the plugin publishes through "
            f"{wanted!r}: set {ROLLOUT}.checkpoint_engine.backend={wanted}"
        )


def schedule_of(global_profiler: Mapping[str, Any] | None, rollout: Any, replica_rank: int) -> ScheduleSpec | None:
    """The step schedule verl would profile replica `replica_rank`'s rollout by (None: verl would not
    profile it): `global_profiler`'s steps with a tool set, the rollout profiler enabled, and the
    replica selected by its `all_ranks` / `ranks` (verl's rule: rank r belongs to replica
    r // the replica's world size; no ranks given: replica 0)."""
    try:
        cfg = GlobalProfilerConfig.model_validate(dict(global_profiler or {}))
    except ValidationError as e:
        raise PluginConfigError(describe_validation_error(e, "global_profiler")) from None
    profiler = rollout.profiler
    if not cfg.profiles or profiler is None or not profiler.enable:
        return None
    world_size = rollout.tensor_model_parallel_size * rollout.data_parallel_size * rollout.pipeline_model_parallel_size
    selected = {r // world_size for r in profiler.ranks} if profiler.ranks else {0}
    if not profiler.all_ranks and replica_rank not in selected:
        return None
    assert cfg.steps  # profiles says so
    return ScheduleSpec(steps=cfg.steps, profile_continuous_steps=cfg.profile_continuous_steps)


def _get(block: Any, key: str) -> Any:
    """`block[key]` of a verl config block (a dict, DictConfig or dataclass), None if absent."""
    if block is None:
        return None
    if isinstance(block, Mapping):
        return block.get(key)
    return getattr(block, key, None)
