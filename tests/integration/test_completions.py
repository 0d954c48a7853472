"""The generation and ops routes over HTTP (docs/design.md#http-api): OpenAI-shaped /v1/models and
/v1/completions with token ids, logprobs and weight versions; /health; /metrics."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from integ_util import complete, ok

pytestmark = pytest.mark.integration


def check_choice(ch: dict, index: int, max_tokens: int) -> None:
    assert ch["index"] == index
    assert ch["finish_reason"] in ("stop", "length")
    assert 1 <= len(ch["token_ids"]) <= max_tokens
    assert ch["finish_reason"] == "stop" or len(ch["token_ids"]) == max_tokens
    assert isinstance(ch["text"], str)
    assert ch["prompt_token_ids"] and all(isinstance(t, int) for t in ch["prompt_token_ids"])
    assert ch["weight_version"] == 0
    assert ch["weight_versions"] == [{"version": 0, "start": 0, "end": len(ch["token_ids"])}]


def test_models_lists_the_served_model(app, http):
    body = ok(http.get("/v1/models"))
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["tiny-llama"]
    assert body["data"][0]["object"] == "model"


def test_string_prompt(http):
    body = complete(http, "The rollout server answers", max_tokens=5, model="tiny-llama")
    assert body["object"] == "text_completion" and body["model"] == "tiny-llama"
    assert body["id"].startswith("cmpl-")
    assert len(body["choices"]) == 1
    check_choice(body["choices"][0], 0, 5)
    assert body["weight_version"] == 0
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(body["choices"][0]["prompt_token_ids"])
    assert usage["completion_tokens"] == len(body["choices"][0]["token_ids"])
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_list_of_string_prompts_gives_one_choice_each(http):
    prompts = ["Red green blue", "One two three", "The quick brown fox"]
    body = complete(http, prompts, max_tokens=4)
    assert len(body["choices"]) == len(prompts)
    for i, ch in enumerate(body["choices"]):
        check_choice(ch, i, 4)
    # Each choice answers its own prompt.
    singles = [complete(http, p, max_tokens=1)["choices"][0]["prompt_token_ids"] for p in prompts]
    assert [ch["prompt_token_ids"] for ch in body["choices"]] == singles


def test_token_id_prompt(http):
    ids = complete(http, "Numbers: 1 2 3", max_tokens=1)["choices"][0]["prompt_token_ids"]
    body = complete(http, ids, max_tokens=3)
    assert len(body["choices"]) == 1
    check_choice(body["choices"][0], 0, 3)
    assert body["choices"][0]["prompt_token_ids"] == ids
    assert complete(http, [5, 6, 7], max_tokens=2)["choices"][0]["prompt_token_ids"] == [5, 6, 7]


def test_token_ids_out_of_range_are_422_with_the_replicas_message(http):
    r = http.post("/v1/completions", json={"prompt": [1, 2, 10**6], "max_tokens": 2})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert "out of range" in detail and "1000000" in detail
    assert "Traceback" not in detail and "ray" not in detail.lower(), "Ray's wrapper must not leak"


def test_logprobs_match_tokens(http):
    body = complete(http, "Questions and answers", max_tokens=6, logprobs=1)
    ch = body["choices"][0]
    lp = ch["logprobs"]
    assert len(lp["token_logprobs"]) == len(ch["token_ids"]) == len(lp["tokens"])
    assert all(x <= 0.0 for x in lp["token_logprobs"])
    assert complete(http, "Questions", max_tokens=2)["choices"][0]["logprobs"] is None


def test_greedy_is_deterministic(http):
    req = {"prompt": "Every replica keeps its own trace", "max_tokens": 8, "temperature": 0, "logprobs": 1}
    # Several requests, so both replicas (and batched as well as single prefills) are exercised.
    runs = [complete(http, **req)["choices"][0] for _ in range(4)]
    assert len({tuple(r["token_ids"]) for r in runs}) == 1, [r["token_ids"] for r in runs]
    assert len({r["text"] for r in runs}) == 1


def test_batched_greedy_matches_single(http):
    """Left-padded batches (prompts of different lengths decoded together) give each prompt the
    tokens it gets alone."""
    prompts = ["Red", "The quick brown fox jumps over the lazy dog", "One two three four", "A weight update"]
    req = {"max_tokens": 6, "temperature": 0, "logprobs": 1}
    alone = {p: complete(http, p, **req)["choices"][0] for p in prompts}
    with ThreadPoolExecutor(len(prompts) * 2) as pool:
        together = list(pool.map(lambda p: complete(http, p, **req)["choices"][0], prompts * 2))
    batched = complete(http, prompts, **req)["choices"]
    for p, ch in zip(prompts * 2 + prompts, together + batched, strict=True):
        assert ch["token_ids"] == alone[p]["token_ids"], p
        assert ch["logprobs"]["token_logprobs"] == pytest.approx(alone[p]["logprobs"]["token_logprobs"], abs=1e-3)


def test_seeded_sampling_is_reproducible(http):
    req = {"prompt": "Red green blue", "max_tokens": 8, "temperature": 1.0, "seed": 1234}
    a = complete(http, **req)["choices"][0]["token_ids"]
    b = complete(http, **req)["choices"][0]["token_ids"]
    assert a == b


def test_health_and_metrics(http):
    assert ok(http.get("/health")) == {"status": "ok"}
    # A control call, so the histogram has a sample.
    ok(http.get("/profile/status"))
    ok(http.post("/profile/stop", json={"step": 1}))
    r = http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    assert "rollout_profiler_control_seconds" in r.text
    assert 'rollout_profiler_control_seconds_count{call="stop"}' in r.text
