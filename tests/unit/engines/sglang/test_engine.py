"""The SGLang engine adapter against the FAKE SGLang server (tests/fakes, NOT SGLang) run in this
process, its error mapping against canned answers (httpx.MockTransport), and the server launcher
against small stand-in commands. Nothing here ran against a real SGLang server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from fakes.fake_sglang_scheduler import Scheduler
from fakes.fake_sglang_server import build_app
from safetensors.torch import load_file, save_file
from support.engines import replica_sessions
from support.traces import trace_events

from profiling.config import NpuOptions, ProfileOptions
from profiling.session import SessionSpec
from profiling.store import TraceStore
from serve_app.config import AppArgs
from serve_app.engines.controller import EngineController
from serve_app.engines.generation import GenerateDelta, GenerateRequest, SamplingSpec, SpanBuilder
from serve_app.engines.sglang.client import (
    GenerateChunk,
    PauseGenerationBody,
    SglangClient,
    SglangError,
    parse_sse_line,
)
from serve_app.engines.sglang.engine import (
    ChunkReader,
    SglangEngine,
    SglangProfiler,
    generate_body,
    start_profile_body,
)
from serve_app.engines.sglang.options import SglangOptions
from serve_app.engines.sglang.server import SglangServer, wait_ready
from serve_app.engines.sglang.trace_dialect import SGLANG_DIALECT
from serve_app.net import free_port
from serve_app.weights.safetensors_file import WeightsError

RID = "replica-0"
# `step<k>[-tag]-v<version>-<SGLang's profile_id: its clock>-TP-0.trace.json.gz`
TRACE_NAME = re.compile(r"^step(\d+)(-[A-Za-z0-9._-]+)?-v(\d+)-[0-9.]+-TP-0\.trace\.json\.gz$")


# -- fixtures --------------------------------------------------------------------------------


@contextlib.contextmanager
def serve_fake(model_dir: Path, incremental_streaming_output: bool = False) -> Iterator[tuple[str, Scheduler]]:
    """A FAKE SGLang server (strict about request fields) served from a thread of this process:
    its URL and its scheduler."""
    # Paced at 3 ms per batch: the long requests below are still running when a test acts on them.
    scheduler = Scheduler(model_dir, step_delay_s=0.003)
    app = build_app(scheduler, strict_fields=True, incremental_streaming_output=incremental_streaming_output)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, 60)
        yield url, scheduler
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture
def fake(model_dir: Path) -> Iterator[tuple[str, Scheduler]]:
    with serve_fake(model_dir) as served:
        yield served


@pytest.fixture
async def engine(fake: tuple[str, Scheduler], model_dir: Path, tmp_path: Path) -> AsyncIterator[EngineController]:
    async with open_engine(fake[0], model_dir, tmp_path) as eng:
        yield eng


@contextlib.asynccontextmanager
async def open_engine(url: str, model_dir: Path, tmp_path: Path) -> AsyncIterator[EngineController]:
    args = AppArgs(engine="sglang", num_replicas=1, save_path=str(tmp_path / "traces"), sglang={"url": url})
    exporter = ThreadPoolExecutor(1, thread_name_prefix="export")

    eng = await asyncio.to_thread(
        EngineController,
        SglangEngine,
        args=args,
        model_dir=model_dir,
        session_factory=replica_sessions(TraceStore(args.save_path), exporter, RID, node_id="node-0"),
        trace_dir=Path(args.save_path) / ".engine" / RID,
    )
    try:
        yield eng
    finally:
        await eng.shutdown()
        exporter.shutdown(wait=True)


def profiler(engine: EngineController, spec: SessionSpec) -> SglangProfiler:
    """A recording of the engine's profiler, driven by hand (the session drives it otherwise)."""
    return SglangProfiler(
        spec, client=engine.adapter._client, trace_dir=engine.trace_dir, loop=asyncio.get_running_loop(), version=0
    )


def req(prompt: list[int] | None = None, stream: bool = False, **sampling) -> GenerateRequest:
    return GenerateRequest(
        prompt_token_ids=prompt or [5, 6, 7, 8],
        sampling=SamplingSpec.model_validate({"max_tokens": 4, **sampling}),
        stream=stream,
    )


def greedy(n: int = 4, stream: bool = False) -> GenerateRequest:
    return req(max_tokens=n, temperature=0.0, stream=stream)


class Result:
    """One sequence's deltas, gathered as the replica does (serve_app/choices.py)."""

    def __init__(self, deltas: list[GenerateDelta]):
        self.deltas = deltas
        self.token_ids = [t for d in deltas for t in d.token_ids]
        self.logprobs = [lp for d in deltas for lp in d.logprobs]
        self.finish_reason = deltas[-1].finish_reason
        self.stop_reason = deltas[-1].stop_reason
        spans = SpanBuilder()
        for d in deltas:
            assert d.weight_version is not None, d
            spans.add(len(d.token_ids), d.weight_version)
            if d.weight_versions is not None:
                spans.replace(d.weight_versions)
        self.spans = [(s.version, s.start, s.end) for s in spans.spans]


async def generate(engine: EngineController, request: GenerateRequest) -> Result:
    return Result([d async for d in engine.generate(request)])


def forward_ranges(path: Path) -> list[str]:
    """The names of SGLang's per-forward ranges (`step[<MODE> bs=..]`) in one trace file."""
    return [
        e["name"] for e in trace_events(path) if e.get("cat") == "user_annotation" and e["name"].startswith("step[")
    ]


def recorded_forwards(scheduler: Scheduler, version: str) -> int:
    """Forwards the fake ran on `version` while its profiler recorded."""
    return sum(1 for v, recorded in scheduler.forwards if recorded and v == version)


def perturbed_weights(model_dir: Path, out: Path, seed: int) -> Path:
    gen = torch.Generator().manual_seed(seed)
    state = {
        k: (v + 0.05 * torch.randn(v.shape, generator=gen)).contiguous()
        for k, v in load_file(str(model_dir / "model.safetensors")).items()
    }
    save_file(state, str(out))
    return out


# -- the adapter against the fake server ------------------------------------------------------


