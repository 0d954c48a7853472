"""Aborts behind the real engine controller (serve_app/engines/controller.py): the embedded engine
ends the sequences an abort names between two engine steps, each with finish_reason 'abort' and
the tokens sampled so far on their weight versions; a client's abort pause ends what arrives
meanwhile too; an engine without `Capability.ABORT` is refused naming the engine and mode keep;
and SGLang's answer to an abort is read as the app's abort only where the app asked for it, from
the FAKE SGLang server (tests/fakes, NOT SGLang) for a running request and for one its retract
pause set aside."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

import pytest
from support.engines import replica_sessions

from serve_app.config import AppArgs
from serve_app.control.capabilities import require
from serve_app.control.client_pause import KEEP_INSTEAD
from serve_app.engines import create_engine
from serve_app.engines.adapter import EngineAdapter
from serve_app.engines.controller import EngineController
from serve_app.engines.generation import GenerateDelta, GenerateRequest, SamplingSpec, WeightVersionSpan
from serve_app.engines.options import Capability, CapabilityMissing, EngineOptions
from serve_app.engines.registry import ENGINE_OPTIONS
from serve_app.engines.sglang.client import GenerateChunk, SglangError
from serve_app.engines.sglang.engine import ChunkReader
from serve_app.engines.transformers.engine import TransformersEngine
from serve_app.errors import Refused
from unit.engines.sglang.test_engine import open_engine, serve_fake

LONG = 400  # output tokens: far more than a test waits for (the tiny model's context is 512)


@pytest.fixture
async def engine(store, exporter, model_dir, tmp_path) -> AsyncIterator[EngineController]:
    e = EngineController(
        TransformersEngine,
        args=AppArgs(engine="transformers"),
        model_dir=model_dir,
        session_factory=replica_sessions(store, exporter, "a0"),
        trace_dir=tmp_path / "engine",
    )
    await e.opened()
    yield e
    await e.shutdown()


def request(engine: EngineController, names: list[str], stream: bool, max_tokens: int = LONG) -> GenerateRequest:
    return GenerateRequest(
        prompt_token_ids=engine.tokenizer.tokenize("One two"),
        sampling=SamplingSpec(max_tokens=max_tokens, ignore_eos=True),
        stream=stream,
        names=names,
    )


class Run:
    """One sequence generated in the background: its deltas as they come."""

    def __init__(self, engine: EngineController, req: GenerateRequest):
        self.deltas: list[GenerateDelta] = []
        self.task = asyncio.ensure_future(self._run(engine, req))

    async def _run(self, engine: EngineController, req: GenerateRequest) -> None:
        async for delta in engine.generate(req):
            self.deltas.append(delta)

    @property
    def tokens(self) -> int:
        return sum(len(d.token_ids) for d in self.deltas)

    def spans(self) -> list[tuple[int, int, int]]:
        """(version, start, end) of the output's runs, from each delta's version."""
        out: list[tuple[int, int, int]] = []
        for d in self.deltas:
            if d.token_ids:
                assert d.weight_version is not None
                start = out[-1][2] if out else 0
                if out and out[-1][0] == d.weight_version:
                    out[-1] = (d.weight_version, out[-1][1], start + len(d.token_ids))
                else:
                    out.append((d.weight_version, start, start + len(d.token_ids)))
        return out


async def forwards(engine: EngineController, more: int) -> None:
    """Wait until the engine ran `more` forward passes beyond now."""
    target = sum(engine.status().forward_steps_by_version.values()) + more
    while sum(engine.status().forward_steps_by_version.values()) < target:
        await asyncio.sleep(0.01)


async def test_an_abort_ends_the_named_sequences_with_the_tokens_so_far_on_their_versions(engine, model_dir):
    # Queued while the engine is held, so that all three join one batch (a later one would wait
    # for the running batch to end).
    await engine.client_hold(60.0)
    whole = Run(engine, request(engine, ["cmpl-a", "cmpl-a-0"], stream=False))
    streamed = Run(engine, request(engine, ["cmpl-b", "cmpl-b-0"], stream=True))
    other = Run(engine, request(engine, ["cmpl-c", "cmpl-c-0"], stream=True))
    while engine.status().requests_in_flight < 3:
        await asyncio.sleep(0.01)
    await engine.client_release()
    await forwards(engine, 5)
    # A weight update between engine steps: the aborted output spans both versions.
    await engine.update_weights(1, str(model_dir / "model.safetensors"), resume=True)
    await forwards(engine, 5)

    assert await engine.abort(["cmpl-a", "cmpl-b-0", "cmpl-unknown"]) == 2
    await asyncio.wait_for(asyncio.gather(whole.task, streamed.task), 30)
    assert [d.finish_reason for d in whole.deltas] == [None, "abort"], "one delta per version, the last says abort"
    assert 10 <= whole.tokens < LONG
    versions = whole.spans()
    assert [v for v, _, _ in versions] == [0, 1] and versions[-1][2] == whole.tokens, versions
    assert streamed.deltas[-1].finish_reason == "abort" and not streamed.deltas[-1].token_ids
    assert [d.finish_reason for d in streamed.deltas[:-1]] == [None] * (len(streamed.deltas) - 1)
    assert 10 <= streamed.tokens < LONG and [v for v, _, _ in streamed.spans()] == [0, 1]

    sampled = other.tokens
    await forwards(engine, 3)
    assert other.tokens > sampled and not other.task.done(), "a sequence no abort named runs on"
    assert await engine.abort(["cmpl-a"]) == 0, "an abort of what already ended ends nothing"
    assert await engine.abort(["cmpl-c-0"]) == 1
    await asyncio.wait_for(other.task, 30)
    assert other.deltas[-1].finish_reason == "abort" and other.tokens < LONG
    assert engine.status().requests_in_flight == 0


async def test_an_abort_of_everything_and_a_client_abort_pause_end_what_arrives_meanwhile(engine):
    running = [Run(engine, request(engine, [f"cmpl-{i}"], stream=True)) for i in range(3)]
    await forwards(engine, 3)
    assert await engine.abort(None) == 3
    await asyncio.wait_for(asyncio.gather(*(r.task for r in running)), 30)
    assert all(r.deltas[-1].finish_reason == "abort" for r in running)

    before = Run(engine, request(engine, ["cmpl-d"], stream=False))
    await forwards(engine, 2)
    assert await engine.client_abort(for_s=30.0) == 1 and engine.client_aborting
    await asyncio.wait_for(before.task, 30)
    assert before.deltas[-1].finish_reason == "abort" and before.tokens > 0
    # One the replica's gate admitted before the pause reaches the engine after it: it ends at once.
    late = Run(engine, request(engine, ["cmpl-e"], stream=False))
    await asyncio.wait_for(late.task, 30)
    assert [(d.token_ids, d.finish_reason) for d in late.deltas] == [([], "abort")]
    await engine.client_release()
    assert not engine.client_aborting
    after = Run(engine, request(engine, ["cmpl-f"], stream=False, max_tokens=4))
    await asyncio.wait_for(after.task, 30)
    assert after.deltas[-1].finish_reason == "length" and after.tokens == 4


class NoAbortOptions(EngineOptions):
    """A test engine that generates and nothing else: it cannot abort."""

    engine = "no-abort"
    implementation = f"{__name__}:NoAbortEngine"
    capabilities = frozenset({Capability.GENERATE})


class NoAbortEngine(EngineAdapter):
    def open(self, args: AppArgs, model_dir: Path) -> None:
        pass

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        yield GenerateDelta(token_ids=[1], weight_version=0, finish_reason="length")

    def healthy(self) -> bool:
        return True

    async def close(self) -> None:
        pass


async def test_an_engine_that_cannot_abort_is_refused_naming_it_and_mode_keep(
    monkeypatch, model_dir, store, exporter, tmp_path
):
    monkeypatch.setitem(ENGINE_OPTIONS, NoAbortOptions.engine, NoAbortOptions)
    args = AppArgs(engine="no-abort", model_path=str(model_dir))
    # Before any replica is asked (the controller's ClientPauses: /pause?mode=abort, /abort_requests).
    for what in ("mode=abort", "/abort_requests"):
        with pytest.raises(Refused) as refused:
            require(args, Capability.ABORT, what, KEEP_INSTEAD)
        message = str(refused.value)
        assert refused.value.status == 422 and message.startswith(what), message
        assert "engine no-abort" in message and "'abort'" in message and "mode=keep" in message, message
    # And by the replica's engine controller itself.
    engine = create_engine(args, replica_sessions(store, exporter, "n0"), "n0", trace_root=tmp_path / "traces")
    with pytest.raises(CapabilityMissing, match=r"engine no-abort.*'abort'"):
        await engine.abort(None)
    with pytest.raises(CapabilityMissing, match=r"engine no-abort.*'abort'"):
        await engine.client_abort(10.0)
    assert not engine.client_aborting, "a refused abort pause ends nothing that arrives"
    await engine.shutdown()


def chunk(ids: list[int], completion_tokens: int, finish: dict | None = None) -> GenerateChunk:
    meta = {"completion_tokens": completion_tokens, "finish_reason": finish, "weight_version": "2"}
    return GenerateChunk.model_validate({"output_ids": ids, "meta_info": meta})


def sglang_request() -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=[1, 2], sampling=SamplingSpec(max_tokens=50), stream=True)


def test_sglangs_abort_is_the_apps_abort_only_where_the_app_asked_for_it():
    aborted = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    # A running request: its last forward's token comes with the abort.
    reader = ChunkReader(sglang_request(), "http://sglang.test", lambda: True)
    assert reader.read(chunk([5, 6], 2)).token_ids == [5, 6]
    last = reader.read(chunk([5, 6, 7], 3, aborted))
    assert (last.token_ids, last.finish_reason, last.weight_version) == ([7], "abort", 2) and reader.finished
    # One off the running batch: the echo brings no new token (an incremental stream repeats the last).
    echo = {"type": "abort", "message": "Abort in waiting queue"}
    for ids in ([5, 6], [6]):
        reader = ChunkReader(sglang_request(), "http://sglang.test", lambda: True)
        reader.read(chunk([5, 6], 2))
        last = reader.read(chunk(ids, 2, echo))
        assert (last.token_ids, last.finish_reason) == ([], "abort")
    # Unasked, or with SGLang's own status (a timeout, a refusal), an abort is SGLang's failure.
    with pytest.raises(SglangError, match="aborted the request: Aborted"):
        ChunkReader(sglang_request(), "http://sglang.test").read(chunk([5], 1, aborted))
    with pytest.raises(SglangError, match="aborted the request: too slow"):
        timed_out = {"type": "abort", "message": "too slow", "status_code": 503}
        ChunkReader(sglang_request(), "http://sglang.test", lambda: True).read(chunk([5], 1, timed_out))


async def test_sglang_ends_a_running_request_and_one_its_pause_set_aside_with_their_tokens(model_dir, tmp_path):
    def long(names: list[str], stream: bool) -> GenerateRequest:
        sampling = SamplingSpec(max_tokens=300, temperature=0.0, ignore_eos=True)
        return GenerateRequest(prompt_token_ids=[5, 6], sampling=sampling, stream=stream, names=names)

    with serve_fake(model_dir) as (url, scheduler):
        async with open_engine(url, model_dir, tmp_path) as engine:
            running = Run(engine, long(["r"], stream=True))
            held = Run(engine, long(["h"], stream=False))
            while running.tokens < 3:
                await asyncio.sleep(0.01)
            # Running: SGLang ends it after one more forward, whose token it keeps.
            assert await engine.abort(["r"]) == 1
            await asyncio.wait_for(running.task, 30)
            assert running.deltas[-1].finish_reason == "abort" and 3 <= running.tokens < 300
            # Set aside by the replica's retract pause: echoed at once with every token it had.
            await engine.client_hold(30.0)
            assert await engine.abort(["h"]) == 1
            await asyncio.wait_for(held.task, 30)
            assert [d.finish_reason for d in held.deltas] == ["abort"] and 0 < held.tokens < 300
            assert held.deltas[0].weight_versions == [WeightVersionSpan(version=0, start=0, end=held.tokens)]
            await engine.client_release()
            assert scheduler.live_requests() == 0
