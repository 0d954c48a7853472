"""The rollout API as RL frameworks call it: the official `openai` client against the real app on
the embedded engine (docs/http_api.md#openai-routes). Every sampling field, n-choice groups,
stop strings, streaming with usage, chat over the model's template, token-id prompts; each
choice's weight-version spans cover its tokens exactly, also across a weight sync mid-stream."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from integ_util import ok, poll, status, write_perturbed_weights
from openai_contract import (  # noqa: F401 - collected here, on the embedded engine
    dump,
    spans_cover,
    test_chat_with_the_template,
    test_echo_prepends_the_prompt_with_its_logprobs,
    test_every_prompt_form,
    test_every_sampling_field_is_taken,
    test_logprobs_top_five_in_openai_shape,
    test_models_list,
    test_n_group_each_choice_its_own_tokens,
    test_prompt_logprobs_are_not_streamed,
    test_sampling_cuts_that_leave_one_token_are_greedy,
    test_stop_strings_cut_the_text_and_keep_the_tokens,
    test_stop_token_ids_ignore_eos_and_min_tokens,
    test_streaming_matches_the_full_answer_and_reports_usage,
    test_vllm_fields_token_ids_as_tokens_and_prompt_logprobs,
)
from transformers import AutoTokenizer

pytestmark = pytest.mark.integration

LONG = 400  # output tokens of a completion long enough to straddle a weight sync


@pytest.fixture(scope="module")
def oai(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def test_chat_multi_turn_continues_the_context(oai):
    messages = [{"role": "user", "content": "Red green blue"}]
    first = oai.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6, temperature=0)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "More."},
    ]
    second = dump(
        oai.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6, temperature=0).choices[0]
    )
    assert (
        len(second["prompt_token_ids"])
        > len(dump(first.choices[0])["prompt_token_ids"]) + len(dump(first.choices[0])["token_ids"]) - 1
    )


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"prompt": "x", "max_tokens": 100_000}, "context"),
        ({"prompt": "x", "n": 1000}, "n"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "cache_salt": "version/1"}, "cache_salt"),
        ({"prompt": "x", "cache_salt": "s" * 129}, "cache_salt"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_refusals_name_the_field(http, body, named):
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 422, resp.text
    assert named in resp.text


def test_chat_without_limit_takes_the_rest_of_the_context(http):
    body = ok(
        http.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Hi"}],
                "temperature": 0,
                "ignore_eos": True,
                "max_tokens": None,
            },
        )
    )
    c = body["choices"][0]
    assert len(c["prompt_token_ids"]) + len(c["token_ids"]) == 512, "the tiny model's context is 512"


def test_a_client_that_disconnects_mid_stream_frees_its_slot(app, http):
    body = {"prompt": "One two", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=app.base_url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data: ")]
        assert got
        assert max(r["requests_in_flight"] for r in status(http)["replicas"]) >= 1
    poll(
        lambda: all(r["requests_in_flight"] == 0 for r in status(http)["replicas"]),
        timeout=15,
        what="the abandoned stream's request to leave the engine",
    )


def test_weight_sync_mid_stream_splits_the_spans(app, http, tmp_path):
    """Last in the module: it moves the app to a new weight version."""
    now = status(http)["weight_version"]
    version = now + 1
    weights = write_perturbed_weights(Path(app.args["model_path"]), app.weights_dir / "mid.safetensors", 1)
    body = {"prompt": "The rollout server", "max_tokens": LONG, "ignore_eos": True, "stream": True, "temperature": 0}
    chunks: list[dict] = []
    synced = threading.Event()

    def sync() -> None:
        ok(http.post("/weights/update", json={"version": version, "path": str(weights)}))
        synced.set()

    with httpx.Client(base_url=app.base_url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        syncer = None
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[6:]))
            if syncer is None and sum(len(ch["choices"][0]["token_ids"]) for ch in chunks if ch["choices"]) >= 20:
                syncer = threading.Thread(target=sync)
                syncer.start()
        assert syncer is not None
        syncer.join(60)
    assert synced.is_set()
    pieces = [ch["choices"][0] for ch in chunks if ch["choices"]]
    tokens = [t for p in pieces for t in p["token_ids"]]
    assert len(tokens) == LONG
    last = pieces[-1]
    spans = last["weight_versions"]
    assert [s["version"] for s in spans] == [now, version], spans
    boundary = spans[0]["end"]
    assert 20 <= boundary < LONG and spans[1] == {"version": version, "start": boundary, "end": LONG}
    # Each chunk's own version agrees with the spans at its tokens.
    seen = 0
    for p in pieces:
        for _ in p["token_ids"]:
            assert p["weight_version"] == (now if seen < boundary else version), (seen, boundary)
            seen += 1


def test_module_left_no_request_running(http):
    time.sleep(0.5)
    assert all(r["requests_in_flight"] == 0 for r in status(http)["replicas"])