async def test_sglang_engine_against_fake_server_records_a_step_into_its_prefixed_trace(
    engine: EngineController, fake: tuple[str, Scheduler], spec
):
    assert await engine.start_profile(spec(3, max_forward_steps=None))
    results = [await generate(engine, greedy(4)), await generate(engine, greedy(3))]
    outcome = await engine.stop_profile(3, pause=False)
    assert outcome.stopped and outcome.step == 3
    entry = await engine.wait_exported(3, 30)
    assert entry is not None and entry.status == "ok", entry
    step_dir = Path(engine.trace_dir).parents[1] / "step_3"
    assert len(entry.files) == 1 and entry.files[0].startswith(f"rollout/{RID}/")
    path = step_dir / entry.files[0]
    named = TRACE_NAME.match(path.name)
    assert named and named.group(1, 3) == ("3", "0") and SGLANG_DIALECT.file_version_of(path.name) == 0, path.name
    # One `step[..]` range per forward, without pipeline parallelism: a prefill (EXTEND) then one
    # DECODE per further token of these one-at-a-time requests; all the forwards the fake ran.
    tokens = sum(len(r.token_ids) for r in results)
    ranges = forward_ranges(path)
    assert entry.forward_steps == len(ranges) == recorded_forwards(fake[1], "default") == tokens > 0
    assert ranges[0] == "step[EXTEND bs=1 toks=4]" and ranges[1] == "step[DECODE bs=1]", ranges
    assert entry.weight_version == 0
    assert not list(engine.trace_dir.iterdir()), "the export leaves the engine's directory empty"
    for r in results:
        assert r.spans == [(0, 0, len(r.token_ids))] and r.finish_reason in ("stop", "length")


async def test_sglang_engine_against_fake_server_num_steps_cap_then_stop_is_a_clean_stop(
    engine: EngineController, spec
):
    """SGLang stops by itself after num_steps; our later stop gets its bare 500 and finds the trace."""
    await engine.start_profile(spec(4, max_forward_steps=2, tag="capped"))
    await generate(engine, greedy(5))
    outcome = await engine.stop_profile(4, pause=False)
    entry = await engine.wait_exported(4, 30)
    assert outcome.stopped and entry is not None and entry.status == "ok", entry
    assert entry.forward_steps == 2
    assert Path(entry.files[0]).name.startswith("step4-capped-v0-")


async def test_sglang_engine_against_fake_server_window_across_an_update_has_one_trace_per_version(
    engine: EngineController, fake: tuple[str, Scheduler], model_dir: Path, tmp_path: Path, spec
):
    """A continuous window: the load ends SGLang's recording of version 0 and starts one of
    version 1, with generation paused, so every forward in a file ran on the version it names."""
    assert await engine.start_profile(spec(1, steps=[1, 2], max_forward_steps=None))
    before = await generate(engine, greedy(3))
    await engine.update_weights(1, str(perturbed_weights(model_dir, tmp_path / "v1.safetensors", 1)), resume=True)
    after = await generate(engine, greedy(4))
    await engine.stop_profile(1, pause=True)
    entry = await engine.wait_exported(1, 30)
    assert entry is not None and entry.status == "ok", entry
    paths = [Path(engine.trace_dir).parents[1] / "step_1" / f for f in entry.files]
    assert [SGLANG_DIALECT.file_version_of(p.name) for p in paths] == [0, 1], paths
    counts = [len(forward_ranges(p)) for p in paths]
    assert counts == [recorded_forwards(fake[1], "default"), recorded_forwards(fake[1], "1")]
    assert counts == [len(before.token_ids), len(after.token_ids)]
    assert entry.forward_steps == sum(counts) and not fake[1].profiler.in_progress
    assert before.spans == [(0, 0, 3)] and after.spans == [(1, 0, 4)]


async def test_sglang_engine_against_fake_server_failed_load_in_a_window_keeps_recording_the_old_version(
    engine: EngineController, fake: tuple[str, Scheduler], tmp_path: Path, spec
):
    assert await engine.start_profile(spec(1, steps=[1, 2], max_forward_steps=None))
    first = await generate(engine, greedy(2))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WeightsError, match="Cannot find any model weights"):
        await engine.adapter.load_weights(empty, 1)
    assert fake[1].profiler.in_progress, "the recording restarts after a failed load"
    second = await generate(engine, greedy(3))
    await engine.stop_profile(1, pause=False)
    entry = await engine.wait_exported(1, 30)
    assert entry is not None and entry.status == "ok", entry
    names = [Path(f).name for f in entry.files]
    assert [SGLANG_DIALECT.file_version_of(n) for n in names] == [0, 0], names
    assert entry.forward_steps == len(first.token_ids) + len(second.token_ids) == recorded_forwards(fake[1], "default")


async def test_sglang_engine_against_fake_server_refused_profiler_calls_name_url_route_and_status(
    engine: EngineController, spec
):
    await profiler(engine, spec(7))._engine_start()
    with pytest.raises(SglangError) as err:
        await profiler(engine, spec(7))._engine_start()
    message = str(err.value)
    assert err.value.status == 500
    for part in (engine.adapter._client.url, "POST /start_profile", "HTTP 500", "Internal Server Error", "server log"):
        assert part in message, message
    await profiler(engine, spec(7))._engine_stop()
    with pytest.raises(SglangError, match="POST /stop_profile with HTTP 500"):
        await engine.adapter._client.call("/stop_profile", own_connection=True)
    # uvicorn closes the connection of a refused call: on a connection of its own, the next call
    # (on the pool) is unaffected.
    assert (await generate(engine, greedy(2))).token_ids


async def test_sglang_engine_against_fake_server_weight_update_sets_version_and_changes_outputs(
    engine: EngineController, model_dir: Path, tmp_path: Path
):
    before = await generate(engine, req(max_tokens=4, temperature=0.0, logprobs=0))
    load_s = await engine.update_weights(
        1, str(perturbed_weights(model_dir, tmp_path / "v1.safetensors", 1)), resume=True
    )
    assert load_s > 0 and engine.weight_version == 1
    after = await generate(engine, req(max_tokens=4, temperature=0.0, logprobs=0))
    assert after.spans == [(1, 0, 4)] and after.logprobs != before.logprobs
    async with httpx.AsyncClient() as http:
        info = (await http.get(f"{engine.adapter._client.url}/model_info")).json()
    assert info["weight_version"] == "1"
    assert not engine.status().paused


async def test_sglang_engine_against_fake_server_bad_weights_raise_and_the_old_version_serves(
    engine: EngineController, tmp_path: Path
):
    bad = tmp_path / "bad.safetensors"
    save_file({"not.a.model.weight": torch.zeros(2)}, str(bad))
    # The engine base refuses it from its headers, before SGLang is asked or generation paused.
    with pytest.raises(WeightsError, match="does not fit the served model"):
        await engine.update_weights(1, str(bad), resume=True)
    # SGLang's own refusals, reached through the adapter's hook: named with the server's reason.
    with pytest.raises(WeightsError) as err:
        await engine.adapter.load_weights(bad, 1)
    assert "Failed to update weights" in str(err.value) and engine.adapter._client.url in str(err.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WeightsError, match="Cannot find any model weights"):
        await engine.adapter.load_weights(empty, 1)
    assert engine.weight_version == 0
    result = await asyncio.wait_for(generate(engine, greedy(2)), 30)  # still serving, never paused
    assert result.spans == [(0, 0, 2)]


