"""`engine: sglang` in a real 2-replica Serve app over HTTP, each replica launching and driving its
own FAKE SGLang server (tests/fakes/fake_sglang_server.py: NOT SGLang, which needs CUDA) as a
child process: profiled steps across a weight update, conflicts, a weights file SGLang refuses,
SGLang's own num_steps cap, and the server processes ending with the app."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from integ_util import (
    HttpOptions,
    complete,
    complete_concurrently,
    ok,
    poll,
    status,
    stop_if_active,
    wait_manifest,
    write_perturbed_weights,
)
from ray import serve
from safetensors.torch import save_file
from support.apps import deploy
from support.fake_sglang import fake_servers, fake_sglang_options
from support.traces import trace_events

from serve_app.engines.sglang.trace_dialect import SGLANG_DIALECT

pytestmark = pytest.mark.integration

REPLICAS = 2
_deleted: set[str] = set()


def fake_server_pids(model_dir: Path) -> set[int]:
    """The fake SGLang servers serving `model_dir` (this session's model: only this module's)."""
    return set(fake_servers(model_dir))


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def app(ray_cluster, model_dir, tmp_path_factory):
    served = deploy(
        ray_cluster,
        model_dir,
        tmp_path_factory.mktemp("sglangfake"),
        "sglangfake",
        engine="sglang",
        sglang=fake_sglang_options(request_timeout_s=60),
    )
    try:
        yield served
    finally:
        if served.name not in _deleted:
            serve.delete(served.name)


HTTP = HttpOptions(stop_at_end=lambda app: app.name not in _deleted)
"""How `http` (conftest.py) reaches this module's app."""


def spans(version: int, tokens: int) -> dict:
    """The one weight-version span of a choice whose `tokens` all came from `version`."""
    return {"version": version, "start": 0, "end": tokens}


def check_step_traces(app, http, step: int, version: int, replica_ids: set[str]) -> list[dict]:
    """The step's manifest is complete and lists, per replica, SGLang's trace named for the step,
    and its weight version, under step_<k>/rollout/<replica_id>/: a gzip Chrome trace with one
    `step[..]` range (SGLang's, around each forward; no pipeline parallelism) per forward step."""
    manifest = wait_manifest(http, step, ("complete", "partial"))
    assert manifest["status"] == "complete", manifest
    entries = [e for e in manifest["entries"] if e["role"] == "rollout"]
    assert {e["replica_id"] for e in entries} == replica_ids
    step_dir = app.save_path / f"step_{step}"
    for e in entries:
        assert e["status"] == "ok" and e["error"] is None and not e["exporting"], e
        assert e["weight_version"] == version, e
        assert len(e["files"]) == 1, e
        rel = Path(e["files"][0])
        assert rel.parent == Path("rollout") / e["replica_id"], rel
        assert rel.name.startswith(f"step{step}-v{version}-") and rel.name.endswith("-TP-0.trace.json.gz"), rel
        assert SGLANG_DIALECT.file_version_of(rel.name) == version, rel
        events = trace_events(step_dir / rel)
        forwards = [ev for ev in events if ev.get("cat") == "user_annotation" and ev["name"].startswith("step[")]
        assert len(forwards) == e["forward_steps"] > 0, e
    return entries


