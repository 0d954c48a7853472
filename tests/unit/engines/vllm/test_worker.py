"""The worker side of vLLM profiling (serve_app/engines/vllm/worker.py) and the replica's view of
it (`WorkerTrace`, `VllmCudaProfiler`), the worker's weight staging over a real gloo group, and the
engine RPC's argument mapping, with no vLLM engine running: a stand-in `execute_model` takes the
place of vLLM's worker method (the real ones run in tests/integration/test_vllm_engine.py and
test_vllm_collective.py)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.traces import trace_events

from profiling.config import ProfileOptions
from profiling.markers import parse_forward_step
from profiling.session import SessionSpec
from profiling.store import atomic_write_text
from serve_app.engines.vllm import engine as vllm_engine
from serve_app.engines.vllm.engine import VllmCudaProfiler, WorkerTrace
from serve_app.engines.vllm.worker import WorkerExport, WorkerProfiler, WorkerStop, WorkerWeights, export_record
from serve_app.weights.collective_schema import CollectiveTransfer


def iteration(tokens: int = 4) -> SimpleNamespace:
    """What the wrapper reads of vLLM's SchedulerOutput."""
    return SimpleNamespace(total_num_scheduled_tokens=tokens)


def marked_worker(version: int = 0) -> tuple[WorkerProfiler, list]:
    """A worker profiler around a stand-in execute_model; the list holds what reached it."""
    profiler = WorkerProfiler(rank=0, version=version)
    ran: list = []

    def execute_model(scheduler_output: SimpleNamespace) -> str:
        ran.append(scheduler_output)
        return "output"

    return profiler, [profiler.wrap(execute_model), ran]


def markers(path: Path) -> list[tuple[int, int, int]]:
    found = [(e["ts"], parse_forward_step(e["name"])) for e in trace_events(path) if e.get("cat") == "user_annotation"]
    return [(m.index, m.step, m.weight_version) for _, m in sorted(found, key=lambda x: x[0]) if m]


def wait_record(trace_dir: Path, prefix: str) -> WorkerExport:
    path = export_record(trace_dir, prefix, 0)
    for _ in range(200):
        if path.exists():
            return WorkerExport.model_validate_json(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"no export record {path}")


def test_each_iteration_is_one_range_with_step_and_version_and_all_passes_are_counted(tmp_path):
    profiler, (execute, ran) = marked_worker(version=3)
    assert execute(iteration()) == "output"  # before any window: counted, not recorded
    clock = profiler.start(4, ProfileOptions(max_forward_steps=None), "step4", tmp_path)
    assert clock is not None and clock.marker.startswith("clock_sync start")
    for _ in range(3):
        execute(iteration())
    execute(iteration(tokens=0))  # no token scheduled: no forward pass, neither marked nor counted
    stopped = profiler.stop()
    assert stopped == WorkerStop(forward_steps=3, forward_steps_in_window=3, auto_stopped=None, weight_versions=[3])
    execute(iteration())
    assert len(ran) == 6, "every call reaches vLLM's execute_model"
    assert profiler.passes == {3: 5} and profiler.recorded == {3: 3}
    record = wait_record(tmp_path, "step4")
    assert record.error is None and record.forward_steps == 3 and record.trace_bytes
    assert markers(tmp_path / record.file) == [(0, 4, 3), (1, 4, 3), (2, 4, 3)]


def test_max_forward_steps_ends_the_recording_in_the_worker_and_the_passes_after_it_are_counted(tmp_path):
    profiler, (execute, _) = marked_worker()
    profiler.start(1, ProfileOptions(max_forward_steps=2), "step1", tmp_path)
    for _ in range(5):
        execute(iteration())
    assert profiler.clock("stop") is not None, "the sample taken when the window ended itself"
    assert profiler.stop() == WorkerStop(
        forward_steps=2, forward_steps_in_window=5, auto_stopped="max_forward_steps", weight_versions=[0]
    ), "kept 2 of the 5 passes the window ran"
    assert profiler.recorded == {0: 2} and profiler.passes == {0: 5}
    assert [i for i, _, _ in markers(tmp_path / wait_record(tmp_path, "step1").file)] == [0, 1]