async def test_sglang_engine_against_fake_server_pause_holds_requests_until_resume(engine: EngineController):
    await engine.adapter.pause()
    held = asyncio.create_task(generate(engine, greedy(2)))
    await asyncio.sleep(0.5)
    assert not held.done(), "a request ran while generation was paused"
    await engine.adapter.resume()
    assert len((await asyncio.wait_for(held, 30)).token_ids) == 2


async def test_sglang_engine_against_fake_server_request_held_across_an_update_reports_the_new_version(
    engine: EngineController, model_dir: Path, tmp_path: Path
):
    await engine.stop_profile(None, pause=True)  # the admission hold of a trainer's stop(pause)
    held = asyncio.create_task(generate(engine, greedy(3)))
    await asyncio.sleep(0.3)
    assert not held.done()
    await engine.update_weights(1, str(perturbed_weights(model_dir, tmp_path / "v1.safetensors", 1)), resume=True)
    assert (await asyncio.wait_for(held, 30)).spans == [(1, 0, 3)]


async def test_sglang_engine_against_fake_server_update_with_requests_in_flight_retracts_them(
    engine: EngineController, model_dir: Path, tmp_path: Path
):
    """The retract pause lets the update flush SGLang's cache with requests running (an
    in_place pause would kill the scheduler); the request finishes on the new weights."""
    # ignore_eos: where the update lands depends on the machine's speed, and the new weights may
    # sample EOS soon after it; the test is about the spans, not the model's choice to stop.
    long = asyncio.create_task(generate(engine, req([5, 6], max_tokens=300, temperature=0.0, ignore_eos=True)))
    await asyncio.sleep(0.3)
    assert not long.done()
    await engine.update_weights(1, str(perturbed_weights(model_dir, tmp_path / "v1.safetensors", 1)), resume=True)
    result = await asyncio.wait_for(long, 60)
    # SGLang's exact spans: the tokens before the update on version 0, the rest on version 1.
    ((v0, s0, e0), (v1, s1, e1)) = result.spans
    assert (v0, s0, v1, e1) == (0, 0, 1, 300) and 0 < e0 == s1 < 300
    assert len(result.token_ids) == 300 and engine.healthy()


SHARED_PREFIX = [5, 6, 7, 8, 9, 10, 11, 12]


def long_greedy(suffix: int) -> GenerateRequest:
    """A request on the shared prefix that runs long enough for a test to act while it runs."""
    return req([*SHARED_PREFIX, suffix], max_tokens=120, temperature=0.0, ignore_eos=True)


async def until_decoding(scheduler: Scheduler, requests: int) -> None:
    """Until `requests` requests have been prefilled and decode (their KV is cached)."""
    deadline = time.monotonic() + 30
    while sum(1 for r in list(scheduler._running) if len(r.output_ids) >= 2) < requests:
        assert time.monotonic() < deadline, "the requests did not start decoding"
        await asyncio.sleep(0.01)


async def test_a_clients_prefix_cache_reset_is_sglangs_flush_refused_while_a_request_runs(fake, engine):
    """vLLM's /reset_prefix_cache on SGLang: its /flush_cache, which answers 400 while a request
    runs, whatever the caller asks (SGLang cannot preempt for it); then a refusal, not an error."""
    url, scheduler = fake
    scheduler.step_delay_s = 0.02  # keeps the request running while the reset is asked
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        running = asyncio.create_task(http.post("/generate", json={"input_ids": [5, 6], "sampling_params": {
            "max_new_tokens": 60, "temperature": 0.0, "ignore_eos": True}}))  # fmt: skip
        await until_decoding(scheduler, 1)
        assert await engine.reset_prefix_cache(True, False) is False
        scheduler.step_delay_s = 0.0
        assert (await running).status_code == 200
    assert await engine.reset_prefix_cache(False, False) is True


def pause_in_place(engine: EngineController, monkeypatch: pytest.MonkeyPatch) -> None:
    """The replica's pause made SGLang's `in_place` one, which keeps the running batch."""

    async def pause() -> None:
        await engine.adapter._client.call("/pause_generation", PauseGenerationBody(mode="in_place"))

    monkeypatch.setattr(engine.adapter, "pause", pause)


