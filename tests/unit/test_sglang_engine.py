"""The SGLang engine adapter against the FAKE SGLang server (tests/fakes, NOT SGLang) run in this
process, its error mapping against canned answers (httpx.MockTransport), and the server launcher
against small stand-in commands. Nothing here ran against a real SGLang server."""

from __future__ import annotations

import asyncio
import gzip
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

from profiling.config import NpuOptions, ProfileOptions
from profiling.manifest import ManifestEntry
from profiling.session import ProfileSession, SessionSpec
from profiling.store import TraceStore
from serve_app.config import AppArgs
from serve_app.engines.base import GenerateRequest
from serve_app.engines.options import SglangOptions
from serve_app.engines.sglang_client import (
    GenerateAnswer,
    PauseGenerationBody,
    SglangClient,
    SglangError,
)
from serve_app.engines.sglang_engine import SglangEngine, SglangProfiler, start_profile_body
from serve_app.engines.sglang_server import SglangServer, wait_ready
from serve_app.net import free_port
from serve_app.weights import WeightsError

RID = "replica-0"
TRACE_NAME = re.compile(r"^step(\d+)(-[A-Za-z0-9._-]+)?-[0-9.]+-TP-0\.trace\.json\.gz$")


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture
def fake_url(model_dir: Path) -> Iterator[str]:
    """A FAKE SGLang server (strict about request fields) served from a thread of this process."""
    # Paced at 3 ms per batch: the long requests below are still running when a test acts on them.
    app = build_app(Scheduler(model_dir, step_delay_s=0.003), strict_fields=True)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, 60)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture
async def engine(fake_url: str, model_dir: Path, tmp_path: Path) -> AsyncIterator[SglangEngine]:
    args = AppArgs(engine="sglang", num_replicas=1, save_path=str(tmp_path / "traces"), sglang={"url": fake_url})
    exporter = ThreadPoolExecutor(1, thread_name_prefix="export")

    def session(backend_factory):
        return ProfileSession(
            store=TraceStore(args.save_path),
            entry_identity=ManifestEntry(role="rollout", replica_id=RID, node_id="node-0"),
            exporter=exporter,
            backend_factory=backend_factory,
        )

    eng = await asyncio.to_thread(
        SglangEngine,
        args=args,
        model_dir=model_dir,
        session_factory=session,
        trace_dir=Path(args.save_path) / ".engine" / RID,
    )
    try:
        yield eng
    finally:
        await eng.shutdown()
        exporter.shutdown(wait=True)


def profiler(engine: SglangEngine, spec: SessionSpec) -> SglangProfiler:
    """A recording of the engine's profiler, driven by hand (the session drives it otherwise)."""
    return SglangProfiler(spec, client=engine._client, trace_dir=engine.trace_dir, loop=asyncio.get_running_loop())


def greedy(n: int = 4) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=[5, 6, 7, 8], max_tokens=n, temperature=0.0)


def run_batch_ranges(path: Path) -> int:
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return sum(1 for e in events if e.get("name") == "run_batch" and e.get("cat") == "user_annotation")


