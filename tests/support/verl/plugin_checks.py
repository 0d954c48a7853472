"""Test support, run in verl's environment after verl's own fully-async run (fully_async_run.py):
the plugin's meanings, checked one by one through verl's own classes against the same app.

* verl's `LLMServerManager` builds the replica from verl's composed config, and verl's
  `FullyAsyncLLMServerClient` (what verl's agent loops call) generates through it with verl's
  sampling parameters: tokens, logprobs, the version that sampled them;
* a sync in the middle of a generation, in verl's order (`abort_all_requests`, the plugin's
  checkpoint engine publishes a new version, here by collective, `resume_generation`): the request
  ends `aborted` with its tokens so far and verl's client sends it again, so the answer spans the
  two versions;
* a request that arrives while the gate is closed waits (verl's meaning: parked, not refused)
  unless the abort said `reject_request`;
* verl settings the plugin cannot honour are refused by name when the replica is built, and a
  schedule that contradicts the one the app runs by is refused.
"""

from __future__ import annotations

import asyncio
import copy
import os
import time
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf, open_dict
from transformers import AutoTokenizer, LlamaForCausalLM

from serve_app.api import ScheduleSpec
from trainer.client import RolloutClient, RolloutError

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
"""What verl's agent loop sends (AgentLoopWorker._run_agent_loop's sampling_params)."""


def verl_config(overrides: list[str]) -> DictConfig:
    """verl's fully-async config composed with `overrides`, as verl's entry point composes it."""
    import verl

    config_dir = os.path.join(os.path.dirname(verl.__file__), "experimental/fully_async_policy/config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(
            config_name="fully_async_ppo_trainer", overrides=[o for o in overrides if not o.startswith("hydra.")]
        )
    # verl's fully_async_main copies these before it builds anything.
    cfg.actor_rollout_ref.rollout.nnodes = cfg.rollout.nnodes
    cfg.actor_rollout_ref.rollout.n_gpus_per_node = cfg.rollout.n_gpus_per_node
    # Room for a generation long enough to be caught by a sync (verl clamps every request to the
    # context left after the prompt).
    cfg.actor_rollout_ref.rollout.max_model_len = 1024
    return cfg


async def run_checks(cfg: DictConfig, app: dict[str, str], model: Path) -> dict[str, Any]:
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerManager

    out: dict[str, Any] = {}
    manager = await LLMServerManager.create(config=cfg)
    client = manager.get_client(FullyAsyncLLMServerClient)
    replica = manager.get_replicas()[0]
    server = replica.server_handle
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = tokenizer("One two three", add_special_tokens=False)["input_ids"]
    async with RolloutClient(app["url"], control_url=app["control_url"]) as http:
        served = (await http.status()).weight_version
        one = await client.generate("plain", prompt_ids=prompt, sampling_params=dict(SAMPLING))
        out["plain"] = _output(one)
        out["served_before"] = served

        # A sync in the middle of a generation, in the order verl's CheckpointEngineManager makes it.
        long = asyncio.ensure_future(
            client.generate(
                "long", prompt_ids=prompt, sampling_params={**SAMPLING, "max_tokens": 400, "ignore_eos": True}
            )
        )
        await _until(lambda: _in_flight(http), "the long request to run")
        await replica.abort_all_requests()
        out["collective_publish"] = await _publish(app, model, served + 1)
        parked = asyncio.ensure_future(client.generate("parked", prompt_ids=prompt, sampling_params=dict(SAMPLING)))
        await asyncio.sleep(1.0)
        out["parked_waited"] = not parked.done()
        await replica.resume_generation()
        out["long"] = _output(await long)
        out["parked"] = _output(await parked)

        # reject_request: a request behind the closed gate is answered `aborted` at once.
        await replica.abort_all_requests(reject_request=True)
        t0 = time.monotonic()
        rejected = await server.generate.remote(
            prompt_ids=prompt, sampling_params=dict(SAMPLING), request_id="rejected"
        )
        out["rejected"] = {**_output(rejected), "seconds": round(time.monotonic() - t0, 3)}
        await replica.resume_generation()

        # A schedule that contradicts the app's.
        try:
            await http.set_schedule(ScheduleSpec(steps=[3, 4]))
            out["other_schedule"] = "taken"
        except RolloutError as e:
            out["other_schedule"] = {"status": e.status, "detail": e.detail}
    out["refusals"] = await refusals(cfg)
    return out


async def refusals(cfg: DictConfig) -> dict[str, str]:
    """What building the replica says for settings the plugin cannot honour, one at a time."""
    from trainer.verl_plugin.replica import AppRolloutReplica
    from trainer.verl_plugin.settings import PluginConfigError

    cases = {
        "profile_token_start": ("actor_rollout_ref.rollout.profiler.tool_config.torch.profile_token_start", 3),
        "routing_replay": ("actor_rollout_ref.rollout.enable_rollout_routing_replay", True),
        "no_url": ("actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rollout_profiler", {}),
    }
    said = {}
    for name, (key, value) in cases.items():
        bad = copy.deepcopy(cfg)
        with open_dict(bad):
            node, leaf = key.rsplit(".", 1)
            OmegaConf.select(bad, node)[leaf] = value
        try:
            AppRolloutReplica(0, bad.actor_rollout_ref.rollout, bad.actor_rollout_ref.model, gpus_per_node=1)
            said[name] = "accepted"
        except PluginConfigError as e:
            said[name] = str(e)
    bad = copy.deepcopy(cfg)
    with open_dict(bad):
        bad.actor_rollout_ref.rollout.checkpoint_engine.backend = "nccl"
    replica = AppRolloutReplica(0, bad.actor_rollout_ref.rollout, bad.actor_rollout_ref.model, gpus_per_node=1)
    try:
        await replica.init_standalone()
        said["backend"] = "accepted"
    except PluginConfigError as e:
        said["backend"] = str(e)
    return said


def _output(output: Any) -> dict[str, Any]:
    return {
        "tokens": len(output.token_ids),
        "log_probs": None if output.log_probs is None else len(output.log_probs),
        "stop_reason": output.stop_reason,
        "extra_fields": {k: v for k, v in output.extra_fields.items() if "steps" in k},
    }


async def _in_flight(http: RolloutClient) -> bool:
    return any((r.requests_in_flight or 0) > 0 for r in (await http.status()).replicas)


async def _until(check: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        await asyncio.sleep(0.05)


async def _publish(app: dict[str, str], model: Path, version: int) -> dict[str, float]:
    """A new version of the model's weights, published by the plugin's checkpoint engine as trainer
    rank 0's runs it, by collective (a broadcast to the replicas; the app's weight_transfer is
    collective); verl's metrics of it."""
    from trainer.verl_plugin.weight_sync import AppCheckpointEngine

    engine = AppCheckpointEngine(
        bucket_size=1 << 20, is_master=True, url=app["url"], control_url=app["control_url"], transfer="collective"
    )
    state = LlamaForCausalLM.from_pretrained(model).state_dict()
    gen = torch.Generator().manual_seed(version)
    perturbed = ((k, (t + 0.05 * torch.randn(t.shape, generator=gen)).contiguous()) for k, t in state.items())
    return await engine.send_weights(perturbed, global_steps=version)