async def fake_call(url: str, route: str, body: dict | None = None) -> httpx.Response:
    """A call to the fake from another client than the replica (an operator, or a trainer)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        return await http.post(route, json=body)


async def test_fake_sglang_server_refuses_a_flush_while_a_request_runs_and_counts_forwards_on_stale_kv(
    fake: tuple[str, Scheduler], model_dir: Path, tmp_path: Path
):
    """The fake's own check, as SGLang answers: a flush is refused while the running batch holds a
    request (here: paused in place), which fails a weight update after its load; the request then
    decodes next to KV of the old weights (counted), until a retract pause lets a flush through."""
    url, scheduler = fake
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        running = asyncio.create_task(http.post("/generate", json={"input_ids": [5, 6], "sampling_params": {
            "max_new_tokens": 120, "temperature": 0.0, "ignore_eos": True}}))  # fmt: skip
        await until_decoding(scheduler, 1)
        await fake_call(url, "/pause_generation", {"mode": "in_place"})
        refused = await fake_call(url, "/flush_cache")
        assert (refused.status_code, refused.text) == (400, "Flush cache failed.\n")
        weights = perturbed_weights(model_dir, tmp_path / "model.safetensors", 1).parent
        update = await fake_call(url, "/update_weights_from_disk", {"model_path": str(weights), "weight_version": "1"})
        assert update.status_code == 400 and update.json()["message"].startswith("Weights were updated, but the cache")
        assert scheduler.weights_loaded == 1, "the refused flush fails the update after the load"
        await fake_call(url, "/continue_generation", {})
        await asyncio.sleep(0.2)
        assert scheduler.stale_cache_forwards > 0, "decoding next to the old weights' KV is counted"
        await fake_call(url, "/pause_generation", {"mode": "retract"})
        flushed = await fake_call(url, "/flush_cache")
        assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
        stale = scheduler.stale_cache_forwards
        await fake_call(url, "/continue_generation", {})
        assert (await running).status_code == 200
    assert scheduler.stale_cache_forwards == stale and scheduler.cached_weights == {1}


async def test_sglang_engine_against_fake_server_update_under_load_leaves_no_kv_of_the_old_weights(
    engine: EngineController, fake: tuple[str, Scheduler], model_dir: Path, tmp_path: Path
):
    """Requests on a shared prefix in flight across an update: the flush empties SGLang's cache
    while they are retracted, so neither they nor a request admitted afterwards reuse KV of the
    old weights, and the kept ones report both versions."""
    scheduler = fake[1]
    kept = [asyncio.create_task(generate(engine, long_greedy(20 + i))) for i in range(3)]
    await until_decoding(scheduler, 3)
    await engine.update_weights(1, str(perturbed_weights(model_dir, tmp_path / "v1.safetensors", 1)), resume=True)
    after = await generate(engine, req([*SHARED_PREFIX, 30], max_tokens=8, temperature=0.0))
    for result in await asyncio.wait_for(asyncio.gather(*kept), 60):
        ((v0, s0, k), (v1, k1, end)) = result.spans
        assert (v0, s0, v1, end) == (0, 0, 1, 120) and 0 < k == k1 < 120, result.spans
    assert after.spans == [(1, 0, 8)]
    assert scheduler.stale_cache_forwards == 0 and scheduler.cached_weights == {scheduler.weights_loaded}


async def test_sglang_engine_against_fake_server_refused_flush_fails_the_update_before_the_load(
    engine: EngineController, fake: tuple[str, Scheduler], model_dir: Path, tmp_path: Path, monkeypatch
):
    """A server paused in place keeps its running batch, so SGLang refuses the flush: the update
    fails naming it, before the load, and the old weights serve on with their own cache."""
    scheduler = fake[1]
    pause_in_place(engine, monkeypatch)
    running = asyncio.create_task(generate(engine, long_greedy(20)))
    await until_decoding(scheduler, 1)
    weights = perturbed_weights(model_dir, tmp_path / "v1.safetensors", 1)
    with pytest.raises(
        SglangError, match=r"refused to flush its cache before loading version 1 \(version 0 serves on\)"
    ):
        await engine.update_weights(1, str(weights), resume=True)
    assert engine.weight_version == 0 and scheduler.weights_loaded == 0 and not engine.status().paused
    assert (await asyncio.wait_for(running, 60)).spans == [(0, 0, 120)]
    assert scheduler.stale_cache_forwards == 0


async def test_sglang_engine_against_fake_server_adopting_flushes_what_the_trainers_update_left_or_stays_paused(
    engine: EngineController, fake: tuple[str, Scheduler], model_dir: Path, tmp_path: Path, monkeypatch
):
    """The trainer's own update, on a server another client paused in place, loads but cannot
    flush. Adopting its version flushes while paused: refused (the batch still runs), the adopt
    fails and generation stays paused; once a retract pause empties the batch, it succeeds."""
    url, scheduler = fake
    running = asyncio.create_task(generate(engine, long_greedy(20)))
    await until_decoding(scheduler, 1)
    await fake_call(url, "/pause_generation", {"mode": "in_place"})
    weights = perturbed_weights(model_dir, tmp_path / "model.safetensors", 1).parent
    update = await fake_call(url, "/update_weights_from_disk", {"model_path": str(weights), "weight_version": "1"})
    assert update.status_code == 400, "SGLang refused the flush after loading"
    await fake_call(url, "/update_weight_version", {"new_version": "1", "abort_all_requests": False})

    pause_in_place(engine, monkeypatch)
    with pytest.raises(SglangError, match=r"refused to flush its cache after the trainer's update to version 1"):
        await engine.adopt_weights(1, resume=True)
    steps = scheduler.forward_ct
    await asyncio.sleep(0.3)
    assert scheduler.forward_ct == steps and engine.weight_version == 0, "generation resumed next to stale KV"

    monkeypatch.undo()  # the replica's own retract pause again
    await engine.adopt_weights(1, resume=True)
    ((v0, s0, k), (v1, k1, end)) = (await asyncio.wait_for(running, 60)).spans
    assert (v0, s0, v1, end) == (0, 0, 1, 120) and 0 < k == k1 < 120
    assert engine.weight_version == 1 and scheduler.stale_cache_forwards == 0


async def test_sglang_engine_against_fake_server_aborted_request_is_an_error(engine: EngineController):
    # Greedy and long (as the retract test above): still running when the abort comes, with no
    # sampled end-of-sequence to finish it first.
    running = asyncio.create_task(generate(engine, req([5, 6], max_tokens=300, temperature=0.0)))
    await asyncio.sleep(0.2)
    assert not running.done()
    await engine.adapter._client.call("/pause_generation", PauseGenerationBody(mode="abort"))
    with pytest.raises(SglangError, match="aborted the request"):
        await asyncio.wait_for(running, 30)
    await engine.adapter.resume()


async def test_sglang_engine_against_fake_server_rejects_out_of_range_prompts(engine: EngineController):
    with pytest.raises(ValueError, match="out of range"):
        await generate(engine, req([10**6]))


async def test_sglang_engine_against_fake_server_unhealthy_after_a_lost_call_until_a_probe_answers(
    engine: EngineController,
):
    assert engine.healthy()
    engine.adapter._client.unreachable = "ReadError: connection reset"  # as a failed call leaves it
    assert not engine.healthy()
    await asyncio.wait_for(engine.adapter._probe, 10)
    assert engine.healthy()


async def test_sglang_engine_against_fake_server_nsys_stop_already_done_is_read_from_the_server_log(
    engine: EngineController,
    spec,
):
    """tool nsys (CUDA_PROFILER) leaves no trace file: that SGLang stopped by itself after
    num_steps shows only in its log. The window is written down as a note for the step."""
    with pytest.raises(SglangError, match="HTTP 500"):  # nothing was recording, and the log does not say so
        await profiler(engine, spec(8, tool="nsys"))._engine_stop()
    engine.adapter._client._log_tail = lambda: "RuntimeError: Profiling is not in progress. Call /start_profile first."
    recording = profiler(engine, spec(8, tool="nsys"))
    await recording._engine_stop()
    (note,) = recording.recorded_files()
    assert note.name == "step8-nsys_capture.json"
    assert json.loads(note.read_text())["trace_written_here"] is False


# -- sampling and streaming against the fake server --------------------------------------------


async def test_sglang_engine_against_fake_server_streams_what_the_one_shot_answer_holds(engine: EngineController):
    one_shot = await generate(engine, req(max_tokens=8, temperature=0.0, logprobs=2))
    streamed = await generate(engine, req(max_tokens=8, temperature=0.0, logprobs=2, stream=True))
    assert len(one_shot.deltas) == 1 and len(streamed.deltas) == 8
    assert all(len(d.token_ids) == 1 and d.weight_version == 0 for d in streamed.deltas)
    assert streamed.token_ids == one_shot.token_ids and len(one_shot.token_ids) == 8
    for a, b in zip(streamed.logprobs, one_shot.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob) and list(a.top) == list(b.top) and len(a.top) == 2
        assert max(a.top.values()) >= a.logprob  # greedy: the sampled token is the most likely
    assert streamed.spans == one_shot.spans == [(0, 0, 8)]
    assert streamed.finish_reason == one_shot.finish_reason == "length"


async def test_sglang_engine_against_fake_server_reads_incremental_streaming_output_alike(
    engine: EngineController, model_dir: Path, tmp_path: Path
):
    """SGLang's --incremental-streaming-output sends only new tokens per chunk; the deltas are the
    same as from its default (every token so far)."""
    request = req(max_tokens=6, temperature=0.0, logprobs=1, prompt_logprobs=1, stream=True)
    cumulative = await generate(engine, request)
    with serve_fake(model_dir, incremental_streaming_output=True) as (url, _):
        async with open_engine(url, model_dir, tmp_path / "incremental") as other:
            incremental = await generate(other, request)
    assert [d.token_ids for d in incremental.deltas] == [d.token_ids for d in cumulative.deltas]
    assert [lp.logprob for lp in incremental.logprobs] == pytest.approx([lp.logprob for lp in cumulative.logprobs])
    assert incremental.deltas[0].prompt_logprobs == cumulative.deltas[0].prompt_logprobs


async def test_sglang_engine_against_fake_server_seed_makes_sampling_repeatable(engine: EngineController):
    sampling = {
        "max_tokens": 12,
        "temperature": 1.3,
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.01,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.2,
        "frequency_penalty": 0.1,
    }
    first = await generate(engine, req(seed=7, **sampling))
    again = await generate(engine, req(seed=7, stream=True, **sampling))
    assert again.token_ids == first.token_ids
    others = [(await generate(engine, req(seed=seed, **sampling))).token_ids for seed in (8, 9, 10)]
    assert any(o != first.token_ids for o in others), "other seeds drew the same tokens"


async def test_sglang_engine_against_fake_server_stop_token_ends_the_sequence_and_is_kept(engine: EngineController):
    free = (await generate(engine, req(max_tokens=10, temperature=0.0))).token_ids
    i = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    for stream in (False, True):
        stopped = await generate(engine, req(max_tokens=10, temperature=0.0, stop_token_ids=[free[i]], stream=stream))
        assert stopped.token_ids == free[: i + 1] and stopped.finish_reason == "stop" and stopped.stop_reason == free[i]
        assert stopped.spans == [(0, 0, i + 1)]
    # min_tokens holds the stop token back (SGLang masks it), so the sequence runs past it.
    held = await generate(engine, req(max_tokens=10, temperature=0.0, stop_token_ids=[free[i]], min_tokens=i + 3))
    assert len(held.token_ids) >= i + 3 and free[i] not in held.token_ids[: i + 3]


async def test_sglang_engine_against_fake_server_eos_ends_unless_ignored(
    engine: EngineController, fake: tuple[str, Scheduler]
):
    free = (await generate(engine, req(max_tokens=10, temperature=0.0))).token_ids
    i = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    fake[1].eos = free[i]  # fake-only: make a token the tiny model emits its end of sequence
    ended = await generate(engine, req(max_tokens=10, temperature=0.0))
    assert ended.token_ids == free[: i + 1] and ended.finish_reason == "stop" and ended.stop_reason is None
    ignored = await generate(engine, req(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert ignored.token_ids == free and ignored.finish_reason == "length"


async def test_sglang_engine_against_fake_server_stop_string_is_matched_in_the_text(engine: EngineController):
    free = (await generate(engine, req(max_tokens=10, temperature=0.0))).token_ids
    text = engine.tokenizer.detokenize(free)
    stop = next(
        piece
        for j in range(2, len(free))
        if len(piece := engine.tokenizer.detokenize([free[j]]).strip()) >= 2 and piece in text
    )
    for stream in (False, True):
        stopped = await generate(engine, req(max_tokens=10, temperature=0.0, stop=[stop], stream=stream))
        assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
        out = engine.tokenizer.detokenize(stopped.token_ids)
        assert stop in out and stop not in engine.tokenizer.detokenize(stopped.token_ids[:-1]), (stop, out)
        assert stopped.token_ids == free[: len(stopped.token_ids)]


async def test_sglang_engine_against_fake_server_reports_prompt_logprobs_on_the_first_delta(engine: EngineController):
    prompt = [5, 6, 7, 8, 9]
    result = await generate(
        engine, req(prompt, max_tokens=3, temperature=0.0, logprobs=1, prompt_logprobs=3, stream=True)
    )
    first = result.deltas[0].prompt_logprobs
    assert first is not None and len(first) == len(prompt) and first[0] is None
    assert all(lp is not None and len(lp.top) == 3 and lp.logprob <= max(lp.top.values()) for lp in first[1:])
    assert all(d.prompt_logprobs is None for d in result.deltas[1:])
    assert all(len(lp.top) == 1 for lp in result.logprobs)  # the output's own k, though SGLang sent 3


async def test_sglang_engine_against_fake_server_closing_the_stream_aborts_the_request(
    engine: EngineController, fake: tuple[str, Scheduler]
):
    scheduler = fake[1]
    stream = engine.generate(req([5, 6], max_tokens=300, temperature=0.0, stream=True))
    for _ in range(3):
        assert (await anext(stream)).token_ids
    await stream.aclose()
    deadline = time.monotonic() + 10
    while scheduler.live_requests() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert scheduler.live_requests() == 0, "the fake SGLang server still runs the abandoned request"
    steps = scheduler.forward_ct
    await asyncio.sleep(0.3)
    assert scheduler.forward_ct == steps


async def test_sglang_engine_against_fake_server_stream_across_an_update_reports_both_versions_per_token(
    engine: EngineController, model_dir: Path, tmp_path: Path
):
    weights = perturbed_weights(model_dir, tmp_path / "v1.safetensors", 1)
    deltas = []
    async for delta in engine.generate(req([5, 6], max_tokens=60, temperature=0.0, ignore_eos=True, stream=True)):
        deltas.append(delta)
        if len(deltas) == 10:
            await engine.update_weights(1, str(weights), resume=True)
    result = Result(deltas)
    per_chunk = SpanBuilder()
    for d in deltas:
        per_chunk.add(len(d.token_ids), d.weight_version or 0)
    # The chunks' own versions and SGLang's exact spans on the last chunk agree.
    assert deltas[-1].weight_versions is not None
    assert result.spans == [(s.version, s.start, s.end) for s in per_chunk.spans]
    ((v0, s0, e0), (v1, s1, e1)) = result.spans
    assert (v0, s0, v1, e1) == (0, 0, 1, 60) and 10 <= e0 == s1 < 60


async def test_sglang_engine_against_fake_server_refused_sampling_is_a_value_error(engine: EngineController):
    for stream in (False, True):  # a 400, or in a stream SGLang's error event
        with pytest.raises(ValueError, match=r"repetition_penalty must be in \(0, 2\]"):
            await generate(engine, req(repetition_penalty=3.0, stream=stream))
    assert (await generate(engine, greedy(2, stream=True))).token_ids


# -- bodies and error mapping (canned answers) -----------------------------------------------


def test_sglang_start_profile_body_maps_tools_and_options(tmp_path: Path):
    body = start_profile_body("step2", ProfileOptions(activities=["cpu", "cuda"], max_forward_steps=5), tmp_path)
    sent = body.model_dump(exclude_none=True)
    assert sent == {
        "output_dir": str(tmp_path),
        "profile_prefix": "step2",
        "activities": ["CPU", "GPU"],
        "num_steps": 5,
        "with_stack": False,  # SGLang turns both on when absent
        "record_shapes": False,
    }
    assert "num_steps" not in start_profile_body("s", ProfileOptions(max_forward_steps=None), tmp_path).model_dump(
        exclude_none=True
    )
    assert start_profile_body("s", ProfileOptions(tool="nsys"), tmp_path).activities == ["CUDA_PROFILER"]
    npu = start_profile_body("step9", ProfileOptions(tool="npu"), tmp_path)
    assert npu.output_dir == str(tmp_path / "step9-ascend")
    # What SGLang cannot record is refused by the engine's option rules, before any body is built.
    npu_settings = ProfileOptions(tool="npu", npu=NpuOptions(level="level2"))
    with pytest.raises(ValueError, match=re.escape("profiler.npu")):
        SglangOptions.check_profiler(npu_settings, npu_settings)
    with pytest.raises(ValueError, match="with_memory"):
        SglangOptions.check_profiler(ProfileOptions(with_memory=True), ProfileOptions())


def test_sglang_generate_body_maps_every_sampling_field():
    spec = SamplingSpec(
        max_tokens=9,
        temperature=0.7,
        top_p=0.9,
        top_k=50,
        min_p=0.05,
        seed=3,
        stop=["\n\n", "END"],
        stop_token_ids=[2, 7],
        min_tokens=0,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logprobs=2,
        prompt_logprobs=4,
        include_stop_str_in_output=True,
    )
    sent = generate_body(
        GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=spec, stream=True, cache_salt="v7", request_id="r1")
    ).model_dump(exclude_none=True)
    assert sent == {
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "max_new_tokens": 9,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 50,
            "min_p": 0.05,
            "sampling_seed": 3,
            "stop": ["\n\n", "END"],
            "stop_token_ids": [2, 7],
            "ignore_eos": False,
            "min_new_tokens": 0,
            "repetition_penalty": 1.2,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "no_stop_trim": True,
        },
        "stream": True,
        "return_logprob": True,
        "top_logprobs_num": 4,  # one count in SGLang for output and prompt: the larger, each cut to its own
        "logprob_start_len": 0,
        "cache_salt": "v7",  # SGLang's own field (GenerateReqInput.cache_salt)
        "rid": "r1",  # the sequence's id, which /abort_request names
    }


def test_sglang_generate_body_defaults_change_nothing_in_sglang():
    sent = generate_body(req(max_tokens=5, min_tokens=2, ignore_eos=True)).model_dump(exclude_none=True)
    params = sent.pop("sampling_params")
    assert sent.pop("rid"), "every sequence is sent with its id, which /abort_request names"
    assert sent == {"input_ids": [5, 6, 7, 8], "stream": False, "return_logprob": False}
    assert params["top_k"] == -1 and "sampling_seed" not in params and "stop" not in params
    assert "stop_token_ids" not in params and params["min_new_tokens"] == 2 and params["ignore_eos"] is True
    only_output = generate_body(req(logprobs=0)).model_dump(exclude_none=True)
    assert only_output["return_logprob"] is True and "top_logprobs_num" not in only_output
    assert "logprob_start_len" not in only_output


@pytest.mark.parametrize(
    ("sampling", "named"),
    [({"ignore_eos": True, "stop_token_ids": [3]}, "ignore_eos"), ({"min_tokens": 2, "stop": ["x"]}, "min_tokens")],
)
def test_sglang_generate_body_refuses_what_sglang_would_do_otherwise(sampling, named):
    with pytest.raises(ValueError, match=f"engine 'sglang' cannot honour .*{named}"):
        generate_body(req(**sampling))


def chunk(output_ids: list[int], total: int, finish: dict | None = None, **meta) -> GenerateChunk:
    return GenerateChunk.model_validate(
        {"output_ids": output_ids, "meta_info": {"completion_tokens": total, "finish_reason": finish, **meta}}
    )


def logprob_meta(lps: list[float], ids: list[int]) -> dict:
    return {
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)],
        "output_top_logprobs": [[[lp, t, None], [lp - 1, t + 1, None]] for lp, t in zip(lps, ids, strict=True)],
    }


def test_sglang_chunk_reader_reads_cumulative_and_incremental_streams_alike():
    request = req(logprobs=1, stream=True)
    ids, lps = [11, 12, 13], [-0.1, -0.2, -0.3]
    done = {"type": "length", "length": 3}
    cumulative = [
        chunk(ids[:1], 1, weight_version="default", **logprob_meta(lps[:1], ids[:1])),
        chunk(ids[:3], 3, weight_version="1", **logprob_meta(lps[:3], ids[:3])),
        chunk(
            ids[:3],
            3,
            done,
            weight_version="1",
            **logprob_meta(lps[:3], ids[:3]),
            weight_versions=[{"version": "default", "start": 0, "end": 1}, {"version": "1", "start": 1, "end": 3}],
        ),
    ]
    incremental = [
        chunk(ids[:1], 1, weight_version="default", **logprob_meta(lps[:1], ids[:1])),
        chunk(ids[1:3], 3, weight_version="1", **logprob_meta(lps[1:3], ids[1:3])),
        chunk(
            [],
            3,
            done,
            weight_version="1",
            **logprob_meta([], []),
            weight_versions=[{"version": "default", "start": 0, "end": 1}, {"version": "1", "start": 1, "end": 3}],
        ),
    ]
    results = []
    for chunks in (cumulative, incremental):
        reader = ChunkReader(request, "http://sglang.test")
        results.append(Result([reader.read(c) for c in chunks]))
        assert reader.finished
    for r in results:
        assert [d.token_ids for d in r.deltas] == [[11], [12, 13], []]
        assert [lp.logprob for lp in r.logprobs] == lps and all(
            list(lp.top) == [t] for lp, t in zip(r.logprobs, ids, strict=True)
        )
        # SGLang's launch label ("default") is our version 0; the exact spans come on the last chunk.
        assert [d.weight_version for d in r.deltas] == [0, 1, 1] and r.spans == [(0, 0, 1), (1, 1, 3)]
        assert r.finish_reason == "length" and r.stop_reason is None


@pytest.mark.parametrize(
    ("finish", "reason", "stop_reason"),
    [
        ({"type": "stop", "matched": "END"}, "stop", "END"),
        ({"type": "stop", "matched": 7}, "stop", 7),
        ({"type": "stop", "matched": 2}, "stop", None),  # EOS: not one of the request's stop tokens
        ({"type": "length", "length": 1}, "length", None),
    ],
)
def test_sglang_chunk_reader_maps_finish_reasons(finish, reason, stop_reason):
    reader = ChunkReader(req(stop=["END"], stop_token_ids=[7]), "http://sglang.test")
    delta = reader.read(chunk([7], 1, finish, weight_version="3"))
    assert (delta.finish_reason, delta.stop_reason, delta.weight_version) == (reason, stop_reason, 3)


def test_sglang_chunk_reader_aborts_and_unreadable_streams_are_errors():
    abort = {"type": "abort", "message": "Abort in waiting queue", "status_code": None}
    with pytest.raises(SglangError, match="aborted the request: Abort in waiting queue"):
        ChunkReader(req(), "http://sglang.test").read(chunk([], 0, abort))
    refused = {"type": "abort", "message": "input too long", "status_code": 400}
    with pytest.raises(ValueError, match="input too long"):
        ChunkReader(req(), "http://sglang.test").read(chunk([], 0, refused))
    reader = ChunkReader(req(), "http://sglang.test")
    reader.read(chunk([1, 2], 2))
    with pytest.raises(SglangError, match="not a stream this adapter can read"):
        reader.read(chunk([3, 4, 5, 6], 3))
    with pytest.raises(SglangError, match="1 logprobs"):
        ChunkReader(req(logprobs=0), "http://sglang.test").read(chunk([1, 2], 2, **logprob_meta([-1.0], [1])))


def test_sglang_sse_lines_parse_as_sglang_writes_them():
    assert parse_sse_line('data: {"output_ids": [1]}') == {"output_ids": [1]}
    assert parse_sse_line("") is None and parse_sse_line(": keep-alive") is None
    assert parse_sse_line("data: [DONE]") is not None and not isinstance(parse_sse_line("data: [DONE]"), dict)


async def test_sglang_client_stream_yields_events_until_done_and_raises_error_events():
    def events(*lines: str) -> httpx.MockTransport:
        body = "".join(f"{line}\n\n" for line in lines).encode()
        return httpx.MockTransport(
            lambda request: httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
        )

    body = generate_body(greedy(2, stream=True))
    client = SglangClient(
        "http://sglang.test",
        timeout_s=5,
        transport=events('data: {"a": 1}', 'data: {"a": 2}', "data: [DONE]", 'data: {"a": 3}'),
    )
    assert [e async for e in client.stream("/generate", body)] == [{"a": 1}, {"a": 2}]
    await client.aclose()
    error = 'data: {"error": {"message": "top_p must be in (0, 1]", "code": 400}}'
    client = SglangClient("http://sglang.test", timeout_s=5, transport=events(error, "data: [DONE]"))
    with pytest.raises(SglangError, match=r"streamed an error on POST /generate: top_p") as err:
        [e async for e in client.stream("/generate", body)]
    assert err.value.status == 400
    await client.aclose()
    client = SglangClient(
        "http://sglang.test",
        timeout_s=5,
        transport=httpx.MockTransport(
            lambda request: httpx.Response(400, json={"error": "sampling_params: unknown field `topk`"})
        ),
    )
    with pytest.raises(SglangError, match="HTTP 400: sampling_params: unknown field `topk`") as err:
        [e async for e in client.stream("/generate", body)]
    assert err.value.status == 400
    await client.aclose()


@pytest.mark.parametrize(
    ("status", "kwargs", "expected"),
    [
        (400, {"json": {"error": {"message": "input_ids cannot be empty."}}}, "input_ids cannot be empty."),
        (
            400,
            {"json": {"object": "error", "message": "1 validation error: mode", "type": "Bad Request", "code": 400}},
            "1 validation error: mode",
        ),
        (
            400,
            {"json": {"success": False, "message": "Failed to update weights: x", "num_paused_requests": 0}},
            "Failed to update weights: x",
        ),
        (404, {"json": {"detail": "Not Found"}}, "Not Found"),
        (500, {"text": "Internal Server Error"}, "RuntimeError: Profiling is not in progress"),
    ],
)
async def test_sglang_client_error_names_url_route_status_and_sglang_message(status, kwargs, expected):
    transport = httpx.MockTransport(lambda request: httpx.Response(status, **kwargs))
    client = SglangClient(
        "http://sglang.test:30000/",
        timeout_s=5,
        log_tail=lambda: "Traceback ...\nRuntimeError: Profiling is not in progress. Call /start_profile first.",
        transport=transport,
    )
    with pytest.raises(SglangError) as err:
        await client.call("/stop_profile")
    message = str(err.value)
    assert err.value.status == status
    for part in ("SGLang at http://sglang.test:30000", "POST /stop_profile", f"HTTP {status}", expected):
        assert part in message, message
    assert ("last server log lines" in message) == (status >= 500)
    await client.aclose()


async def test_sglang_client_unreachable_server_is_named_and_remembered():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Connection refused", request=request)

    client = SglangClient("http://127.0.0.1:9", timeout_s=5, transport=httpx.MockTransport(refuse))
    with pytest.raises(SglangError, match=r"SGLang at http://127.0.0.1:9 did not answer POST /generate .*ConnectError"):
        await client.call("/generate")
    assert client.unreachable and "Connection refused" in client.unreachable
    await client.aclose()


async def test_sglang_client_unreadable_answer_is_an_error_not_a_crash():
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json={"text": "no output_ids here"}))
    client = SglangClient("http://sglang.test", timeout_s=5, transport=transport)
    with pytest.raises(SglangError, match="cannot read"):
        await client.call_for("/generate", None, GenerateChunk)
    await client.aclose()


# -- launching a server -----------------------------------------------------------------------


def test_sglang_server_that_exits_at_startup_reports_its_code_and_log(tmp_path: Path):
    command = [sys.executable, "-c", "import sys; sys.stderr.write('no CUDA device found\\n'); sys.exit(3)"]
    server = SglangServer(command, [], tmp_path / "model", tmp_path / "server.log")
    with pytest.raises(RuntimeError) as err:
        wait_ready(server.url, 30, server)
    assert "exited with code 3" in str(err.value) and "no CUDA device found" in str(err.value)
    assert "--model-path" in str(err.value) and "--port" in str(err.value)


def test_sglang_server_not_ready_in_time_is_reported_and_terminated(tmp_path: Path):
    command = [sys.executable, "-c", "import time; print('loading weights', flush=True); time.sleep(60)"]
    server = SglangServer(command, ["--tp-size", "1"], tmp_path / "model", tmp_path / "server.log")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"not ready within 1s .*startup_timeout_s") as err:
        wait_ready(server.url, 1, server)
    assert time.monotonic() - t0 < 10
    assert "loading weights" in str(err.value)
    server.terminate()
    assert not server.alive() and server.returncode() is not None


def test_sglang_server_command_that_does_not_exist_names_the_setting(tmp_path: Path):
    with pytest.raises(RuntimeError, match=re.escape("sglang.server_command")):
        SglangServer([str(tmp_path / "no-such-sglang")], [], tmp_path, tmp_path / "server.log")


# -- the trainer's own transfer: SGLang's distributed update through engine_rpc -----------------


TRAINER = """
import sys
import torch.distributed as dist
from safetensors.torch import load_file
from fakes.fake_sglang_weight_group import init_custom_process_group

