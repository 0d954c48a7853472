"""Weights by collective and by the trainer's own transfer, on real Ray Serve with the embedded
engine (docs/design.md#weights-by-collective): a sync loads the trainer's tensors bit-exact on
every replica; a replica SIGKILLed mid-broadcast fails the sync within the control timeout, named,
while the other keeps the old version, and the restarted replica joins through a peer's snapshot;
the 409 and 422 refusals; source external on an engine that keeps no version of its own.

Only processes this test's app reported are killed (their pids from its status).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from integ_util import client, complete, kill_replica, status, wait_for_fleet, wait_manifest
from support.apps import deploy, deployed

from serve_app.tiny_model import TinyModelSpec, ensure_tiny_model
from trainer.client import RolloutClient, RolloutError
from trainer.collective import CollectiveWeights

pytestmark = pytest.mark.integration

NAME = "collective"
TIMEOUT_S = 5.0
BUCKET_BYTES = 256 << 10
"""Small buckets: the model below takes ~40 of them, so a replica can die between two."""


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    """A tiny Llama of ~11 MB (float32)."""
    spec = TinyModelSpec(hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    return ensure_tiny_model(spec, cache_dir=tmp_path_factory.mktemp("big-model"))


@pytest.fixture(scope="module")
def served(ray_cluster, big_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(NAME)
    app = deploy(ray_cluster, big_model, tmp, NAME, weight_transfer="collective", control_timeout_s=TIMEOUT_S)
    try:
        yield app
    finally:
        from ray import serve

        serve.delete(app.name)


def _state(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(seed)
    return {k: (t + 0.05 * torch.randn(t.shape, generator=gen)).contiguous() for k, t in model.state_dict().items()}


def _sync(base_url: str, version: int, state: Mapping[str, torch.Tensor], **kwargs):
    async def go():
        async with RolloutClient(base_url, timeout_s=60.0, retries=0) as c:
            sender = CollectiveWeights(c, bucket_bytes=BUCKET_BYTES, timeout_s=30.0, **kwargs)
            return await sender.update_weights(version, state)

    return asyncio.run(go())


def _snapshots(version: int, calls: int = 6) -> list[dict[str, torch.Tensor]]:
    """Routed weights_snapshot calls: the load balancer spreads them over the replicas."""
    import ray
    from ray import serve

    handle = serve.get_deployment_handle("RolloutReplica", NAME)
    return [ray.get(handle.weights_snapshot.remote(version).result()[0]) for _ in range(calls)]


def _assert_served(state: Mapping[str, torch.Tensor], version: int) -> None:
    for snap in _snapshots(version):
        assert snap.keys() == state.keys()
        for k, t in state.items():
            assert torch.equal(snap[k].view(torch.uint8), t.view(torch.uint8)), f"{k} differs from the trainer's"


def test_collective_sync_loads_the_trainers_tensors_bit_exact(served, big_model):
    state = _state(big_model, seed=1)
    answer = _sync(served.base_url, 1, state)
    assert answer.version == 1 and len(answer.replicas) == 2 and all(r.ok for r in answer.replicas), answer
    assert answer.transfer_s is not None and answer.transfer_s > 0
    with client(served.base_url) as c:
        assert status(c)["weight_version"] == 1
        for _ in range(4):
            assert complete(c, max_tokens=2)["choices"][0]["weight_version"] == 1
    _assert_served(state, 1)


def test_served_or_older_version_is_a_conflict(served, big_model):
    state = _state(big_model, seed=9)
    for version in (0, 1):
        t0 = time.monotonic()
        with pytest.raises(RolloutError) as refused:
            _sync(served.base_url, version, state)
        assert refused.value.status == 409 and time.monotonic() - t0 < TIMEOUT_S, refused.value
    _assert_served(_state(big_model, seed=1), 1)


def test_external_source_needs_an_engine_that_reports_its_version(served):
    async def adopt():
        async with RolloutClient(served.base_url, retries=0) as c:
            return await c.adopt_weights(2)

    with pytest.raises(RolloutError) as refused:
        asyncio.run(adopt())
    assert refused.value.status == 422, refused.value
    assert "keeps no weight version of its own" in refused.value.detail
    assert "source path or collective" in refused.value.detail
    with client(served.base_url) as c:
        assert status(c)["weight_version"] == 1


def test_replica_killed_mid_broadcast_fails_the_sync_named_and_a_restart_joins(served, big_model, report_section):
    old = _state(big_model, seed=1)
    with client(served.base_url) as c:
        before = status(c)["replicas"]
    assert len(before) == 2 and all(r["weight_version"] == 1 for r in before), before
    victim, survivor = before
    killed: list[int] = []

    def kill_after_first_bucket(i: int, count: int) -> None:
        assert count > 2, f"{count} buckets: too few to die between two"
        if i == 0:
            kill_replica(victim, {r["pid"] for r in before})
            killed.append(count)

    t0 = time.monotonic()
    with pytest.raises(RolloutError) as failed:
        _sync(served.base_url, 2, _state(big_model, seed=2), on_bucket=kill_after_first_bucket)
    elapsed = time.monotonic() - t0
    assert killed, "the sync failed before the first bucket went out"
    assert elapsed < TIMEOUT_S + 8.0, f"the failed sync took {elapsed:.1f}s, control_timeout_s={TIMEOUT_S}"
    say = report_section("a replica killed mid-broadcast (tests/integration/test_collective_weights.py)")
    say(
        f"the sync failed after {elapsed:.2f} s (control_timeout_s {TIMEOUT_S:g}), "
        f"the replica killed after bucket 1 of {killed[0]}"
    )
    err = failed.value
    assert err.status == 503 and victim["replica_id"] in str(err), err
    assert "version 1 keeps serving" in err.detail, err.detail
    with client(served.base_url) as c:
        st = status(c)
        assert st["weight_version"] == 1
        live = {r["replica_id"]: r for r in st["replicas"] if r["ok"]}
        assert live[survivor["replica_id"]]["weight_version"] == 1, st
        # The restarted replica loads version 1 from its peer: no file holds it.
        fleet = wait_for_fleet(c, 2, {victim["replica_id"]})
        assert all(r["weight_version"] == 1 for r in fleet), fleet
    _assert_served(old, 1)

    new = _state(big_model, seed=3)
    answer = _sync(served.base_url, 2, new)
    assert len(answer.replicas) == 2 and all(r.ok and r.weight_version == 2 for r in answer.replicas), answer
    _assert_served(new, 2)


def test_app_with_file_transfer_refuses_collective(ray_cluster, model_dir, tmp_path_factory):
    with (
        deployed(ray_cluster, model_dir, tmp_path_factory.mktemp("file"), "filetransfer", num_replicas=1) as app,
        pytest.raises(RolloutError) as refused,
    ):
        _sync(app.base_url, 1, _state(model_dir, seed=1))
    assert refused.value.status == 422
    assert "weight_transfer: collective" in refused.value.detail, refused.value.detail


def test_a_transfer_longer_than_the_hold_timeout_keeps_the_steps_exact(ray_cluster, big_model, tmp_path_factory):
    """stop(pause) -> a collective update that takes longer than hold_timeout_s (a slow network:
    the publisher takes 0.3 s per bucket) -> start, with generation going on throughout: the hold
    covers the transfer and the load and lasts until the start, so no pass on the old weights runs
    after step 1's window and none on the new ones before step 2's (`profiling verify` clean)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from profiling.analysis.verify import verify_steps
    from profiling.store import TraceStore

    hold_s = 3.0
    # The hold's deadline runs from the stop until the replicas begin to receive (~2 s here under
    # this load, the stop's export beside it): the hold must outlast that gap, and the state is
    # built before the stop so the gap holds no model build.
    new_state = _state(big_model, seed=7)
    tmp = tmp_path_factory.mktemp("slowsync")
    with (
        deployed(
            ray_cluster,
            big_model,
            tmp,
            "slowsync",
            weight_transfer="collective",
            control_timeout_s=TIMEOUT_S,
            hold_timeout_s=hold_s,
        ) as app,
        client(app.base_url) as c,
        ThreadPoolExecutor(4) as pool,
    ):
        transferred: list[float] = []
        stop_load = False

        def load() -> None:
            while not stop_load:
                complete(c, max_tokens=8)

        def slow_network(i: int, count: int) -> None:
            time.sleep(0.3)
            transferred.append(time.monotonic())

        async def sync() -> None:
            async with RolloutClient(app.base_url, retries=0) as trainer:
                sender = CollectiveWeights(trainer, bucket_bytes=BUCKET_BYTES, timeout_s=30.0, on_bucket=slow_network)
                # Step 1 is all generation on the initial weights: started before the load.
                await trainer.start_profile(1, max_forward_steps=100_000)
                loads.extend(pool.submit(load) for _ in range(4))
                await asyncio.sleep(1.0)
                await trainer.stop_profile(1, pause=True)
                await sender.update_weights(1, new_state, resume=False)
                await trainer.start_profile(2, max_forward_steps=100_000)
                await asyncio.sleep(1.0)
                await trainer.stop_profile(2)

        loads: list[Future[None]] = []
        try:
            asyncio.run(sync())
        finally:
            stop_load = True
            for f in loads:
                f.result()
        assert transferred[-1] - transferred[0] > 2 * hold_s, "the transfer was not longer than the hold timeout"
        for step in (1, 2):
            assert wait_manifest(c, step, ("complete", "partial"), timeout=120)["status"] == "complete"
    report = verify_steps(TraceStore(app.save_path), [1, 2])
    assert report.ok, [v.message for v in report.violations]