def test_a_weight_load_inside_a_window_is_marked_and_later_passes_carry_the_new_version(tmp_path):
    profiler, (execute, _) = marked_worker()
    profiler.start(1, ProfileOptions(), "step1", tmp_path)
    execute(iteration())
    loaded = threading.Event()
    profiler.load_weights(1, loaded.set)
    execute(iteration())
    assert loaded.is_set() and profiler.stop().weight_versions == [0, 1]
    record = wait_record(tmp_path, "step1")
    names = [e["name"] for e in trace_events(tmp_path / record.file)]
    assert "weight_update version=1" in names
    assert markers(tmp_path / record.file) == [(0, 1, 0), (1, 1, 1)]


def test_a_second_start_and_a_stop_without_a_window_are_refused(tmp_path):
    profiler, _ = marked_worker()
    with pytest.raises(RuntimeError, match="not recording"):
        profiler.stop()
    profiler.start(1, ProfileOptions(), "step1", tmp_path)
    with pytest.raises(RuntimeError, match="already recording step 1"):
        profiler.start(2, ProfileOptions(), "step2", tmp_path)
    profiler.stop()


def test_the_replica_moves_each_ranks_trace_once_its_record_is_written(tmp_path):
    engine_dir, out = tmp_path / "engine", tmp_path / "step_1" / "rollout" / "r0"
    engine_dir.mkdir()
    stopped = WorkerStop(forward_steps=2, forward_steps_in_window=7, weight_versions=[0])
    trace = WorkerTrace(engine_dir, "step1", ranks=2, stopped=stopped)
    assert trace.forward_steps == 2 and trace.forward_steps_in_window == 7 and trace.weight_versions == [0]

    def write_later() -> None:
        time.sleep(0.2)
        for rank in (0, 1):
            (engine_dir / f"r{rank}.json.gz").write_bytes(b"trace")
            # As the worker writes it: atomically, so the reader never finds a half-written record.
            atomic_write_text(
                export_record(engine_dir, "step1", rank),
                WorkerExport(rank=rank, file=f"r{rank}.json.gz", forward_steps=2, trace_bytes=10).model_dump_json(),
            )

    threading.Thread(target=write_later).start()
    paths = trace.export(out)  # waits for both records
    assert [p.name for p in paths] == ["rank0.trace.pt.trace.json.gz", "rank1.trace.pt.trace.json.gz"]
    assert all(p.read_bytes() == b"trace" for p in paths) and not any(engine_dir.iterdir())
    assert trace.trace_bytes == 10


def test_a_failed_worker_export_or_none_at_all_fails_the_replicas_export(tmp_path, monkeypatch):
    export_record(tmp_path, "step1", 0).write_text(
        WorkerExport(
            rank=0, forward_steps=1, error="the vLLM worker's trace export failed: disk full"
        ).model_dump_json()
    )
    one = WorkerStop(forward_steps=1, forward_steps_in_window=1, weight_versions=[0])
    with pytest.raises(RuntimeError, match="disk full"):
        WorkerTrace(tmp_path, "step1", 1, one).export(tmp_path / "out")
    monkeypatch.setattr(vllm_engine, "EXPORT_WAIT_S", 0.1)
    with pytest.raises(TimeoutError, match="worker 0 wrote no trace"):
        WorkerTrace(tmp_path, "step2", 1, one).export(tmp_path / "out")


def test_nsys_brackets_the_window_with_vllms_cuda_profiler_and_leaves_the_note(tmp_path):
    calls: list[tuple] = []

    class FakeLLM:  # a FAKE AsyncLLM: only the two profiler calls
        async def start_profile(self, profile_prefix: str) -> None:
            calls.append(("start", profile_prefix))

        async def stop_profile(self) -> None:
            calls.append(("stop",))

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        spec = SessionSpec(step=3, steps=[3], options=ProfileOptions(tool="nsys"))
        profiler = VllmCudaProfiler(spec, llm=FakeLLM(), trace_dir=tmp_path, loop=loop)  # type: ignore[arg-type]
        profiler.start()
        [note] = profiler.stop().export(tmp_path / "out")
    finally:
        loop.call_soon_threadsafe(loop.stop)
    assert calls == [("start", "step3"), ("stop",)]
    assert json.loads(note.read_text())["tool"] == "nsys"


# -- weights by collective: the worker's staging (a real gloo group, in this process) -----------
def collective_transfer(port: int, state: dict) -> CollectiveTransfer:
    from serve_app.weights.collective import meta_of, new_secret

    return CollectiveTransfer(
        address="127.0.0.1",
        port=port,
        group="sync-1",
        secret=new_secret(),
        bucket_bytes=1 << 10,  # several buckets for these tensors
        tensors=[meta_of(n, t) for n, t in state.items()],
    )


