"""Megatron layouts run for the tests: N rank processes on the trainer's own rendezvous
(trainer/distributed.py), each building `MegatronPolicy`, training two steps on one fixed batch,
taking megatron's own forward logits of a probe and joining the gather. What comes back: the
losses, each rank's coordinates, the published checkpoint (a Hugging Face model directory) and
the logits."""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import shutil
from pathlib import Path

import torch

LR, CLIP, SEED, MICRO = 0.01, 0.2, 0, 2
PROBE = [[1, 45, 96, 119, 228, 95, 29, 300, 17, 64], [7, 8, 9, 10, 200, 201, 202, 203, 204, 205]]
"""Token ids whose logits are compared (the tiny model's vocabulary is 512)."""
STEPS = 2


def fixed_batch() -> list:
    """One mini-batch of 8 samples, the same on every rank and in every run."""
    from trainer.policy import Sample

    r = random.Random(0)
    out = []
    for i in range(8):
        prompt = [r.randrange(4, 500) for _ in range(5 + i % 3)]
        completion = [r.randrange(4, 500) for _ in range(6)]
        logprobs = [-6.0 + 0.1 * j for j in range(6)]
        out.append(
            Sample(
                prompt_ids=prompt, completion_ids=completion, logprobs=logprobs, weight_version=0, reward=float(i % 3)
            )
        )
    return out


def _rank(rank: int, world: int, tp: int, pp: int, model_dir: str, out: str, rendezvous_json: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from trainer.distributed import Ranks, Rendezvous, init_group
    from trainer.megatron.policy import MegatronPolicy

    torch.set_num_threads(1)
    store = init_group(Ranks(rank=rank, world_size=world), Rendezvous.model_validate_json(rendezvous_json), 120)
    policy = MegatronPolicy(model_dir, LR, CLIP, SEED, tp=tp, pp=pp, micro_batch_size=MICRO)
    losses = [policy.train_step(fixed_batch(), policy.data_part(rank, world)) for _ in range(STEPS)]
    logits = policy.logits(torch.tensor(PROBE))
    state = policy.full_state_dict()
    root = Path(out)
    (root / f"rank_{rank}.json").write_text(json.dumps({"losses": losses, "parallel": policy.parallel.model_dump()}))
    if logits is not None and policy.parallel.tp == 0 and policy.parallel.dp == 0:
        save_file({"logits": logits.contiguous()}, str(root / "megatron_logits.safetensors"))
    if rank == 0:
        ckpt = root / "checkpoint"
        shutil.copytree(model_dir, ckpt, ignore=shutil.ignore_patterns("*.safetensors", "DONE"))
        save_file(state, str(ckpt / "model.safetensors"))
    dist.destroy_process_group()
    del store


def run_layout(tp: int, pp: int, model_dir: Path, out: Path, world: int | None = None) -> dict:
    """Run `world` (default tp * pp) ranks; their results from `out`."""
    from trainer.distributed import host_rendezvous

    world = world or tp * pp
    out.mkdir(parents=True, exist_ok=True)
    store, rendezvous = host_rendezvous(120)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank, args=(r, world, tp, pp, str(model_dir), str(out), rendezvous.model_dump_json()))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    del store
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"tp {tp} pp {pp}: the ranks exited with {codes}"
    ranks = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(world)]
    return {"ranks": ranks, "checkpoint": out / "checkpoint", "logits": out / "megatron_logits.safetensors"}