def perturbed_weights(model_dir: Path, out: Path, seed: int) -> Path:
    gen = torch.Generator().manual_seed(seed)
    state = {k: (v + 0.05 * torch.randn(v.shape, generator=gen)).contiguous() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    save_file(state, str(out))
    return out


# -- the adapter against the fake server ------------------------------------------------------


async def test_sglang_engine_against_fake_server_records_a_step_into_its_prefixed_trace(engine: SglangEngine, spec):
    assert await engine.start_profile(spec(3, max_forward_steps=None))
    results = [await engine.generate(greedy(4)), await engine.generate(greedy(3))]
    outcome = await engine.stop_profile(3, pause=False)
    assert outcome.stopped and outcome.step == 3
    entry = await engine.wait_exported(3, 30)
    assert entry is not None and entry.status == "ok", entry
    step_dir = Path(engine.trace_dir).parents[1] / "step_3"
    assert len(entry.files) == 1 and entry.files[0].startswith(f"rollout/{RID}/")
    path = step_dir / entry.files[0]
    assert TRACE_NAME.match(path.name) and TRACE_NAME.match(path.name).group(1) == "3", path.name
    # One run_batch range per engine step: one step per token of these one-at-a-time requests.
    tokens = sum(len(r.token_ids) for r in results)
    assert entry.forward_steps == run_batch_ranges(path) == tokens > 0
    assert not list(engine.trace_dir.iterdir()), "the export leaves the engine's directory empty"
    for r in results:
        assert len(r.logprobs) == len(r.token_ids) and all(lp <= 0 for lp in r.logprobs)
        assert r.weight_versions == [0] and r.finish_reason in ("stop", "length")


async def test_sglang_engine_against_fake_server_num_steps_cap_then_stop_is_a_clean_stop(engine: SglangEngine, spec):
    """SGLang stops by itself after num_steps; our later stop gets its bare 500 and finds the trace."""
    await engine.start_profile(spec(4, max_forward_steps=2, tag="capped"))
    await engine.generate(greedy(5))
    outcome = await engine.stop_profile(4, pause=False)
    entry = await engine.wait_exported(4, 30)
    assert outcome.stopped and entry is not None and entry.status == "ok", entry
    assert entry.forward_steps == 2
    assert Path(entry.files[0]).name.startswith("step4-capped-")


async def test_sglang_engine_against_fake_server_refused_profiler_calls_name_url_route_and_status(
    engine: SglangEngine, spec
):
    await profiler(engine, spec(7))._engine_start()
    with pytest.raises(SglangError) as err:
        await profiler(engine, spec(7))._engine_start()
    message = str(err.value)
    assert err.value.status == 500
    for part in (engine._client.url, "POST /start_profile", "HTTP 500", "Internal Server Error", "server log"):
        assert part in message, message
    await profiler(engine, spec(7))._engine_stop()
    with pytest.raises(SglangError, match="POST /stop_profile with HTTP 500"):
        await engine._client.call("/stop_profile", own_connection=True)
    # uvicorn closes the connection of a refused call: on a connection of its own, the next call
    # (on the pool) is unaffected.
    assert (await engine.generate(greedy(2))).token_ids


async def test_sglang_engine_against_fake_server_weight_update_sets_version_and_changes_outputs(
    engine: SglangEngine, model_dir: Path, tmp_path: Path
):
    before = await engine.generate(greedy(4))
    load_s = await engine.update_weights(1, str(perturbed_weights(model_dir, tmp_path / "v1.safetensors", 1)), resume=True)
    assert load_s > 0 and engine.weight_version == 1
    after = await engine.generate(greedy(4))
    assert after.weight_versions == [1] and after.logprobs != before.logprobs
    async with httpx.AsyncClient() as http:
        info = (await http.get(f"{engine._client.url}/model_info")).json()
    assert info["weight_version"] == "1"
    assert not engine.status().paused


async def test_sglang_engine_against_fake_server_bad_weights_raise_and_the_old_version_serves(
    engine: SglangEngine, tmp_path: Path
):
    bad = tmp_path / "bad.safetensors"
    save_file({"not.a.model.weight": torch.zeros(2)}, str(bad))
    # The engine base refuses it from its headers, before SGLang is asked or generation paused.
    with pytest.raises(WeightsError, match="does not fit the served model"):
        await engine.update_weights(1, str(bad), resume=True)
    # SGLang's own refusals, reached through the adapter's hook: named with the server's reason.
    with pytest.raises(WeightsError) as err:
        await engine._load_weights(bad, 1)
    assert "Failed to update weights" in str(err.value) and engine._client.url in str(err.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WeightsError, match="Cannot find any model weights"):
        await engine._load_weights(empty, 1)
    assert engine.weight_version == 0
    result = await asyncio.wait_for(engine.generate(greedy(2)), 30)  # still serving, never paused
    assert result.weight_versions == [0]


async def test_sglang_engine_against_fake_server_pause_holds_requests_until_resume(engine: SglangEngine):
    await engine._pause()
    held = asyncio.create_task(engine.generate(greedy(2)))
    await asyncio.sleep(0.5)
    assert not held.done(), "a request ran while generation was paused"
    await engine._resume()
    assert len((await asyncio.wait_for(held, 30)).token_ids) == 2


async def test_sglang_engine_against_fake_server_request_held_across_an_update_reports_the_new_version(
    engine: SglangEngine, model_dir: Path, tmp_path: Path
):
    await engine.stop_profile(None, pause=True)  # the admission hold of a trainer's stop(pause)
    held = asyncio.create_task(engine.generate(greedy(3)))
    await asyncio.sleep(0.3)
    assert not held.done()
    await engine.update_weights(1, str(perturbed_weights(model_dir, tmp_path / "v1.safetensors", 1)), resume=True)
    assert (await asyncio.wait_for(held, 30)).weight_versions == [1]


async def test_sglang_engine_against_fake_server_update_with_requests_in_flight_retracts_them(
    engine: SglangEngine, model_dir: Path, tmp_path: Path
):
    """The retract pause lets the update flush SGLang's cache with requests running (an
    in_place pause would kill the scheduler); the request finishes on the new weights."""
    long = asyncio.create_task(engine.generate(GenerateRequest(prompt_token_ids=[5, 6], max_tokens=300, temperature=0.0)))
    await asyncio.sleep(0.3)
    assert not long.done()
    await engine.update_weights(1, str(perturbed_weights(model_dir, tmp_path / "v1.safetensors", 1)), resume=True)
    result = await asyncio.wait_for(long, 60)
    assert result.weight_versions == [0, 1] and len(result.token_ids) == 300 and engine.healthy()


async def test_sglang_engine_against_fake_server_aborted_request_is_an_error(engine: SglangEngine):
    # Greedy and long (as the retract test above): still running when the abort comes, with no
    # sampled end-of-sequence to finish it first.
    running = asyncio.create_task(engine.generate(GenerateRequest(prompt_token_ids=[5, 6], max_tokens=300, temperature=0.0)))
    await asyncio.sleep(0.2)
    assert not running.done()
    await engine._client.call("/pause_generation", PauseGenerationBody(mode="abort"))
    with pytest.raises(SglangError, match="aborted the request"):
        await asyncio.wait_for(running, 30)
    await engine._resume()


async def test_sglang_engine_against_fake_server_rejects_out_of_range_prompts(engine: SglangEngine):
    with pytest.raises(ValueError, match="out of range"):
        await engine.generate(GenerateRequest(prompt_token_ids=[10**6]))


async def test_sglang_engine_against_fake_server_unhealthy_after_a_lost_call_until_a_probe_answers(engine: SglangEngine):
    assert engine.healthy()
    engine._client.unreachable = "ReadError: connection reset"  # as a failed call leaves it
    assert not engine.healthy()
    await asyncio.wait_for(engine._probe, 10)
    assert engine.healthy()


async def test_sglang_engine_against_fake_server_nsys_stop_already_done_is_read_from_the_server_log(
    engine: SglangEngine,
    spec,
):
    """tool nsys (CUDA_PROFILER) leaves no trace file: that SGLang stopped by itself after
    num_steps shows only in its log. The window is written down as a note for the step."""
    with pytest.raises(SglangError, match="HTTP 500"):  # nothing was recording, and the log does not say so
        await profiler(engine, spec(8, tool="nsys"))._engine_stop()
    engine._client._log_tail = lambda: "RuntimeError: Profiling is not in progress. Call /start_profile first."
    recording = profiler(engine, spec(8, tool="nsys"))
    await recording._engine_stop()
    (note,) = recording.recorded_files()
    assert note.name == "step8-nsys_capture.json"
    assert json.loads(note.read_text())["trace_written_here"] is False

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
    with pytest.raises(ValueError, match="profiler.npu"):
        SglangOptions.check_profiler(npu_settings, npu_settings)
    with pytest.raises(ValueError, match="with_memory"):
        SglangOptions.check_profiler(ProfileOptions(with_memory=True), ProfileOptions())


@pytest.mark.parametrize(
    ("status", "kwargs", "expected"),
    [
        (400, {"json": {"error": {"message": "input_ids cannot be empty."}}}, "input_ids cannot be empty."),
        (400, {"json": {"object": "error", "message": "1 validation error: mode", "type": "Bad Request", "code": 400}}, "1 validation error: mode"),
        (400, {"json": {"success": False, "message": "Failed to update weights: x", "num_paused_requests": 0}}, "Failed to update weights: x"),
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
        await client.call_for("/generate", None, GenerateAnswer)
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
    with pytest.raises(RuntimeError, match="sglang.server_command"):
        SglangServer([str(tmp_path / "no-such-sglang")], [], tmp_path, tmp_path / "server.log")

