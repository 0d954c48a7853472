"""The embedded engine's generation (serve_app/engines/transformers/engine.py) on the real tiny
model: streamed deltas, stops, concurrency, abort, and exact per-token weight versions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support.engines import replica_sessions

from serve_app.config import AppArgs
from serve_app.engines.controller import EngineController
from serve_app.engines.generation import GenerateDelta, GenerateRequest, SamplingSpec
from serve_app.engines.transformers.engine import TransformersEngine


def build(store, exporter, model_dir: Path, tmp_path: Path, max_batch_size: int = 16) -> EngineController:
    return EngineController(
        TransformersEngine,
        args=AppArgs(engine="transformers", transformers={"max_batch_size": max_batch_size}),
        model_dir=model_dir,
        session_factory=replica_sessions(store, exporter, "t0"),
        trace_dir=tmp_path / "engine",
    )


@pytest.fixture
async def engine(store, exporter, model_dir, tmp_path) -> AsyncIterator[EngineController]:
    e = build(store, exporter, model_dir, tmp_path)
    yield e
    await e.shutdown()


PROMPT = "The quick brown fox"


def request(engine: EngineController, stream: bool = True, **spec: object) -> GenerateRequest:
    return GenerateRequest(
        prompt_token_ids=engine.tokenizer.tokenize(PROMPT),
        sampling=SamplingSpec.model_validate({"max_tokens": 16, **spec}),
        stream=stream,
    )


async def collect(engine: EngineController, req: GenerateRequest) -> list[GenerateDelta]:
    return [d async for d in engine.generate(req)]


def tokens(deltas: list[GenerateDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def forwards(engine: EngineController) -> int:
    return sum(engine.status().forward_steps_by_version.values())


async def test_streamed_deltas_concatenate_to_the_one_delta_of_the_same_seeded_request(engine):
    spec = SamplingSpec(max_tokens=12, seed=7, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    prompt = engine.tokenizer.tokenize(PROMPT)
    streamed = await collect(engine, GenerateRequest(prompt_token_ids=prompt, sampling=spec, stream=True))
    whole = await collect(engine, GenerateRequest(prompt_token_ids=prompt, sampling=spec, stream=False))

    assert [len(d.token_ids) for d in streamed] == [1] * 12
    assert len(whole) == 1
    assert tokens(streamed) == whole[0].token_ids
    assert [lp for d in streamed for lp in d.logprobs] == whole[0].logprobs
    assert all(len(lp.top) == 2 for lp in whole[0].logprobs)
    assert [d.finish_reason for d in streamed] == [None] * 11 + ["length"]
    assert whole[0].finish_reason == "length" and whole[0].stop_reason is None
    assert {d.weight_version for d in streamed} == {0} and whole[0].weight_version == 0
    for deltas in (streamed, whole):
        assert deltas[0].prompt_logprobs is not None and len(deltas[0].prompt_logprobs) == len(prompt)
        assert deltas[0].prompt_logprobs[0] is None
        assert all(d.prompt_logprobs is None for d in deltas[1:])
    assert streamed[0].prompt_logprobs == whole[0].prompt_logprobs


async def test_no_logprobs_unless_asked(engine):
    (delta,) = await collect(engine, request(engine, stream=False, max_tokens=4, seed=1))
    assert delta.logprobs == [] and delta.prompt_logprobs is None


async def greedy_output(engine: EngineController, n: int = 24) -> list[int]:
    deltas = await collect(engine, request(engine, stream=False, max_tokens=n, temperature=0, ignore_eos=True))
    return tokens(deltas)


async def test_a_stop_string_ends_the_sequence_with_that_string(engine):
    free = await greedy_output(engine)
    text = engine.tokenizer.detokenize(free)
    # A short printable stop string that first appears a few tokens in.
    start = next(
        i for i in range(len(engine.tokenizer.detokenize(free[:3])), len(text) - 2) if text[i : i + 2].isalnum()
    )
    stop = text[start : start + 2]
    deltas = await collect(engine, request(engine, max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))
    out = tokens(deltas)
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", stop)
    assert out == free[: len(out)]
    assert stop in engine.tokenizer.detokenize(out) and stop not in engine.tokenizer.detokenize(out[:-1])


async def test_a_stop_token_ends_the_sequence_and_is_kept_unless_before_min_tokens(engine):
    free = await greedy_output(engine)
    stop_id = free[3]
    first = free.index(stop_id)
    deltas = await collect(
        engine, request(engine, stream=False, max_tokens=24, temperature=0, stop_token_ids=[stop_id])
    )
    assert tokens(deltas) == free[: first + 1]
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", stop_id)

    later = await collect(
        engine,
        request(engine, stream=False, max_tokens=24, temperature=0, stop_token_ids=[stop_id], min_tokens=first + 2),
    )
    out = tokens(later)
    assert len(out) > first + 1 and stop_id not in out[: first + 2]


async def test_concurrent_requests_each_get_their_own_sequence(store, exporter, model_dir, tmp_path):
    """More requests than one batch holds: all complete; equal seeds give equal outputs, and a
    request's seed gives the same tokens in any batch."""
    engine = build(store, exporter, model_dir, tmp_path, max_batch_size=3)
    try:
        reqs = [request(engine, stream=i % 2 == 0, max_tokens=6 + i, seed=i % 3, ignore_eos=True) for i in range(7)]
        outs = await asyncio.gather(*(collect(engine, r) for r in reqs))
        for i, deltas in enumerate(outs):
            assert len(tokens(deltas)) == 6 + i and deltas[-1].finish_reason == "length"
        # Same seed, so the shorter output is a prefix of the longer one.
        assert tokens(outs[3]) == tokens(outs[0]) + tokens(outs[3])[6:]
        alone = await collect(engine, request(engine, max_tokens=6, seed=0, ignore_eos=True))
        assert tokens(alone) == tokens(outs[0])
    finally:
        await engine.shutdown()


