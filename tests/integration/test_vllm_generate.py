"""vLLM's token-in, token-out /inference/v1/generate on the real app (docs/http_api.md#vllm-routes):
the same generation as a completion of the token-id prompt, in vLLM 0.33's tokens-mode shape,
with weight versions labelled as vLLM labels them ("default" for the initial weights)."""

from __future__ import annotations

import json

import pytest
from integ_util import ok, write_perturbed_weights
from transformers import AutoTokenizer

pytestmark = pytest.mark.integration

GENERATE = "/inference/v1/generate"


@pytest.fixture(scope="module")
def prompt(model_dir) -> list[int]:
    return AutoTokenizer.from_pretrained(model_dir)("One two three").input_ids


def test_greedy_tokens_are_the_completions_and_every_field_is_in_vllms_shape(http, prompt):
    sampling = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, "logprobs": 2, "prompt_logprobs": 1}
    got = ok(http.post(GENERATE, json={"token_ids": prompt, "sampling_params": sampling, "request_id": "r-1"}))
    same = ok(
        http.post(
            "/v1/completions",
            json={"prompt": prompt, "temperature": 0.0, "max_tokens": 6, "ignore_eos": True, "logprobs": 2},
        )
    )["choices"][0]
    assert got["request_id"] == "r-1" and got["output_mode"] == "tokens" and got["model"] == "tiny-llama"
    (choice,) = got["choices"]
    assert choice["token_ids"] == same["token_ids"] and len(choice["token_ids"]) == 6
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 6}]
    content = choice["logprobs"]["content"]
    assert [c["token_id"] for c in content] == choice["token_ids"]
    for position, expected in zip(content, same["logprobs"]["token_logprobs"], strict=True):
        assert position["logprob"] == pytest.approx(expected, abs=1e-4)
        top = position["top_logprobs"]
        assert top[0]["token_id"] == position["token_id"], "the sampled token comes first"
        assert position["rank"] == 1, "greedy: the sampled token is the most likely"
        assert [t["rank"] for t in top[1:]] == [2] and top[1]["logprob"] <= position["logprob"]
    assert got["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 6, "total_tokens": len(prompt) + 6}
    assert got["prompt_logprobs"][0] is None and len(got["prompt_logprobs"]) == len(prompt)
    assert got["prompt_token_ids"] is None, "only with return_token_ids"


def test_n_choices_seeds_and_the_labels_of_a_published_version(http, prompt, app, model_dir):
    body = {"token_ids": prompt, "return_token_ids": True, "sampling_params": {"n": 3, "seed": 7, "max_tokens": 4}}
    first = ok(http.post(GENERATE, json=body))
    assert [c["index"] for c in first["choices"]] == [0, 1, 2] and first["prompt_token_ids"] == prompt
    assert all(c["logprobs"] is None for c in first["choices"]), "no logprobs asked"
    assert ok(http.post(GENERATE, json=body))["choices"] == first["choices"], "a seeded request repeats"
    write_perturbed_weights(model_dir, app.weights_dir / "v3.safetensors", seed=3)
    ok(http.post("/weights/update", json={"version": 3, "path": "v3.safetensors"}))
    spans = ok(http.post(GENERATE, json=body))["choices"][0]["weight_versions"]
    assert spans == [{"version": "3", "start": 0, "end": 4}]


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        ({"token_ids": [1, 2], "sampling_params": {"structured_outputs": {"regex": "a"}}}, 422, "structured_outputs"),
        ({"token_ids": [1, 2], "output_mode": "text"}, 422, "output_mode"),
        ({"token_ids": [1, 2], "stream": True}, 422, "stream"),
        ({"token_ids": [1, 2], "sampling_params": {"min_tokens": 9, "max_tokens": 2}}, 422, "min_tokens 9 is over"),
        ({"token_ids": [1, 2], "sampling_params": {"max_tokens": None}}, 422, "max_tokens"),
        ({"token_ids": [1, 10**9]}, 422, "out of range"),
        ({"token_ids": []}, 422, "token_ids"),
        ({"token_ids": [1, 2], "model": "other"}, 404, "model 'other' is not served"),
        ({"token_ids": [1, 2], "cache_salt": "a/b"}, 422, "cache_salt"),
    ],
)
def test_refusals_name_their_cause(http, body, code, words):
    r = http.post(GENERATE, json=body)
    assert r.status_code == code and words in r.text, r.text


def test_weight_info_labels_the_served_version_and_a_relabel_only_names_it(http):
    """After the module's publish of version 3: vLLM's label of it, and /update_weight_version
    takes only that label (the app's version changes only with its weights)."""
    assert ok(http.get("/weight_info")) == {"weight_version": "3"}
    relabel = ok(http.post("/update_weight_version", json={"new_version": "3"}))
    assert relabel == {"success": True, "message": "Weight version updated to 3", "new_version": "3"}
    for label, code, words in [
        ("4", 409, "publish version 4 through POST /weights/update"),
        ("default", 409, "version 3 ('3') is served"),
        ("v4", 422, "names no version of this app"),
        ("03", 422, "names no version of this app"),
    ]:
        r = http.post("/update_weight_version", json={"new_version": label})
        assert r.status_code == code and words in r.text, (label, r.text)
    assert ok(http.get("/weight_info")) == {"weight_version": "3"}


def test_return_weight_versions_labels_the_openai_routes_spans_as_vllm_does(http):
    """vLLM 0.33's field on both OpenAI routes, streamed too: the spans' versions as vLLM's string
    labels; without it, this app's integers (version 3 is served by now)."""
    ask = {"prompt": "One two", "max_tokens": 3, "ignore_eos": True}
    plain = ok(http.post("/v1/completions", json=ask))["choices"][0]["weight_versions"]
    assert plain == [{"version": 3, "start": 0, "end": 3}]
    labelled = ok(http.post("/v1/completions", json={**ask, "return_weight_versions": True}))
    assert labelled["choices"][0]["weight_versions"] == [{"version": "3", "start": 0, "end": 3}]
    assert labelled["weight_version"] == 3, "the answer's own field stays the app's"
    chat = {"messages": [{"role": "user", "content": "One"}], "max_tokens": 3, "return_weight_versions": True}
    spans = ok(http.post("/v1/chat/completions", json=chat))["choices"][0]["weight_versions"]
    assert [s["version"] for s in spans] == ["3"]
    with http.stream("POST", "/v1/completions", json={**ask, "stream": True, "return_weight_versions": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    versions = {s["version"] for c in chunks for ch in c["choices"] for s in ch.get("weight_versions") or []}
    assert versions == {"3"}, chunks


def test_chat_prompt_logprobs_score_the_rendered_conversation_as_completions_do(http):
    """vLLM's chat `prompt_logprobs`, at the top of the answer: the same values a completion of
    the rendered conversation's ids gives."""
    messages = [{"role": "user", "content": "One two three"}]
    chat = ok(http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "prompt_logprobs": 2}))
    ids = chat["prompt_token_ids"]
    assert ids == ok(http.post("/tokenize", json={"messages": messages}))["tokens"]
    scored = chat["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    assert all(str(t) in position for t, position in zip(ids[1:], scored[1:], strict=True))
    assert "prompt_logprobs" not in chat["choices"][0], "vLLM's chat has them at the top only"
    same = ok(http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}))
    assert same["choices"][0]["prompt_logprobs"] == scored
    r = http.post("/v1/chat/completions", json={"messages": messages, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 422 and "prompt_logprobs are not available with stream" in r.text, r.text
