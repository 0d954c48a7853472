"""vLLM's `/pause?mode=abort` and `/abort_requests` on the real app, embedded engine, 2 replicas,
over HTTP (docs/design.md#client-pause): requests in flight end at once with finish_reason abort
and the tokens sampled so far (whole answers and streams alike), new ones are refused until the
resume as vLLM 0.33 refuses them, and `/abort_requests` ends what it names by the answer's id or
vLLM's request id (docs/http_api.md#request-ids), or everything, and pauses nothing.

The tiny model decodes 480 tokens in half a second; this module serves a wider one (about 14 ms a
token), so a request is still in flight when the abort lands."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator

import httpx
import pytest
from integ_util import HttpOptions, ok, poll, status
from support.apps import ServeApp, deployed

from serve_app.tiny_model import TinyModelSpec, ensure_tiny_model

pytestmark = pytest.mark.integration

LONG = 480  # output tokens: about 7 s of decoding, far longer than any abort takes to land
SLOW = TinyModelSpec(hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12)


@pytest.fixture(scope="module")
def slow_app(ray_cluster, tmp_path_factory) -> Iterator[ServeApp]:
    model = ensure_tiny_model(SLOW, cache_dir=tmp_path_factory.mktemp("slow-model"))
    with deployed(ray_cluster, model, tmp_path_factory.mktemp("abort"), "rollout", client_pause_max_s=60.0) as served:
        yield served


HTTP = HttpOptions(app="slow_app", timeout=120)
"""How `http` (conftest.py) reaches this module's app."""


@pytest.fixture
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(4) as p:
        yield p


def long_body(request_id: str, **fields: object) -> dict:
    return {"prompt": "One two", "max_tokens": LONG, "ignore_eos": True, "request_id": request_id, **fields}