def received(weights: WorkerWeights, state: dict) -> CollectiveTransfer:
    """`state` broadcast by a publisher (rank 0, on a thread) to `weights` as rank 1 of 2."""
    from serve_app.weights.collective import host_store, host_sync, open_group, send

    store = host_store("127.0.0.1", 0, 20.0)
    transfer = collective_transfer(store.port, state)
    host_sync(store, transfer)

    def publish() -> None:
        send(open_group(store, transfer, 0, 2, 20.0), transfer, state, torch.device("cpu"))

    publisher = threading.Thread(target=publish)
    publisher.start()
    assert weights.receive(transfer, rank=1, world_size=2, timeout_s=20.0, device=torch.device("cpu")) == (
        transfer.total_bytes
    )
    publisher.join(20)
    return transfer


def checkpoint() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 8, generator=gen),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.ones(8),
    }


def test_a_worker_stages_the_broadcast_then_loads_it_as_the_version_and_keeps_it_on_rank_0(tmp_path):
    from safetensors.torch import load

    state = checkpoint()
    weights, profiler = WorkerWeights(rank=0), WorkerProfiler(rank=0, version=0)
    received(weights, state)
    assert weights.staged is not None and weights.staged.keys() == state.keys()
    assert profiler.version == 0, "staging leaves the served weights (and their version) alone"

    loaded: dict = {}
    profiler.start(1, ProfileOptions(), "p", tmp_path)
    weights.load(4, profiler, lambda tensors: loaded.update(tensors))
    profiler.stop()
    assert profiler.version == 4 and weights.staged is None
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor) and loaded[name].dtype == tensor.dtype, name
    snapshot = load(weights.snapshot())
    assert snapshot.keys() == state.keys() and all(torch.equal(snapshot[n], t) for n, t in state.items())

    weights.forget_served()  # a later load from a path: the kept copy is stale
    with pytest.raises(RuntimeError, match="only weights loaded by collective are kept"):
        weights.snapshot()


def test_other_ranks_keep_nothing_and_a_load_without_staged_weights_or_after_a_drop_is_refused():
    weights, profiler = WorkerWeights(rank=1), WorkerProfiler(rank=1, version=0)
    received(weights, checkpoint())
    weights.load(1, profiler, lambda tensors: None)
    assert weights.served is None, "every worker receives the full checkpoint: rank 0 alone keeps it"
    with pytest.raises(RuntimeError, match="no weights are staged on vLLM worker 1 for version 2"):
        weights.load(2, profiler, lambda tensors: None)
    received(weights, checkpoint())
    weights.drop()
    with pytest.raises(RuntimeError, match="no weights are staged"):
        weights.load(2, profiler, lambda tensors: None)
    assert profiler.version == 1


def test_a_load_that_fails_keeps_the_version_and_the_staged_weights():
    weights, profiler = WorkerWeights(rank=0), WorkerProfiler(rank=0, version=3)
    received(weights, checkpoint())

    def broken(tensors) -> None:
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape mismatch"):
        weights.load(4, profiler, broken)
    assert profiler.version == 3 and weights.staged is not None and weights.served is None


# -- the prefix cache across a weight switch -------------------------------------------------------
class StandInLlm:
    """What the engine's weight hooks call of vLLM's AsyncLLM, recorded; `resets` answers each
    `reset_prefix_cache` in turn (an exception is raised, as vLLM's client raises one)."""

    def __init__(self, *resets: bool | Exception):
        self.resets = list(resets)
        self.calls: list[str] = []

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.calls.append(f"reset running={reset_running_requests} connector={reset_connector}")
        answer = self.resets.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        self.calls.append(method)
        return [{"passes": {}, "recorded": {}}]

    async def update_weight_version(self, version: str) -> None:
        self.calls.append(f"version {version}")

    async def resume_generation(self) -> None:
        self.calls.append("resume")


def weight_hooks(llm: StandInLlm) -> vllm_engine.VllmEngine:
    """A VllmEngine's weight hooks around a stand-in AsyncLLM (nothing else of the engine is built)."""
    engine = object.__new__(vllm_engine.VllmEngine)
    engine._llm = llm
    engine._stale_cache = False
    return engine