async def wait_for(condition, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def test_closing_the_stream_aborts_the_sequence(engine):
    gen = engine.generate(request(engine, max_tokens=400, ignore_eos=True, seed=0))
    await anext(gen)
    await anext(gen)
    await gen.aclose()
    await asyncio.sleep(0.2)  # the engine's next step drops it
    ran = forwards(engine)
    await asyncio.sleep(0.3)
    assert forwards(engine) == ran < 50, "the abandoned sequence kept the engine decoding"


async def test_an_aborted_sequence_leaves_its_batch_mates_running(engine):
    async def first_two() -> None:
        gen = engine.generate(request(engine, max_tokens=400, ignore_eos=True, seed=0))
        await anext(gen)
        await anext(gen)
        await gen.aclose()

    # Both requests join one batch: admission is held while they arrive.
    await engine.stop_profile(None, pause=True)
    both = asyncio.gather(
        collect(engine, request(engine, stream=False, max_tokens=60, ignore_eos=True, seed=1)), first_two()
    )
    await asyncio.sleep(0.1)
    assert forwards(engine) == 0
    await engine.update_weights(0, None, resume=True)  # releases the hold
    kept, _ = await both
    assert len(tokens(kept)) == 60 and kept[-1].finish_reason == "length"
    await asyncio.sleep(0.2)
    assert forwards(engine) == 60  # one batch: the aborted sequence did not outlive it


async def test_a_cancelled_pending_request_never_runs(store, exporter, model_dir, tmp_path):
    engine = build(store, exporter, model_dir, tmp_path, max_batch_size=1)
    try:
        running = asyncio.ensure_future(collect(engine, request(engine, max_tokens=40, ignore_eos=True, seed=0)))
        waiting = asyncio.ensure_future(collect(engine, request(engine, max_tokens=40, ignore_eos=True, seed=0)))
        await wait_for(lambda: forwards(engine) > 0)
        waiting.cancel()
        await running
        await asyncio.sleep(0.2)
        assert forwards(engine) == 40
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_weight_update_mid_sequence_splits_it_into_two_version_runs(engine, model_dir, stream):
    """Each token carries the version of the forward pass that produced it: as many version-0
    tokens as version-0 forward passes, the rest version 1."""
    req = request(engine, stream=stream, max_tokens=300, ignore_eos=True, seed=0)
    task = asyncio.ensure_future(collect(engine, req))
    await wait_for(lambda: forwards(engine) >= 5)
    await engine.update_weights(1, str(model_dir / "model.safetensors"), resume=True)
    deltas = await task

    by_version = engine.status().forward_steps_by_version
    assert set(by_version) == {0, 1} and sum(by_version.values()) == 300
    versions = [d.weight_version for d in deltas for _ in d.token_ids]
    assert versions == [0] * by_version[0] + [1] * by_version[1]
    if not stream:  # one delta per run of one version, the last one ending the sequence
        assert [d.weight_version for d in deltas] == [0, 1]
        assert [d.finish_reason for d in deltas] == [None, "length"]