state = load_file(sys.argv[2])
group = init_custom_process_group(
    backend="gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", world_size=2, rank=0, group_name="g"
)
for tensor in state.values():
    dist.broadcast(tensor, src=0, group=group)
sys.stdin.readline()  # the server's side is gone: the group (and the store this rank hosts) may go
dist.destroy_process_group(group)
"""
"""Rank 0 of the weight-update group: a trainer process (torch keeps one registry of group names
per process, so it cannot share this one with the in-process fake), formed as SGLang forms it."""


async def move_by_distributed_update(engine: EngineController, weights: Path, version: str | None) -> None:
    """What a trainer does through the app's engine_rpc (docs/examples/byo_sglang_transfer.py)."""
    import subprocess

    state = load_file(str(weights))
    port = free_port()
    tests_dir = str(Path(__file__).resolve().parents[3])
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(port), str(weights)], cwd=tests_dir, stdin=subprocess.PIPE, text=True
    )
    try:
        answer = await engine.engine_rpc(
            "init_weights_update_group",
            master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, group_name="g",
            backend="gloo",
        )  # fmt: skip
        assert answer == {"success": True, "message": "Succeeded to initialize custom process group."}
        await engine.engine_rpc("begin_weight_update")
        meta = {
            "names": list(state),
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in state.values()],
            "shapes": [list(t.shape) for t in state.values()],
        }
        await engine.engine_rpc(
            "update_weights_from_distributed", {**meta, "group_name": "g", "weight_version": version}
        )
        await engine.engine_rpc("end_weight_update")
        await engine.engine_rpc("destroy_weights_update_group", group_name="g")
        assert await asyncio.to_thread(trainer.communicate, "done\n", 60) and trainer.returncode == 0
    finally:
        trainer.kill()