def test_sglang_engine_against_fake_server_profiles_steps_across_a_weight_update(app, http, model_dir):
    assert len(fake_server_pids(model_dir)) == REPLICAS, "one fake SGLang server per replica"
    version = 1
    weights = write_perturbed_weights(model_dir, app.weights_dir / f"v{version}.safetensors", seed=version)
    probe = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, "logprobs": 1}
    try:
        started = ok(http.post("/profile/start", json={"step": 1}))
        assert all(r["ok"] and r["state"] == "profiling" for r in started["replicas"]), started
        replica_ids = {r["replica_id"] for r in started["replicas"]}
        assert len(replica_ids) == REPLICAS
        before = complete_concurrently(http, n=12, max_tokens=4)
        assert all(r["weight_version"] == 0 for r in before)
        probe_before = complete(http, **probe)["choices"][0]

        # The trainer's sync for version 1: stop(1, pause) -> update(1, no resume) -> start(2).
        with ThreadPoolExecutor(1) as pool:
            stopped = ok(http.post("/profile/stop", json={"step": 1, "pause": True}))
            assert stopped["stopped"] and all(r["ok"] and r["paused"] for r in stopped["replicas"]), stopped
            held = pool.submit(complete, http, "Red green blue", max_tokens=3)
            time.sleep(1.0)
            assert not held.done(), "a request ran while SGLang generation was paused"
            updated = ok(http.post("/weights/update", json={"version": version, "path": str(weights), "resume": False}))
            assert all(r["ok"] and r["weight_version"] == version for r in updated["replicas"]), updated
            assert len(updated["replicas"]) == REPLICAS
            assert not held.done(), "a request ran after update(resume=false), before start(2)"
            started = ok(http.post("/profile/start", json={"step": 2}))
            assert all(r["ok"] and r["weight_version"] == version and not r["paused"] for r in started["replicas"])
            gap = held.result(timeout=60)
        gap_choice = gap["choices"][0]
        assert gap["weight_version"] == version
        assert gap_choice["weight_versions"] == [spans(version, len(gap_choice["token_ids"]))]

        after = complete_concurrently(http, n=12, max_tokens=4)
        assert all(
            ch["weight_versions"] == [spans(version, len(ch["token_ids"]))] for r in after for ch in r["choices"]
        )
        probe_after = complete(http, **probe)["choices"][0]
        assert probe_after["logprobs"]["token_logprobs"] != probe_before["logprobs"]["token_logprobs"]

        conflict = http.post("/profile/start", json={"step": 3})
        assert conflict.status_code == 409 and "step 2 is being profiled" in conflict.json()["detail"], conflict.text
        ok(http.post("/profile/stop", json={"step": 2}))
    finally:
        stop_if_active(http)
    st = status(http)
    assert st["weight_version"] == version and all(r["weight_version"] == version for r in st["replicas"]), st
    check_step_traces(app, http, 1, 0, replica_ids)
    check_step_traces(app, http, 2, version, replica_ids)


def test_sglang_engine_against_fake_server_refused_weights_keep_the_old_version(app, http):
    bad = app.weights_dir / "renamed.safetensors"
    save_file({"not.a.model.weight": torch.zeros(4)}, str(bad))  # readable, but not this model's
    resp = http.post("/weights/update", json={"version": 2, "path": str(bad)})
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    # Refused from its headers in each replica, before SGLang is asked (unit tests cover SGLang's
    # own refusal, which this check now spares the server).
    assert "version 1 keeps serving" in detail and "does not fit the served model" in detail, detail
    st = status(http)
    assert st["weight_version"] == 1 and not st["paused"]
    assert all(r["ok"] and r["weight_version"] == 1 and not r["paused"] for r in st["replicas"]), st
    assert all(r["weight_version"] == 1 for r in complete_concurrently(http, n=4, max_tokens=2))


def test_sglang_engine_against_fake_server_num_steps_caps_the_recording(app, http):
    """SGLang stops the recording itself after max_forward_steps (its num_steps); the later
    /profile/stop still closes the step cleanly."""
    step, cap = 5, 2
    try:
        ok(http.post("/profile/start", json={"step": step, "max_forward_steps": cap, "tag": "capped"}))
        complete_concurrently(http, n=8, max_tokens=4)
        stopped = ok(http.post("/profile/stop", json={"step": step}))
    finally:
        stop_if_active(http)
    assert all(r["ok"] for r in stopped["replicas"]), stopped
    manifest = wait_manifest(http, step, ("complete", "partial"))
    assert manifest["status"] == "complete" and manifest["tag"] == "capped", manifest
    for e in manifest["entries"]:
        assert e["status"] == "ok" and e["forward_steps"] == cap, e
        assert Path(e["files"][0]).name.startswith(f"step{step}-capped-v"), e
        # SGLang counts only what it recorded: the entry says so instead of claiming the whole window
        assert e["auto_stopped"] == "max_forward_steps" and e["forward_steps_in_window"] is None, e
        assert e["kept"] == (
            f"kept {cap} forward steps: max_forward_steps stopped the recording; the steps run after it are not counted"
        ), e


def stream_completion(http, **body) -> tuple[list[dict], bool]:
    """POST a streamed /v1/completions; its chunks and whether it ended with `data: [DONE]`."""
    chunks: list[dict] = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                return chunks, True
            if line.startswith("data: "):
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks, False


def test_sglang_engine_against_fake_server_streams_completions_over_http(http):
    version = status(http)["weight_version"]
    body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "logprobs": 1}
    whole = complete(http, **body)["choices"][0]
    chunks, done = stream_completion(http, **body, stream_options={"include_usage": True})
    assert done and "error" not in chunks[-1], chunks[-1]
    pieces = [c["choices"][0] for c in chunks if c["choices"]]
    assert len(pieces) > 1, "the answer came in one piece"
    assert [t for p in pieces for t in p["token_ids"]] == whole["token_ids"]
    assert "".join(p["text"] for p in pieces) == whole["text"]
    assert all(p["weight_version"] == version for p in pieces if p["token_ids"])
    assert pieces[-1]["finish_reason"] == whole["finish_reason"]
    assert pieces[-1]["weight_versions"] == whole["weight_versions"] == [spans(version, len(whole["token_ids"]))]
    assert chunks[-1]["usage"]["completion_tokens"] == len(whole["token_ids"])


