"""Test support, run in verl's environment: verl 0.9.1's own trainers, end to end on CPU, their
rollout served by the app through this project's verl plugin (tests/integration/test_verl_plugin.py;
docs/frameworks/verl.md).

It starts a private Ray cluster (with logical GPUs for verl's resource pools) and writes a tiny
dataset; then for each trainer asked for it deploys a fresh app on the cluster and runs verl's own
entry point, unmodified, as a verl user does:

    python -m verl.experimental.fully_async_policy.fully_async_main <overrides>   # fully_async
    python -m verl.trainer.main_ppo <overrides>                                   # sync

in a process that joins the cluster (RAY_ADDRESS). verl's trainer workers run FSDP2 on the CPU
through a test platform registered in verl's platform registry (cpu_platform.py). The overrides
are a verl user's: the plugin's lines, the profiled steps, and a tiny CPU-sized run. When verl
exits it waits for the app's steps to settle and, where asked, checks the plugin's meanings one by
one against the same app (plugin_checks.py). Its last line is a JSON summary per trainer: verl's
exit code and log, the app's status and step manifests, where the traces are, the checks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
from support.verl.plugin_checks import run_checks, verl_config

from serve_app.net import free_port
from serve_app.tiny_model import ensure_tiny_model
from trainer.client import SyncRolloutClient
from trainer.local_app import local_cluster, run_app

HERE = Path(__file__).resolve().parent
TESTS = HERE.parents[1]
CPU_PLATFORM_ENV = {
    # verl imports these modules in every process that imports verl: the CPU platform registers
    # itself there (cpu_platform.py says why each variable).
    "PYTHONPATH": str(TESTS),
    "VERL_USE_EXTERNAL_MODULES": "support.verl.cpu_platform",
    "VERL_PLATFORM": "cpu_test",
    "VERL_ENGINE_DEVICE": "cuda",
    "VERL_CPU_TEST_PREINIT_GLOO": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
PROMPTS = 32
MINI_BATCH = 4
"""Prompts per parameter version (ppo_mini_batch_size x require_batches, trigger_parameter_sync_step 1)."""


def write_dataset(path: Path) -> None:
    """verl's RLHF dataset layout: chat prompts, a data source, the reward's ground truth."""
    rows = [
        {
            "data_source": "rollout_profiler_test",
            "prompt": [{"role": "user", "content": f"Count from {i} to {i + 3}."}],
            "ability": "count",
            "reward_model": {"style": "rule", "ground_truth": str(i + 3)},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(PROMPTS)
    ]
    pd.DataFrame(rows).to_parquet(path)


TRAINERS = {
    "fully_async": "verl.experimental.fully_async_policy.fully_async_main",
    "sync": "verl.trainer.main_ppo",
}
"""verl's entry points: its fully-async trainer, and its synchronous (AgentLoop, hybrid-engine) one."""


def overrides(
    args: argparse.Namespace, trainer: str, transfer: str, model: Path, data: Path, app: dict[str, str]
) -> list[str]:
    plugin = "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rollout_profiler"
    return [
        # The plugin (docs/frameworks/verl.md#settings).
        "actor_rollout_ref.rollout.name=rollout_profiler",
        *_trainer_overrides(args, trainer),
        f"{plugin}.url={app['url']}",
        f"{plugin}.control_url={app['control_url']}",
        f"{plugin}.transfer={transfer}",
        *([f"{plugin}.weights_dir={app['weights_dir']}"] if transfer == "path" else []),
        # What verl profiles: its own keys (the app's save_path takes the trainer's traces too).
        "global_profiler.tool=torch",
        f"global_profiler.steps={json.dumps(args.steps)}",
        f"global_profiler.save_path={app['save_path']}",
        "actor_rollout_ref.actor.profiler.enable=true",
        "actor_rollout_ref.actor.profiler.tool_config.torch.contents=[cpu]",
        # One rollout replica for the app (it balances over its own replicas).
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        # A tiny run on a CPU: the test platform, FSDP2 on gloo, sdpa attention, fp32.
        f"actor_rollout_ref.model.path={model}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.fsdp_config.strategy=fsdp2",
        "actor_rollout_ref.actor.fsdp_config.param_offload=false",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        "actor_rollout_ref.actor.use_torch_compile=false",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI_BATCH}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_dynamic_bsz=false",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        f"data.train_files={data}",
        f"data.val_files={data}",
        "data.max_prompt_length=32",
        "data.max_response_length=8",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        "critic.enable=false",
        "reward.reward_model.enable=false",
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={HERE / 'reward.py'}",
        "trainer.device=cpu",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        "trainer.logger=[console]",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.total_epochs=1",
        "trainer.project_name=rollout_profiler_test",
        "trainer.experiment_name=fully_async_cpu",
        f"trainer.default_local_dir={args.work / trainer / 'checkpoints'}",
        f"hydra.run.dir={args.work / trainer / 'hydra'}",
    ]


