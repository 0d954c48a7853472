"""SGLang 0.5.23's native routes on the real app (docs/http_api.md#sglang-routes), as AReaL's
`RemoteSGLangEngine` and slime's `SGLangEngine` call them: /generate is a completion answered in
SGLang's shape; a disk sync (pause_generation, update_weights_from_disk, continue_generation)
publishes versions that answers label as SGLang does; what the app cannot do is refused in
SGLang's or vLLM's words."""

from __future__ import annotations

import pytest
from integ_util import ok, write_perturbed_weights
from transformers import AutoTokenizer

pytestmark = pytest.mark.integration

TOKENS = 6


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(p).input_ids for p in ("One two three", "Red green blue")]


def _completion(http, prompt, **fields) -> dict:
    body = {"prompt": prompt, "temperature": 0.0, "max_tokens": TOKENS, "ignore_eos": True, "logprobs": 2, **fields}
    return ok(http.post("/v1/completions", json=body))


def test_generate_is_the_completion_in_sglangs_shape(http, prompts):
    sampling = {"temperature": 0.0, "max_new_tokens": TOKENS, "ignore_eos": True}
    one = ok(
        http.post(
            "/generate",
            json={"input_ids": prompts[0], "sampling_params": sampling, "return_logprob": True, "rid": "r1"},
        )
    )
    same = _completion(http, prompts[0])["choices"][0]
    assert one["output_ids"] == same["token_ids"] and one["text"] == same["text"]
    meta = one["meta_info"]
    assert meta["id"] == "r1" and meta["finish_reason"] == {"type": "length", "length": TOKENS}, meta
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (len(prompts[0]), TOKENS, 0)
    assert meta["weight_version"] == "default"
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": TOKENS}]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == one["output_ids"]
    assert all(text is None for _, _, text in meta["output_token_logprobs"])
    for (lp, _, _), expected in zip(meta["output_token_logprobs"], same["logprobs"]["token_logprobs"], strict=True):
        assert lp == pytest.approx(expected, abs=1e-4)
    assert meta["input_token_logprobs"] == [], "SGLang's default logprob_start_len: no prompt logprobs"
    assert "output_top_logprobs" not in meta, "only with top_logprobs_num"

    # A batch (and n > 1) answers a list, prompt by prompt; top logprobs and the prompt's too.
    batch = ok(
        http.post(
            "/generate",
            json={
                "input_ids": prompts,
                "sampling_params": {**sampling, "n": 2},
                "return_logprob": True,
                "top_logprobs_num": 2,
                "logprob_start_len": 0,
                "rid": "b",
            },
        )
    )
    assert [a["meta_info"]["id"] for a in batch] == ["b_0_0", "b_0_1", "b_1_0", "b_1_1"]
    scored = _completion(http, prompts, n=2, prompt_logprobs=2)["choices"]
    for answer, choice in zip(batch, scored, strict=True):
        meta = answer["meta_info"]
        assert answer["output_ids"] == choice["token_ids"]
        tops = meta["output_top_logprobs"]
        assert [len(t) for t in tops] == [2] * TOKENS, "greedy: the sampled token is the most likely"
        assert [t[0][1] for t in tops] == answer["output_ids"]
        own = meta["input_token_logprobs"]
        assert [t for _, t, _ in own] == choice["prompt_token_ids"] and own[0][0] is None
        assert own[1][0] == pytest.approx(choice["prompt_logprobs"][1][str(own[1][1])]["logprob"], abs=1e-4)
        assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 2

    # Text in, a stop token out: SGLang's finish reason names what matched.
    stop_at = one["output_ids"][2]
    stopped = ok(
        http.post(
            "/generate",
            json={"text": "One two three", "sampling_params": {**sampling, "stop_token_ids": [stop_at]}},
        )
    )
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}, stopped
    assert stopped["output_ids"][-1] == stop_at and "output_token_logprobs" not in stopped["meta_info"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"input_ids": [1, 2], "unknown_field": 1}, "unknown_field"),
        ({"input_ids": [1, 2], "sampling_params": {"custom_params": {"return_top_p_token_ids": 1}}}, "custom_params"),
        ({"input_ids": [1, 2], "stream": True}, "stream"),
        ({"input_ids": [1, 2], "image_data": "a.png"}, "image_data"),
        ({"input_ids": [1, 2], "sampling_params": {"skip_special_tokens": False}}, "skip_special_tokens"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": None}}, "max_new_tokens"),
        ({"input_ids": [1, 2], "text": "One"}, "`input_ids` or as `text`"),
        ({"input_ids": [1, 10**9]}, "out of range"),
    ],
)
def test_generate_refuses_what_it_cannot_honour_naming_it(http, body, words):
    r = http.post("/generate", json=body)
    assert r.status_code == 422 and words in r.text, r.text