def test_sglang_engine_against_fake_server_n_choices_are_seeded_samples_with_their_own_spans(http):
    version = status(http)["weight_version"]
    body = {"prompt": "Red green blue", "max_tokens": 6, "temperature": 1.0, "top_p": 0.95, "n": 4, "seed": 11}
    first = complete(http, **body)
    again = complete(http, **body)
    choices = first["choices"]
    assert sorted(ch["index"] for ch in choices) == [0, 1, 2, 3]
    for ch in choices:
        assert ch["weight_versions"] == [spans(version, len(ch["token_ids"]))] and ch["token_ids"]
    by_index = {ch["index"]: ch["token_ids"] for ch in again["choices"]}
    assert all(by_index[ch["index"]] == ch["token_ids"] for ch in choices), "the same seed drew other tokens"
    assert len({tuple(ch["token_ids"]) for ch in choices}) > 1, "every choice drew the same tokens"
    assert first["usage"]["completion_tokens"] == sum(len(ch["token_ids"]) for ch in choices)


def test_sglang_engine_against_fake_server_aborts_a_stream_by_its_id_and_requests_in_flight_by_pause(app, http):
    """SGLang's `/abort_request` under vLLM's routes: a stream named by its answer's id ends with
    finish_reason abort after its tokens so far (SGLang ends a running request after one more
    forward); `/pause?mode=abort` ends a whole request in flight and refuses new ones until the
    resume."""
    version = status(http)["weight_version"]
    long = {"prompt": "One two", "max_tokens": 480, "ignore_eos": True}
    pieces: list[dict] = []
    aborted: list[dict] = []
    last = ""
    with (
        httpx.Client(base_url=app.base_url, timeout=120) as c,
        c.stream("POST", "/v1/completions", json={**long, "stream": True, "request_id": "sg"}) as resp,
    ):
        assert resp.status_code == 200
        for line in filter(None, resp.iter_lines()):
            last = line
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: ") :])
                pieces += chunk["choices"]
                if not aborted and sum(len(p["token_ids"]) for p in pieces) >= 4:
                    assert chunk["id"] == "cmpl-sg"
                    aborted.append(ok(http.post("/abort_requests", json={"request_ids": ["cmpl-sg"]})))
    assert aborted[0]["aborted"] == 1 and last == "data: [DONE]", (aborted, last)
    assert pieces[-1]["finish_reason"] == "abort" and all(p["finish_reason"] is None for p in pieces[:-1])
    tokens = sum(len(p["token_ids"]) for p in pieces)
    assert 4 <= tokens < 480 and pieces[-1]["weight_versions"] == [spans(version, tokens)]

    with ThreadPoolExecutor(1) as pool:
        whole = pool.submit(lambda: ok(httpx.post(f"{app.base_url}/v1/completions", json=long, timeout=120)))
        poll(
            lambda: sum(r["requests_in_flight"] or 0 for r in status(http)["replicas"]),
            timeout=60,
            what="the request in flight",
            interval=0.05,
        )
        time.sleep(0.3)  # a few forwards: it has tokens to answer
        try:
            paused = ok(http.post("/pause", params={"mode": "abort"}))
            assert sum(r["aborted"] for r in paused["replicas"]) == 1, paused["replicas"]
            choice = whole.result(timeout=60)["choices"][0]
            assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 480, choice
            assert choice["weight_versions"] == [spans(version, len(choice["token_ids"]))]
            refused = http.post("/v1/completions", json={"prompt": "One", "max_tokens": 2})
            assert refused.status_code == 503 and "mode=abort" in refused.text, refused.text
        finally:
            ok(http.post("/resume"))
    # ignore_eos: the tiny model may sample its EOS within 2 tokens, which is a "stop", not a failure.
    assert complete(http, "One", max_tokens=2, ignore_eos=True)["choices"][0]["finish_reason"] == "length"


def test_sglang_engine_against_fake_server_processes_end_with_the_app(app, model_dir):
    pids = fake_server_pids(model_dir)
    assert len(pids) == REPLICAS
    serve.delete(app.name)
    _deleted.add(app.name)

    def gone() -> bool:
        return not any(_running(p) for p in pids)

    poll(gone, timeout=60, what="the fake SGLang servers to exit after the app was deleted")
