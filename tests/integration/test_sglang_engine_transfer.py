"""SGLang's update-group routes on the real app (docs/sglang.md#the-update-group-over-http): two
replicas with engine sglang, each driving its own FAKE SGLang server (tests/fakes/fake_sglang_server.py:
NOT SGLang, which needs CUDA), driven over HTTP in the order slime drives an SGLang server:
/pause_generation, /init_weights_update_group (the test joins as rank 0 with SGLang's own
`init_custom_process_group`), /begin_weight_update, /update_weights_from_distributed while the
test broadcasts, /end_weight_update, /continue_generation. Each update is one sync of the app
(docs/design.md#engine-transfer): its `global_profiler` schedule stops step k at the begin and
starts step k+1 at the end, and every fake SGLang holds the tensors broadcast.
"""

from __future__ import annotations

import datetime
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.distributed as dist
from integ_util import complete_one, ok, poll, status, wait_manifest, write_perturbed_weights
from safetensors.torch import load_file
from support.apps import ServeApp, deployed
from support.fake_sglang import fake_servers, fake_sglang_options, served_weights

from profiling.analysis.verify import verify_steps
from profiling.store import TraceStore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO_ROOT = Path(__file__).resolve().parents[2]
REPLICAS = 2
HOLD_S = 15.0


@pytest.fixture(scope="module")
def app(ray_cluster, model_dir, tmp_path_factory) -> Iterator[ServeApp]:
    with deployed(
        ray_cluster,
        model_dir,
        tmp_path_factory.mktemp("sglang-transfer"),
        "sglxfer",
        engine="sglang",
        num_replicas=REPLICAS,
        control_timeout_s=90.0,
        hold_timeout_s=HOLD_S,
        sglang=fake_sglang_options(),
        global_profiler={"steps": [1, 2]},
        profiler={"max_forward_steps": 100_000, "max_duration_s": 300},
    ) as served:
        yield served


@pytest.fixture(scope="module")
def http(app) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=app.base_url, timeout=180.0) as c:
        yield c


def _with_trainer(call: Callable[[], httpx.Response], trainer_side: Callable[[], Any]) -> tuple[httpx.Response, Any]:
    """`call` (an HTTP call that returns once the trainer's side took part) on a thread while the
    trainer's side runs here."""
    answer: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: answer.update(response=call()))
    thread.start()
    result = trainer_side()
    thread.join(timeout=300)
    return answer["response"], result


def _sglang_ok(r: httpx.Response) -> dict:
    body = ok(r)
    assert body["success"] is True, body
    return body


def _refused(r: httpx.Response, *words: str) -> None:
    """SGLang's refusal: 400 {success: false, message} naming why."""
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["success"] is False and all(w in body["message"] for w in words), body


class Trainer:
    """Rank 0 of the app's update group, as slime's trainer forms it over HTTP."""

    def __init__(self, http: httpx.Client, name: str):
        sys.path.insert(0, str(REPO_ROOT / "docs" / "examples"))
        from byo_sglang_transfer import init_custom_process_group

        from serve_app.net import free_port

        self.http, self.name = http, name
        world = 1 + ok(http.get("/get_world_size"))["world_size"]
        port = free_port()
        body = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": world,
            "group_name": name,
            "backend": "gloo",
        }
        r, self.group = _with_trainer(
            lambda: http.post("/init_weights_update_group", json=body),
            lambda: init_custom_process_group(
                "gloo", f"tcp://127.0.0.1:{port}", world, 0, name, datetime.timedelta(seconds=120)
            ),
        )
        _sglang_ok(r)

    def publish(self, state: dict[str, torch.Tensor], version: str | None) -> dict:
        """One update as slime sends it; the answer of /end_weight_update."""
        from byo_sglang_transfer import broadcast_all

        ok(self.http.post("/pause_generation", json={"mode": "abort"}))
        _sglang_ok(self.http.post("/begin_weight_update", json={}))
        chunk = {
            "names": list(state),
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in state.values()],
            "shapes": [list(t.shape) for t in state.values()],
            "group_name": self.name,
        }
        if version is not None:
            chunk["weight_version"] = version
        r, _ = _with_trainer(
            lambda: self.http.post("/update_weights_from_distributed", json=chunk),
            lambda: broadcast_all(self.group, state),
        )
        _sglang_ok(r)
        ended = _sglang_ok(self.http.post("/end_weight_update", json={}))
        ok(self.http.post("/continue_generation", json={}))
        return ended

    def close(self) -> None:
        _sglang_ok(self.http.post("/destroy_weights_update_group", json={"group_name": self.name}))
        dist.destroy_process_group(self.group)


