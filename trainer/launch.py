"""`trainer.world_size` > 1, or `trainer.backend: megatron`: launch the ranks as processes, watch
them, and account for one that dies.

The launcher (the `python -m trainer` process, which owns the app) hosts the ranks' rendezvous (a
store on loopback, its keys sealed with a secret of this launch) and spawns one process per rank;
they join a gloo process group on it and run trainer.loop.run_training in lockstep. Rank 0 reports each
version and its result through a queue. When a rank dies, the launcher records it in the trainer
record of every step it was recording (the manifest turns `partial`, naming it), gives the other
ranks `grace_s` to end their windows (their next collective fails), stops what is left, and raises
RankDied: no hang, no leftover process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from profiling.schedule import StepSchedule
from profiling.store import TraceStore
from trainer.client import AppAddress
from trainer.config import TrainerConfig
from trainer.distributed import DRIVER_RANK, Ranks, Rendezvous, host_rendezvous, init_group
from trainer.loop import ProgressHook, RunResult, VersionStats

if TYPE_CHECKING:
    from trainer.in_cluster import AppCluster  # imports Ray: only rank 0 of an object-store job loads it

log = logging.getLogger(__name__)
GRACE_S = 30.0
"""After a rank died: how long the others get to end their windows and exit on their own."""


class RankDied(RuntimeError):
    """A trainer rank exited before the end of training; the message names it and how."""


def launch_ranks(
    cfg: TrainerConfig,
    app: AppAddress,
    model_dir: str,
    on_version: ProgressHook | None = None,
    grace_s: float = GRACE_S,
    cluster: AppCluster | None = None,
) -> RunResult:
    """Run `cfg.trainer.world_size` ranks against `app` (blocking); rank 0's result. `cluster`: the
    app's Ray cluster, which rank 0 joins to publish through its object store."""
    world = cfg.trainer.world_size
    ctx = mp.get_context("spawn")  # a fresh interpreter per rank: no Ray, no event loop inherited
    reports: Any = ctx.Queue()
    # Bound before any rank starts, so no port can be taken in between; serves until the ranks end.
    store, rendezvous = host_rendezvous(cfg.trainer.dist_timeout_s)
    cfg_json, rendezvous_json = cfg.model_dump_json(exclude_unset=True), rendezvous.model_dump_json()
    cluster_json = None if cluster is None else cluster.model_dump_json()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(cfg_json, r, rendezvous_json, app.model_dump_json(), model_dir, reports, cluster_json),
            name=f"trainer-rank-{r}",
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    result: RunResult | None = None
    died: dict[int, str] = {}
    try:
        while any(p.is_alive() for p in procs) or not reports.empty():
            try:
                kind, payload = reports.get(timeout=0.5)
            except queue_mod.Empty:
                kind = None
            if kind == "version" and on_version is not None:
                on_version(VersionStats.model_validate_json(payload))
            elif kind == "result":
                result = RunResult.model_validate_json(payload)
            died.update({r: _how(p) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in died})
            if died:
                break
    finally:
        if died:  # the survivors first: no rank may start a window after the deaths are recorded
            _stop_survivors(procs, grace_s)
            _record_deaths(cfg, died)
        else:
            for p in procs:
                p.join()
        del store  # every rank has ended: the rendezvous closes
    if died:
        first = min(died)
        raise RankDied(
            f"trainer rank {first} {died[first]}; the other ranks were stopped "
            f"({', '.join(f'rank {r}: {_how(p)}' for r, p in enumerate(procs) if r != first)}). "
            "The steps it was recording are partial, naming it; see its output above for the cause"
        )
    if result is None:
        raise RankDied(f"trainer rank {DRIVER_RANK} ended without reporting a result; see its output above")
    return result


def _how(p: BaseProcess) -> str:
    code = p.exitcode
    if code is None:
        return "still running"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}" if code else "exited normally"


def _record_deaths(cfg: TrainerConfig, died: dict[int, str]) -> None:
    """Name each dead rank in the trainer record of every recorded step that selected it (an entry
    it finished stays ok: the manifest marks only unfinished ones)."""
    if not cfg.global_profiler.profiles:
        return
    store = TraceStore(cfg.global_profiler.save_path)
    for label, *_ in StepSchedule.from_config(cfg.global_profiler).windows:
        try:
            record = store.read_trainer_record(label)
        except ValueError:
            continue
        if record is None:
            continue  # the window never started
        dead = {
            r: f"trainer rank {r} {how} while the step was recorded" for r, how in died.items() if r in record.ranks
        }
        if dead:
            store.update_trainer_record(label, lambda r, d=dead: r.model_copy(update={"failures": {**r.failures, **d}}))  # type: ignore[misc]


def _stop_survivors(procs: Sequence[BaseProcess], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5.0)
        if p.is_alive():
            p.kill()
            p.join()


def _rank_main(
    cfg_json: str,
    rank: int,
    rendezvous_json: str,
    app_json: str,
    model_dir: str,
    reports: Any,
    cluster_json: str | None,
) -> None:
    """One rank's process: join the group (and rank 0 the app's Ray cluster, for object-store
    weights), train, report (rank 0)."""
    import torch

    from profiling.backends.torch_profiler import init_kineto, quiet_kineto_env
    from trainer.client import AppAddress
    from trainer.loop import run_training

    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    quiet_kineto_env()
    init_kineto()
    cfg = TrainerConfig.model_validate_json(cfg_json)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.trainer.world_size))  # the ranks share the cores
    ranks = Ranks(rank=rank, world_size=cfg.trainer.world_size, selected=cfg.profiler.selected(cfg.trainer.world_size))
    # Referenced until the group is destroyed below: the group calls back into it.
    store = init_group(ranks, Rendezvous.model_validate_json(rendezvous_json), cfg.trainer.dist_timeout_s)

    def on_version(s: VersionStats) -> None:
        reports.put(("version", s.model_dump_json()))

    cluster: AppCluster | None = None
    if cluster_json is not None and ranks.drives:  # only the publishing rank joins the app's cluster
        from trainer.in_cluster import AppCluster

        cluster = AppCluster.model_validate_json(cluster_json)

    async def go() -> RunResult:
        if not ranks.drives:  # the other ranks never talk to the app
            return await run_training(cfg, None, model_dir, None, ranks)
        async with AppAddress.model_validate_json(app_json).client() as client:
            return await run_training(cfg, client, model_dir, on_version, ranks, cluster)

    with cluster.joined() if cluster is not None else contextlib.nullcontext():
        result = asyncio.run(go())
    if ranks.drives:
        reports.put(("result", result.model_dump_json()))
    import torch.distributed as dist

    dist.destroy_process_group()
    del store