def _trainer_overrides(args: argparse.Namespace, trainer: str) -> list[str]:
    if trainer == "sync":
        # The synchronous trainer's ranks hold the rollout (hybrid engine): verl's naive backend.
        return [f"data.train_batch_size={MINI_BATCH}", f"trainer.total_training_steps={args.versions}"]
    return [
        "actor_rollout_ref.rollout.checkpoint_engine.backend=rollout_profiler",
        "actor_rollout_ref.hybrid_engine=false",
        "rollout.nnodes=1",
        "rollout.n_gpus_per_node=1",
        f"rollout.total_rollout_steps={MINI_BATCH * (args.versions + 1)}",
        "async_training.trigger_parameter_sync_step=1",
        "async_training.require_batches=1",
        "data.train_batch_size=0",
        "data.gen_batch_size=1",
    ]


def settled(app: SyncRolloutClient, steps: list[int], timeout_s: float) -> dict[int, dict[str, Any]]:
    """Each step's manifest once no step is recording or exporting (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        manifests = {k: app.step(k).model_dump(mode="json") for k in steps if k in _recorded(app)}
        if all(m["status"] in ("complete", "partial") for m in manifests.values()) and len(manifests) == len(steps):
            return manifests
        if time.monotonic() > deadline:
            return manifests
        time.sleep(1)


def _recorded(app: SyncRolloutClient) -> set[int]:
    return {s.step for s in app.steps().steps}


def run_trainer(
    args: argparse.Namespace, trainer: str, transfer: str, model: Path, data: Path, port: int
) -> dict[str, Any]:
    """A fresh app on the cluster, then verl's `trainer` against it, publishing by `transfer`; the
    app's record of it."""
    import ray
    from ray import serve

    work = args.work / trainer
    save, weights = work / "profile", work / "weights"
    weights.mkdir(parents=True, exist_ok=True)
    replica_port, control_port = free_port(), free_port()
    app_args = {
        "model_path": str(model),
        "save_path": str(save),
        "weights_dir": str(weights),
        "num_replicas": 2,
        "replica_num_cpus": 0.25,
        "replica_listener": {"host": "127.0.0.1", "port": replica_port},
        "control_listener": {"host": "127.0.0.1", "port": control_port},
        # Path and the object store always work; collective too with this (the checks use it).
        "weight_transfer": "collective",
        "profiler": {"max_forward_steps": 100_000, "max_duration_s": 600},
    }
    run_app(port, "rollout", app_args)
    app = {
        "url": f"http://127.0.0.1:{replica_port}",
        "control_url": f"http://127.0.0.1:{control_port}",
        "save_path": str(save),
        "weights_dir": str(weights),
    }
    config = overrides(args, trainer, transfer, model, data, app)
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    cmd = [sys.executable, "-m", TRAINERS[trainer], *config]
    began = time.monotonic()
    with open(work / "verl.log", "wb") as log:
        done = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout, check=False)
    out: dict[str, Any] = {
        "save_path": str(save),
        "transfer": transfer,
        "weight_files": sorted(p.name for p in weights.iterdir()),
        "verl_rc": done.returncode,
        "verl_s": round(time.monotonic() - began, 1),
        "verl_log": str(work / "verl.log"),
    }
    with SyncRolloutClient(app["url"], control_url=app["control_url"]) as client:
        out["manifests"] = settled(client, args.steps, timeout_s=120)
        out["status"] = client.status().model_dump(mode="json")
    if done.returncode == 0 and trainer in args.checks:
        out["checks"] = asyncio.run(run_checks(verl_config(config), app, model))
    serve.delete("rollout")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument(
        "--trainers",
        nargs="+",
        default=["fully_async:path"],
        help="TRAINER:TRANSFER, each run against a fresh app (trainers: "
        f"{', '.join(sorted(TRAINERS))}; transfers: path, object_store, collective)",
    )
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 2, 5])
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument(
        "--checks",
        nargs="*",
        choices=sorted(TRAINERS),
        default=[],
        help="after these trainers' runs, check the plugin's meanings one by one against the same app",
    )
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.update(CPU_PLATFORM_ENV)
    model = ensure_tiny_model(cache_dir=args.work / "model")
    data = args.work / "train.parquet"
    write_dataset(data)
    with local_cluster(num_cpus=64, num_gpus=2) as port:
        runs = {}
        for spec in args.trainers:
            trainer, transfer = spec.split(":")
            runs[trainer] = run_trainer(args, trainer, transfer, model, data, port)
    print(json.dumps({"runs": runs}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