async def test_sglang_engine_against_fake_server_adopts_a_version_the_trainer_moved_by_sglangs_own_update(
    engine: EngineController, fake: tuple[str, Scheduler], model_dir: Path, tmp_path: Path, spec
):
    """A continuous window across the trainer's own transfer: SGLang's recording is split at the
    adopted version, as for a load from disk, and the fake holds the trainer's tensors."""
    weights = perturbed_weights(model_dir, tmp_path / "v1.safetensors", 1)
    state = load_file(str(weights))
    assert await engine.start_profile(spec(1, steps=[1, 2], max_forward_steps=None))
    before = await generate(engine, greedy(3))
    await engine.stop_profile(None, pause=True)  # the sync's hold
    with pytest.raises(ValueError, match="reports weight version 0, not 1"):
        await engine.adopt_weights(1, resume=False)
    await move_by_distributed_update(engine, weights, "1")
    await engine.adopt_weights(1, resume=True)
    assert engine.weight_version == 1 and not engine.status().paused
    after = await generate(engine, greedy(4))
    await engine.stop_profile(1, pause=True)
    entry = await engine.wait_exported(1, 30)
    assert entry is not None and entry.status == "ok", entry
    assert [SGLANG_DIALECT.file_version_of(Path(f).name) for f in entry.files] == [0, 1], entry.files
    assert entry.trace_dialect == SGLANG_DIALECT
    assert before.spans == [(0, 0, 3)] and after.spans == [(1, 0, 4)]
    served = fake[1].model.state_dict()
    assert all(torch.equal(served[name], tensor) for name, tensor in state.items())