def test_a_disk_sync_publishes_versions_that_answers_label(http, app, model_dir, prompts):
    """AReaL's and slime's disk sync: pause, update from a path (the served version + 1, or
    slime's `weight_version`), continue; the labels of /model_info, /get_weight_version,
    /server_info and each answer follow, and a refusal is SGLang's 400."""
    assert ok(http.get("/get_weight_version")) == {"weight_version": "default"}
    info = ok(http.get("/model_info"))
    assert info["model_path"] == info["served_model_name"] == "tiny-llama" and info["weight_version"] == "default"
    assert ok(http.post("/pause_generation", json={})) == {"message": "Generation paused successfully.", "status": "ok"}
    assert ok(http.get("/is_paused"))["mode"] == "keep", "SGLang's abort holds requests here (for now)"
    write_perturbed_weights(model_dir, app.weights_dir / "v1.safetensors", seed=1)
    loaded = ok(
        http.post("/update_weights_from_disk", json={"model_path": "v1.safetensors", "abort_all_requests": True})
    )
    assert loaded["success"] is True and "Weight version updated to 1." in loaded["message"], loaded
    resumed = ok(http.post("/continue_generation", json={}))
    assert resumed == {"message": "Generation continued successfully.", "status": "ok"}
    answer = ok(http.post("/generate", json={"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 2}}))
    assert answer["meta_info"]["weight_version"] == "1"
    assert answer["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": 2}]

    # slime names the version; prime-rl's /update_weights {weight_dir} takes the next one.
    write_perturbed_weights(model_dir, app.weights_dir / "v3.safetensors", seed=3)
    ok(http.post("/update_weights_from_disk", json={"model_path": "v3.safetensors", "weight_version": "3"}))
    assert ok(http.get("/get_weight_version")) == {"weight_version": "3"}
    write_perturbed_weights(model_dir, app.weights_dir / "v4.safetensors", seed=4)
    prime = ok(http.post("/update_weights", json={"weight_dir": "v4.safetensors"}))
    assert prime["status"] == "ok" and prime["update"]["version"] == 4, prime
    relabel = ok(http.post("/update_weight_version", json={"new_version": "4", "abort_all_requests": True}))
    assert relabel == {"success": True, "message": "Weight version updated to 4", "new_version": "4"}

    for body, words in [
        ({"model_path": "missing.safetensors"}, "path"),
        ({"model_path": "v1.safetensors", "weight_version": "2"}, "version"),  # older than the served one
        ({"model_path": "v1.safetensors", "weight_version": "v5"}, "names no version"),
    ]:
        r = http.post("/update_weights_from_disk", json=body)
        assert r.status_code == 400 and r.json()["success"] is False and words in r.json()["message"], r.text
        assert str(app.weights_dir) not in r.text, "no server path in an answer"

    for route in ("/server_info", "/get_server_info"):
        server = ok(http.get(route, params={"config_format": "json"}))
        assert (server["tp_size"], server["dp_size"], server["weight_version"]) == (1, 2, "4"), server
        assert server["model_path"] == "tiny-llama" and server["vllm_config"]["parallel_config"]["world_size"] == 1


def test_flush_health_and_the_weight_routes_the_app_does_not_serve(http):
    for method in ("GET", "POST"):
        r = http.request(method, "/flush_cache")
        assert r.status_code == 200 and r.text.startswith("Cache flushed."), r.text
    assert http.get("/health_generate").status_code == 200
    chunk = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]]}
    group = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3}
    for route, body in [
        ("/init_weights_update_group", group),
        ("/begin_weight_update", {}),
        ("/update_weights_from_distributed", chunk),
        ("/end_weight_update", {}),
        ("/destroy_weights_update_group", {}),
    ]:
        r = http.post(route, json=body)
        assert r.status_code == 400 and r.json()["success"] is False, r.text
        assert "POST /weights/update with source path or collective" in r.json()["message"], r.text
    for route, body in [
        ("/init_weight_transfer_engine", {"init_info": {}}),
        ("/start_weight_update", None),
        ("/update_weights", {"update_info": {"names": []}}),
        ("/finish_weight_update", {}),
    ]:
        r = http.post(route, json=body)
        assert r.status_code == 422 and "Weight transfer not configured" in r.json()["detail"], (route, r.text)
        assert "POST /weights/update" in r.json()["detail"]