async def test_a_load_empties_the_prefix_cache_with_the_kept_requests_preempted_before_the_weights_change():
    llm = StandInLlm(True)
    await weight_hooks(llm).load_weights(vllm_engine.StagedInWorkers(), 3)
    assert llm.calls == ["reset running=True connector=True", "rollout_weights_load_staged", "version 3"]


@pytest.mark.parametrize(
    ("answer", "named"),
    [(False, "KV connector refused to reset"), (RuntimeError("blocks in use"), "could not empty .*: blocks in use")],
)
async def test_a_refused_reset_fails_the_load_before_the_weights_change(answer, named):
    llm = StandInLlm(answer)
    with pytest.raises(RuntimeError, match=named):
        await weight_hooks(llm).load_weights(vllm_engine.StagedInWorkers(), 3)
    assert llm.calls == ["reset running=True connector=True"], "the old weights serve on, with their own cache"


async def test_an_adopted_version_whose_reset_fails_does_not_resume_until_a_reset_succeeds():
    llm = StandInLlm(RuntimeError("blocks in use"), False, True)
    engine = weight_hooks(llm)
    with pytest.raises(RuntimeError, match="blocks in use"):
        await engine.adopted(4)
    with pytest.raises(RuntimeError, match="KV connector refused"):
        await engine.resume()
    assert "resume" not in llm.calls, "generation resumed next to the old weights' cache"
    await engine.resume()
    await engine.resume()  # reset once: the cache is clean now
    assert llm.calls[-3:] == ["reset running=True connector=True", "resume", "resume"]


# -- the engine RPC's argument mapping ----------------------------------------------------------
def test_a_worker_function_travels_pickled_to_the_extension_in_every_call_form():
    import cloudpickle

    def fn(worker, path: str, strict: bool = False) -> str:
        return f"{worker}:{path}:{strict}"

    for args, kwargs in [
        ((fn, None, ["/dev/shm/w"], {"strict": True}), {}),
        ((fn,), {"args": ["/dev/shm/w"], "kwargs": {"strict": True}}),
        ((), {"method": fn, "args": ("/dev/shm/w",), "kwargs": {"strict": True}}),
    ]:
        call_args, call_kwargs = vllm_engine._rpc_call("collective_rpc", args, kwargs)
        assert call_args == ("rollout_rpc_function",) and call_kwargs["timeout"] is None
        function, fn_args, fn_kwargs = call_kwargs["args"]
        assert cloudpickle.loads(function)("w", *fn_args, **fn_kwargs) == "w:/dev/shm/w:True"
    assert vllm_engine._rpc_call("collective_rpc", ("reload_weights",), {"kwargs": {}}) == (
        ("reload_weights",),
        {"kwargs": {}},
    ), "a worker method's name goes to vLLM as it is"
    with pytest.raises(ValueError, match=r"takes \(method, timeout=None, args=\(\), kwargs=None\) only"):
        vllm_engine._rpc_call("collective_rpc", (fn, None, [], {}, "extra"), {})
    with pytest.raises(ValueError, match="a worker method's name or a function"):
        vllm_engine._rpc_call("collective_rpc", (3,), {})
    for own in ("rollout_profiler_stop", "rollout_weights_load_staged", "rollout_rpc_function"):
        with pytest.raises(ValueError, match="the replica's own worker method"):
            vllm_engine._rpc_call("collective_rpc", (own,), {})


def test_versions_must_be_integers_and_dicts_become_vllms_weight_transfer_requests():
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

    assert vllm_engine._rpc_call("update_weight_version", (7,), {}) == (("7",), {})
    assert vllm_engine._rpc_call("finish_weight_update", (), {"weight_version": "8"}) == ((), {"weight_version": "8"})
    for bad in ("v7", -1, True, 1.5):
        with pytest.raises(ValueError, match="non-negative integer"):
            vllm_engine._rpc_call("update_weight_version", (bad,), {})
    ((init,), _) = vllm_engine._rpc_call("init_weight_transfer_engine", ({"master_port": 1},), {})
    assert isinstance(init, WeightTransferInitRequest) and init.init_info == {"master_port": 1}
    ((update,), _) = vllm_engine._rpc_call("update_weights", ({"names": ["a"]},), {})
    assert isinstance(update, WeightTransferUpdateRequest) and update.update_info == {"names": ["a"]}