async def test_sglang_engine_against_fake_server_a_transfer_without_weight_version_is_not_adopted(
    engine: EngineController, model_dir: Path, tmp_path: Path
):
    await move_by_distributed_update(engine, perturbed_weights(model_dir, tmp_path / "v1.safetensors", 1), None)
    with pytest.raises(ValueError, match="the engine reports weight version 0, not 1"):
        await engine.adopt_weights(1, resume=True)
    assert engine.weight_version == 0


async def test_sglang_engine_rpc_refusals_name_the_cause(engine: EngineController):
    with pytest.raises(ValueError, match=r"'update_weights_from_disk' is not allowed.*init_weights_update_group"):
        await engine.engine_rpc("update_weights_from_disk", model_path="/x")
    with pytest.raises(
        SglangError, match="refused update_weights_from_distributed: update_weights_from_distributed must run between"
    ):
        await engine.engine_rpc("update_weights_from_distributed", names=["a"], dtypes=["float32"], shapes=[[1]])
    with pytest.raises(
        SglangError, match="refused destroy_weights_update_group: The group to be destroyed does not exist"
    ):
        await engine.engine_rpc("destroy_weights_update_group", group_name="none")


def test_sglang_rpc_bodies_are_sglangs_fields_checked():
    from serve_app.engines.sglang.engine import rpc_body

    group = {"master_address": "10.0.0.1", "master_port": 29500, "world_size": 3}
    body = rpc_body("init_weights_update_group", (), {**group, "rank_offset": 2})
    assert body.model_dump() == {**group, "rank_offset": 2, "group_name": "weight_update_group", "backend": "nccl"}
    with pytest.raises(ValueError, match="rank_offset 3 is outside a group of world_size 3"):
        rpc_body("init_weights_update_group", (), {**group, "rank_offset": 3})
    meta = {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1], [2]]}
    with pytest.raises(ValueError, match="one entry per tensor: got 2, 1 and 2"):
        rpc_body("update_weights_from_distributed", ({**meta},), {})
    meta["dtypes"] = ["float32", "float32"]
    with pytest.raises(ValueError, match=r"weight_version.*non-negative integer"):
        rpc_body("update_weights_from_distributed", (), {**meta, "weight_version": "v3"})
    with pytest.raises(ValueError, match="flush_cache"):
        rpc_body("update_weights_from_distributed", (), {**meta, "flush_cache": False})
    with pytest.raises(ValueError, match="abort_all_requests: Extra inputs"):
        rpc_body("update_weights_from_distributed", (), {**meta, "abort_all_requests": True})
    body = rpc_body("update_weight_version", (), {"new_version": 4})
    assert body.model_dump() == {"new_version": "4", "abort_all_requests": False}


def test_a_per_replica_argument_gives_each_replica_its_own_value():
    """engine_rpc's one handle call reaches every replica alike: a PerReplica picks by replica id."""
    from serve_app.api import PerReplica

    offsets = PerReplica(values={"r-a": 1, "r-b": 2})
    assert (offsets.pick("r-a"), offsets.pick("r-b")) == (1, 2)
    with pytest.raises(ValueError, match=r"names no value for replica r-c \(it names \['r-a', 'r-b'\]\)"):
        offsets.pick("r-c")
