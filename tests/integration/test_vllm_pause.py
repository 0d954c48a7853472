"""vLLM's /pause, /resume and /is_paused on the real app (docs/design.md#client-pause): a client's
pause holds every replica until its resume, across the weight update and the profiling start it
brackets, and ends on its own at client_pause_max_s; `wait` answers once the requests in flight
have finished and refuses new ones meanwhile (`abort`: tests/integration/test_abort.py)."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import httpx
import pytest
from integ_util import client, ok, stop_if_active, write_perturbed_weights
from support.apps import ServeApp, deployed

pytestmark = pytest.mark.integration

MAX_PAUSE_S = 8.0


@pytest.fixture(scope="module")
def app(ray_cluster, model_dir, tmp_path_factory) -> Iterator[ServeApp]:
    with deployed(
        ray_cluster, model_dir, tmp_path_factory.mktemp("pause"), "rollout", client_pause_max_s=MAX_PAUSE_S
    ) as served:
        yield served


@pytest.fixture
def background() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        yield pool


def _complete(app: ServeApp, max_tokens: int) -> httpx.Response:
    with client(app.base_url) as c:
        return c.post("/v1/completions", json={"prompt": "One two", "max_tokens": max_tokens, "ignore_eos": True})


def _pending_for(future: concurrent.futures.Future, seconds: float) -> bool:
    try:
        future.result(timeout=seconds)
    except concurrent.futures.TimeoutError:
        return True
    return False


def test_keep_holds_generation_across_the_update_and_the_start_until_resume(app, http, model_dir, background):
    paused = ok(http.post("/pause", params={"mode": "keep", "clear_cache": "false"}))
    try:
        assert paused["status"] == "paused" and paused["mode"] == "keep", paused
        assert [r["client_pause"] for r in paused["replicas"]] == ["keep", "keep"], paused["replicas"]
        assert 0 < paused["until"] - time.time() <= MAX_PAUSE_S
        assert ok(http.get("/is_paused"))["is_paused"] is True
        pending = background.submit(_complete, app, 4)
        assert _pending_for(pending, 1.5), "a request ran during the pause"
        write_perturbed_weights(model_dir, app.weights_dir / "v1.safetensors", seed=1)
        ok(http.post("/weights/update", json={"version": 1, "path": "v1.safetensors"}))  # resume: true
        ok(http.post("/profile/start", json={"step": 1}))
        assert _pending_for(pending, 1.0), "the update's resume or the start lifted the client's pause"
        assert ok(http.get("/is_paused")) == {"is_paused": True, "mode": "keep", "until": paused["until"]}
    finally:
        resumed = ok(http.post("/resume"))
    assert resumed["status"] == "resumed" and all(r["client_pause"] is None for r in resumed["replicas"])
    answer = pending.result(timeout=60)
    assert answer.status_code == 200, answer.text
    spans = answer.json()["choices"][0]["weight_versions"]
    assert [s["version"] for s in spans] == [1], "every token of a request queued in the pause is on the new weights"
    assert ok(http.get("/is_paused")) == {"is_paused": False, "mode": None, "until": None}
    stop_if_active(http)


def test_wait_answers_once_requests_in_flight_finished_and_refuses_new_ones(app, http, background):
    long = background.submit(_complete, app, 120)
    time.sleep(0.5)  # in flight
    paused = ok(http.post("/pause", params={"mode": "wait"}))
    try:
        assert long.done(), "the wait answered before the request in flight finished"
        assert long.result().status_code == 200 and paused["mode"] == "wait"
        assert [r["client_pause"] for r in paused["replicas"]] == ["wait", "wait"]
        refused = http.post("/v1/completions", json={"prompt": "One", "max_tokens": 2})
        assert refused.status_code == 503 and "POST /resume" in refused.text, refused.text
        assert refused.headers.get("retry-after"), refused.headers
    finally:
        ok(http.post("/resume"))
    ok(http.post("/v1/completions", json={"prompt": "One", "max_tokens": 2}))


def test_a_pause_without_its_resume_ends_at_client_pause_max_s(app, http, background):
    paused = ok(http.post("/pause", params={"mode": "keep"}))
    pending = background.submit(_complete, app, 2)
    left = paused["until"] - time.time()
    assert _pending_for(pending, left - 1.0), "the request ran before the pause's bound"
    answer = pending.result(timeout=30)
    assert answer.status_code == 200, answer.text
    time.sleep(1.0)
    assert ok(http.get("/is_paused"))["is_paused"] is False


def test_an_unknown_mode_is_refused_naming_the_modes(http):
    r = http.post("/pause", params={"mode": "freeze"})
    assert r.status_code == 422 and all(m in r.text for m in ("keep", "wait", "abort")), r.text
    assert ok(http.get("/is_paused"))["is_paused"] is False
    assert ok(http.post("/resume"))["status"] == "resumed", "a resume with no pause changes nothing"
