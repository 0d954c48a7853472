"""The replica listener (docs/operations.md#replica-listener) on real Ray Serve, embedded engine,
2 replicas sharing one port: the rollout API's whole contract with the official `openai` client
through it, the same answers as Serve's port, both replicas serving the port, the control routes
handed to the controller, a client that goes away cancelling its generation, and a port that is
taken refusing the app with a message naming the key."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from integ_util import PROMPTS, client, ok, poll, status
from openai_contract import (  # noqa: F401 - collected here, on the replica listener
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
from support.apps import ServeApp, deployed
from transformers import AutoTokenizer

from serve_app.net import free_port, http_url

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def listened(ray_cluster, model_dir, tmp_path_factory):
    port = free_port()
    with deployed(
        ray_cluster, model_dir, tmp_path_factory.mktemp("listened"), "rollout", replica_listener={"port": port}
    ) as served:
        yield served, http_url("127.0.0.1", port)


@pytest.fixture(scope="module")
def app(listened) -> ServeApp:
    return listened[0]


@pytest.fixture(scope="module")
def direct(listened) -> str:
    return listened[1]


@pytest.fixture(scope="module")
def oai(direct) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{direct}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def test_the_listener_answers_as_serves_port_does(app, direct):
    body = {"prompt": ["One two three", "Red green"], "max_tokens": 12, "temperature": 0, "logprobs": 2}
    with client(app.base_url) as serve_port, client(direct) as listener:
        via_serve = ok(serve_port.post("/v1/completions", json=body))
        via_listener = ok(listener.post("/v1/completions", json=body))
    for a, b in zip(via_serve["choices"], via_listener["choices"], strict=True):
        assert (a["text"], a["token_ids"], a["weight_versions"]) == (b["text"], b["token_ids"], b["weight_versions"])
    assert via_serve["usage"] == via_listener["usage"]


def test_every_replica_serves_the_shared_port(direct):
    """The replicas share the port: the kernel spreads new connections over them."""
    with client(direct) as c:
        before = {r["replica_id"]: sum(r["forward_steps_by_version"].values()) for r in status(c)["replicas"]}

        def one(i: int) -> None:  # a connection each
            with client(direct) as own:
                ok(own.post("/v1/completions", json={"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 4}))

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(48)))
        after = {r["replica_id"]: sum(r["forward_steps_by_version"].values()) for r in status(c)["replicas"]}
    assert len(after) == 2
    assert all(after[r] > before.get(r, 0) for r in after), f"a replica served nothing on the shared port: {after}"


def test_the_control_routes_reach_the_controller(app, direct):
    with client(direct) as listener, client(app.base_url) as serve_port:
        started = ok(listener.post("/profile/start", json={"step": 41}))
        assert started["state"] == "profiling" and len(started["replicas"]) == 2
        assert status(serve_port)["active_step"] == 41, "the controller's state is the app's, on every port"
        ok(listener.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4}))
        stopped = ok(listener.post("/profile/stop", json={"step": 41}))
        assert stopped["stopped"] is True
        assert ok(listener.get("/health")) == {"status": "ok"}
        assert listener.get("/metrics").status_code == 200


def test_a_client_that_goes_away_cancels_its_generation(direct):
    """No proxy stands in front of the listener: the listener itself cancels a request whose
    client left, and the engine drops its sequence. The request waits in the engine behind an
    admission hold (a stop with pause), so it is surely under way when its client leaves."""
    with client(direct) as c:
        ok(c.post("/profile/start", json={"step": 43}))
        ok(c.post("/profile/stop", json={"step": 43, "pause": True}))
        try:
            with ThreadPoolExecutor(1) as pool:
                left = pool.submit(
                    httpx.post, f"{direct}/v1/completions", json={"prompt": "One two", "max_tokens": 8}, timeout=3.0
                )
                poll(
                    lambda: max(r["requests_in_flight"] for r in status(c)["replicas"]) >= 1,
                    timeout=2.5,
                    what="the held request to be under way",
                )
                with pytest.raises(httpx.ReadTimeout):
                    left.result()
            poll(
                lambda: all(r["requests_in_flight"] == 0 for r in status(c)["replicas"]),
                timeout=5,
                what="the abandoned request to leave the engine",
            )
        finally:
            ok(c.post("/profile/start", json={"step": 44}))  # ends the hold
            ok(c.post("/profile/stop", json={"step": 44}))


def test_a_port_that_is_taken_refuses_the_app_naming_the_key(ray_cluster, model_dir, tmp_path: Path):
    """Each replica's start fails, Serve gives the app up, and `serve status` names the cause."""
    from ray import serve

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with (
            pytest.raises(RuntimeError, match="Deploying application taken failed"),
            deployed(ray_cluster, model_dir, tmp_path, "taken", num_replicas=1, replica_listener={"port": port}),
        ):
            pass
    try:
        message = serve.status().applications["taken"].deployments["RolloutReplica"].message
    finally:
        serve.delete("taken")
    assert f"the replica listener cannot listen on 127.0.0.1:{port} (Address already in use)" in message, message
    assert "pick a free port for replica_listener.port" in message, message