def test_slimes_calls_move_the_weights_into_every_sglang_and_the_app_profiles_each_version(app, http, model_dir):
    poll(lambda: status(http)["active_step"] == 1, timeout=180, what="step 1 to start")
    trainer = Trainer(http, "slime-group")
    try:
        sent = {}
        for version, label in [(1, None), (2, "2")]:
            path = write_perturbed_weights(model_dir, app.weights_dir / f"v{version}.safetensors", seed=version)
            state = load_file(str(path))
            ended = trainer.publish(state, label)
            assert ended["update"]["version"] == version, ended
            assert f"Weight version updated to {version}" in ended["message"], ended
            after = status(http)
            assert (after["weight_version"], after["active_step"], after["paused"]) == (
                version,
                2 if version == 1 else None,
                False,
            ), after
            assert [r["weight_version"] for r in after["replicas"]] == [version] * REPLICAS, after
            sent = state
    finally:
        trainer.close()
    assert complete_one(app)["choices"][0].get("weight_version") == 2
    # Every fake SGLang holds exactly the tensors the test broadcast last.
    urls = list(fake_servers(model_dir).values())
    assert len(urls) == REPLICAS, urls
    for url in urls:
        got = served_weights(url, sorted(sent), {n: t.numel() for n, t in sent.items()})
        assert all(torch.equal(got[n], t.float().flatten()) for n, t in sent.items()), url

    store = TraceStore(app.save_path)
    for step in (1, 2):
        wait_manifest(http, step, ("complete",), timeout=120)
        manifest = store.read_manifest(step)
        assert manifest is not None and manifest.driver == "server", manifest
        rollout = [e for e in manifest.entries if e.role == "rollout"]
        assert len(rollout) == REPLICAS and all(e.status == "ok" for e in rollout), manifest
    report = verify_steps(store, [1, 2])
    assert report.ok, report.violations


def test_out_of_order_calls_are_refused_in_sglangs_shape_and_an_abandoned_update_is_given_up(app, http):
    poll(lambda: not status(http)["paused"], timeout=60, what="the app to serve")
    chunk = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"}
    _refused(http.post("/update_weights_from_distributed", json=chunk), "no weight update is open")
    _refused(http.post("/end_weight_update", json={}), "no weight update is open")
    small = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": REPLICAS}
    _refused(http.post("/init_weights_update_group", json=small), f"world_size at least {REPLICAS + 1}")

    trainer = Trainer(http, "abandoned")
    try:
        _sglang_ok(http.post("/begin_weight_update", json={}))
        assert status(http)["paused"] is True
        _refused(http.post("/begin_weight_update", json={}), "open already")
        # Nothing more comes: the hold ends at hold_timeout_s and the engines close the update.
        poll(lambda: not status(http)["paused"], timeout=HOLD_S + 30, what="the hold to end")
        assert complete_one(app)["choices"]
        _refused(http.post("/end_weight_update", json={}), "given up")
        after = status(http)
        assert after["weight_version"] == 2, "a given-up update publishes nothing"
        assert [r["weight_version"] for r in after["replicas"]] == [2] * REPLICAS, after
        # Every SGLang closed the given-up update (SGLang refuses a second begin): the next goes through.
        ended = trainer.publish(load_file(str(app.weights_dir / "v1.safetensors")), None)
        assert ended["update"]["version"] == 3, ended
    finally:
        trainer.close()
