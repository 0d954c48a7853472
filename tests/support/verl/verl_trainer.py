"""Test driver, run by verl's environment's python: a trainer rank profiled by verl 0.9.1's own
profiler classes, exactly as verl's trainer drives them, around real CPU torch work.

The profiler config is verl's own `profiler` block of the actor and its `global_profiler` block,
loaded as written (`actor.profiler.yaml`, `ppo_trainer.global_profiler.yaml` beside this file),
with `global_profiler.tool: torch`, `save_path` and `enable` set, and turned into verl's
dataclasses the way verl's worker does (`omega_conf_to_dataclass`, the tool's block by the tool's
name: `verl/workers/engine_workers.py`). The rank holds a `DistProfiler` (its `profiler`
attribute, as verl's workers do), started with `role="train", profile_step=<S>` as
`RayPPOTrainer._start_profiling` starts it and stopped with `run_command=False` as the
fully-async trainer stops it; its update is a method annotated with `DistProfiler.annotate`, as
verl annotates its stages.

Protocol: commands on stdin, one per line; each answered by one JSON line on stdout, on a
descriptor of its own (everything verl and torch print goes to stderr):

    rollout_args <replica>   -> {"profiler_args": <build_vllm_profiler_args(...) for the replica>}
    start <S>                -> {"started": <unix s>}      DistProfiler.start(role="train", profile_step=S)
    work                     -> {"worked": <unix s>}       a few optimizer steps of a small MLP
    stop [last]              -> {"stopped": <unix s>}      DistProfiler.stop(run_command=<last>): the
                                                          last profiled step's stop runs finish_hook_cmd
    quit                     -> exits

    $VERL_PYTHON tests/support/verl/verl_trainer.py --save-path DIR [--rank 0] [--finish-hook-cmd CMD]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def profiler_config(save_path: Path, finish_hook_cmd: str | None) -> tuple[Any, Any]:
    """verl's ProfilerConfig and TorchProfilerToolConfig, from its own blocks as written."""
    from omegaconf import OmegaConf
    from verl.utils import omega_conf_to_dataclass
    from verl.utils.profiler import ProfilerConfig

    root = OmegaConf.merge(
        OmegaConf.load(HERE / "ppo_trainer.global_profiler.yaml"), OmegaConf.load(HERE / "actor.profiler.yaml")
    )
    root.global_profiler.tool = "torch"
    root.global_profiler.save_path = str(save_path)
    root.global_profiler.finish_hook_cmd = finish_hook_cmd
    root.profiler.enable = True
    OmegaConf.resolve(root)  # the role's block refers to global_profiler by `${oc.select:...}`
    config = omega_conf_to_dataclass(root.profiler, dataclass_type=ProfilerConfig)
    tool = omega_conf_to_dataclass(root.profiler.tool_config.get(root.profiler.tool))
    return config, tool


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--save-path", type=Path, required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--finish-hook-cmd", help="global_profiler.finish_hook_cmd")
    args = parser.parse_args()
    answer = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # verl's and torch's prints go to stderr

    import torch
    from verl.utils.profiler import DistProfiler
    from verl.utils.profiler.config import build_vllm_profiler_args

    config, tool = profiler_config(args.save_path, args.finish_hook_cmd)

    class Actor:
        """The shape of a verl worker: its profiler in `self.profiler`, its stages annotated."""

        def __init__(self) -> None:
            self.profiler = DistProfiler(rank=args.rank, config=config, tool_config=tool, save_file_prefix="actor")
            torch.manual_seed(args.rank)
            self.model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

        @DistProfiler.annotate(role="actor_update")
        def update(self) -> None:
            for _ in range(4):
                x = torch.randn(32, 64)
                loss = (self.model(x) - x).pow(2).mean()
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()

    actor = Actor()
    answer.write(json.dumps({"ready": time.time()}) + "\n")
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "rollout_args":
            reply: dict[str, Any] = {
                "profiler_args": build_vllm_profiler_args(config, tool, int(rest[0]), legacy_env=False)
            }
        elif cmd == "start":
            actor.profiler.start(role="train", profile_step=int(rest[0]))
            reply = {"started": time.time()}
        elif cmd == "work":
            actor.update()
            reply = {"worked": time.time()}
        elif cmd == "stop":
            actor.profiler.stop(run_command=rest == ["last"])
            reply = {"stopped": time.time()}
        elif cmd == "quit":
            return
        else:
            reply = {"error": f"unknown command {cmd!r}"}
        answer.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