def post(app: ServeApp, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{app.base_url}{path}", json=body, timeout=120)


def passes(http: httpx.Client) -> int:
    """Forward passes every replica has run so far."""
    return sum(sum(r["forward_steps_by_version"].values()) for r in status(http)["replicas"])


def running(http: httpx.Client, requests: int, since: int) -> None:
    """Wait until `requests` generation requests (one per choice) are in the engines and a few
    forward passes ran since `since`."""
    poll(
        lambda: (
            sum(r["requests_in_flight"] or 0 for r in status(http)["replicas"]) >= requests
            and passes(http) >= since + 3
        ),
        timeout=60,
        what=f"{requests} requests in flight",
        interval=0.05,
    )


def check_aborted(choice: dict) -> int:
    """An aborted choice: finish_reason abort, fewer tokens than asked, spans over all of them."""
    tokens = len(choice["token_ids"])
    assert choice["finish_reason"] == "abort" and tokens < LONG, choice["finish_reason"]
    spans = choice["weight_versions"]
    assert (spans[-1]["end"] if spans else 0) == tokens and all(s["version"] == 0 for s in spans), spans
    return tokens


def test_pause_abort_ends_requests_in_flight_and_refuses_new_ones_until_resume(slow_app, http, pool):
    before = passes(http)
    whole = pool.submit(post, slow_app, "/v1/completions", long_body("whole", n=2))
    running(http, 2, before)
    paused = ok(http.post("/pause", params={"mode": "abort"}))
    try:
        assert paused["status"] == "paused" and paused["mode"] == "abort", paused
        assert [r["client_pause"] for r in paused["replicas"]] == ["abort", "abort"], paused["replicas"]
        assert sum(r["aborted"] for r in paused["replicas"]) == 2, "both choices of the request in flight"
        answer = ok(whole.result(timeout=30))
        assert answer["id"] == "cmpl-whole"
        tokens = [check_aborted(c) for c in answer["choices"]]
        # Each answers the tokens it had sampled (a choice that missed the first one's batch, none).
        assert max(tokens) > 0, tokens
        assert answer["usage"]["completion_tokens"] == sum(tokens)
        # vLLM 0.33 refuses new requests until the resume (503, retryable): so does the app.
        refused = http.post("/v1/completions", json={"prompt": "One", "max_tokens": 2})
        assert refused.status_code == 503 and "mode=abort" in refused.text and "POST /resume" in refused.text
        assert refused.headers.get("retry-after"), refused.headers
        assert ok(http.get("/is_paused")) == {"is_paused": True, "mode": "abort", "until": paused["until"]}
    finally:
        resumed = ok(http.post("/resume"))
    assert all(r["client_pause"] is None for r in resumed["replicas"]), resumed
    after = ok(http.post("/v1/completions", json={"prompt": "One", "max_tokens": 3, "ignore_eos": True}))
    assert after["choices"][0]["finish_reason"] == "length" and len(after["choices"][0]["token_ids"]) == 3


def stream_until(app: ServeApp, body: dict, tokens: int, then) -> tuple[list[dict], str]:
    """Stream `body`; once `tokens` tokens came, call `then(id)` (the stream's id), and read on.
    Each piece of the one choice, and the stream's last line."""
    pieces: list[dict] = []
    last = ""
    called = False
    with httpx.Client(base_url=app.base_url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line:
                continue
            last = line
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                pieces += chunk["choices"]
                if not called and sum(len(p["token_ids"]) for p in pieces) >= tokens:
                    called = True
                    then(chunk["id"])
    return pieces, last


def test_abort_requests_ends_what_it_names_by_either_id_or_everything_and_pauses_nothing(slow_app, http, pool):
    # A stream, by the id of its answer: its last piece says abort, then [DONE].
    answers: list[dict] = []
    pieces, last = stream_until(
        slow_app,
        long_body("streamed", stream=True),
        4,
        lambda rid: answers.append(ok(http.post("/abort_requests", json={"request_ids": [rid]}))),
    )
    assert answers[0]["status"] == "aborted" and answers[0]["aborted"] == 1, answers
    assert last == "data: [DONE]" and pieces[-1]["finish_reason"] == "abort"
    assert [p["finish_reason"] for p in pieces[:-1]] == [None] * (len(pieces) - 1)
    streamed = sum(len(p["token_ids"]) for p in pieces)
    assert 4 <= streamed < LONG and pieces[-1]["weight_versions"][-1]["end"] == streamed

    # A whole completion, by vLLM's request id of its prompt; the one beside it runs on.
    before = passes(http)
    target = pool.submit(post, slow_app, "/v1/completions", long_body("target"))
    running(http, 1, before)
    beside = pool.submit(post, slow_app, "/v1/completions", {"prompt": "Red", "max_tokens": 24, "ignore_eos": True})
    assert ok(http.post("/abort_requests", json={"request_ids": ["cmpl-target-0", "cmpl-gone"]}))["aborted"] == 1
    answer = ok(target.result(timeout=30))
    assert check_aborted(answer["choices"][0]) > 0
    kept = ok(beside.result(timeout=120))["choices"][0]
    assert kept["finish_reason"] == "length" and len(kept["token_ids"]) == 24, "an abort that names others"
    assert ok(http.get("/is_paused"))["is_paused"] is False

    # A chat by its id, and then everything: `request_ids` empty (or null).
    before = passes(http)
    chat = pool.submit(
        post,
        slow_app,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": LONG, "ignore_eos": True, "request_id": "c"},
    )
    running(http, 1, before)
    assert ok(http.post("/abort_requests", json={"request_ids": ["chatcmpl-c"]}))["aborted"] == 1
    reply = ok(chat.result(timeout=30))
    assert reply["id"] == "chatcmpl-c" and reply["choices"][0]["finish_reason"] == "abort"
    before = passes(http)
    rest = [pool.submit(post, slow_app, "/v1/completions", long_body(f"rest{i}")) for i in range(2)]
    running(http, 2, before)
    everything = ok(http.post("/abort_requests", json={"request_ids": []}))
    assert everything["aborted"] == 2 and len(everything["replicas"]) == 2, everything
    for r in rest:
        check_aborted(ok(r.result(timeout=30))["choices"][0])
    assert ok(http.post("/abort_requests", json={}))["aborted"] == 0, "nothing in flight: nothing to end"
    assert ok(http.post("/v1/completions", json={"prompt": "One", "max_tokens": 2}))["choices"][0]["token_ids"]


def test_abort_requests_needs_a_json_object_as_vllm_does(http):
    assert http.post("/abort_requests").status_code == 422
    assert http.post("/abort_requests", json=["cmpl-x"]).status_code == 422
    refused = http.post("/abort_requests", json={"request_ids": ["x"], "ids": ["y"]})
    assert refused.status_code == 422 and "ids" in refused.text, refused.text


def test_sglang_pause_generation_abort_ends_requests_in_flight_and_queues_new_ones(slow_app, http, pool):
    """SGLang's `/pause_generation` (mode abort, its default: AReaL and slime send `{}`): the
    requests in flight end with abort, new ones are held (not refused, unlike vLLM's abort) and
    run after `/continue_generation`."""
    before = passes(http)
    native = pool.submit(
        post,
        slow_app,
        "/generate",
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}},
    )
    running(http, 1, before)
    assert ok(http.post("/pause_generation", json={})) == {"message": "Generation paused successfully.", "status": "ok"}
    try:
        aborted = ok(native.result(timeout=30))
        assert aborted["meta_info"]["finish_reason"]["type"] == "abort", aborted["meta_info"]
        assert 0 < len(aborted["output_ids"]) < LONG
        queued = pool.submit(
            post, slow_app, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}}
        )
        with pytest.raises(concurrent.futures.TimeoutError):
            queued.result(timeout=1.5)  # held by the pause, not refused
        assert ok(http.get("/is_paused"))["mode"] == "keep"
    finally:
        ok(http.post("/continue_generation", json={}))
    answer = ok(queued.result(timeout=60))
    assert answer["meta_info"]["finish_reason"]["type"] == "length" and len(answer["output_ids"]) == 3
