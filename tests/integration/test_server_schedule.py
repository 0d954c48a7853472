"""The app's own schedule (`global_profiler` in its args, docs/design.md#who-drives): with no
/profile/* call from anyone, the app starts step 1 once its replicas run and, at every version a
client publishes, stops the step that ends and starts the next profiled one, with the hold in
between; the steps verify clean and their manifests say the server drove. A client's own
/profile/start takes the driving over."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from integ_util import client, complete, ok, poll, status, wait_manifest, write_perturbed_weights
from support.apps import ServeApp, deployed

from profiling.analysis.verify import verify_steps
from profiling.store import TraceStore

pytestmark = pytest.mark.integration

REPLICAS = 2


@pytest.fixture(scope="module")
def app(ray_cluster, model_dir, tmp_path_factory) -> Iterator[ServeApp]:
    with deployed(
        ray_cluster,
        model_dir,
        tmp_path_factory.mktemp("schedule"),
        "rollout",
        global_profiler={"steps": [1, 2]},
        profiler={"max_forward_steps": 100_000, "max_duration_s": 300},
    ) as served:
        yield served


class Load:
    """Completions sent without pause from a few threads, as a framework's rollouts are."""

    def __init__(self, base_url: str, threads: int = 3):
        self._stop = threading.Event()
        self.answers: list[dict] = []
        self._threads = [threading.Thread(target=self._run, args=(base_url,)) for _ in range(threads)]

    def _run(self, base_url: str) -> None:
        with client(base_url) as c:
            while not self._stop.is_set():
                self.answers.append(complete(c, "One two three", max_tokens=6, ignore_eos=True))

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)


def _publish(app: ServeApp, http, model_dir, version: int) -> dict:
    write_perturbed_weights(model_dir, app.weights_dir / f"v{version}.safetensors", seed=version)
    return ok(http.post("/weights/update", json={"version": version, "path": f"v{version}.safetensors"}))


def test_the_app_drives_steps_1_and_2_from_the_versions_it_sees(app, http, model_dir):
    # A request right away: the app holds generation until step 1 starts, so it runs inside it.
    first = complete(http, "Hello", max_tokens=4)
    assert first["weight_version"] == 0
    begun = poll(lambda: (s := status(http))["active_step"] == 1 and s, timeout=60, what="step 1 to start")
    assert begun["driver"] == "server" and not begun["paused"], begun

    with Load(app.base_url):
        poll(
            lambda: all((r["forward_steps"] or 0) > 0 for r in status(http)["replicas"]),
            timeout=60,
            what="both replicas to run in step 1",
        )
        # A refused update stops nothing: the schedule acts only for an update that can happen.
        refused = http.post("/weights/update", json={"version": 1, "path": "missing.safetensors"})
        assert refused.status_code == 422 and status(http)["active_step"] == 1, refused.text
        v1 = _publish(app, http, model_dir, 1)
        assert v1["schedule"] == {"stopped_step": 1, "started_step": 2, "error": None}, v1["schedule"]
        assert status(http)["active_step"] == 2
        poll(
            lambda: all((r["forward_steps"] or 0) > 0 for r in status(http)["replicas"]),
            timeout=60,
            what="both replicas to run in step 2",
        )
        v2 = _publish(app, http, model_dir, 2)
        assert v2["schedule"] == {"stopped_step": 2, "started_step": None, "error": None}, v2["schedule"]
        v3 = _publish(app, http, model_dir, 3)
        assert v3["schedule"] == {"stopped_step": None, "started_step": None, "error": None}, v3["schedule"]
    assert status(http)["active_step"] is None

    for step in (1, 2):
        manifest = wait_manifest(http, step, ("complete", "partial"), timeout=120)
        assert manifest["status"] == "complete" and manifest["driver"] == "server", manifest
        rollout = [e for e in manifest["entries"] if e["role"] == "rollout"]
        assert len(rollout) == REPLICAS and all(e["forward_steps"] > 0 for e in rollout), rollout
        assert all(e["weight_versions"] == [step - 1] and e["forward_steps_outside"] == 0 for e in rollout), rollout
    report = verify_steps(TraceStore(app.save_path), [1, 2])
    assert report.ok, [v.message for v in report.violations]


def test_a_schedule_given_at_run_time_must_be_the_args_one(app, http):
    """POST /profile/schedule (a framework's plugin handing over its steps, docs/design.md#who-drives):
    the args' schedule again is taken as is; another one is refused naming both."""
    same = ok(http.post("/profile/schedule", json={"steps": [2, 1]}))
    assert same["schedule"] == {"steps": [1, 2], "profile_continuous_steps": False} and same["given_by"] == "args", same
    assert status(http)["schedule"] == same["schedule"]
    other = http.post("/profile/schedule", json={"steps": [1, 5], "profile_continuous_steps": True})
    assert other.status_code == 409, other.text
    assert "steps [1, 2]" in other.json()["detail"] and "steps [1, 5]" in other.json()["detail"], other.text
    assert http.post("/profile/schedule", json={"steps": []}).status_code == 422


def test_a_client_start_takes_the_driving_over(app, http, model_dir):
    assert status(http)["driver"] == "server"
    ok(http.post("/profile/start", json={"step": 9}))
    try:
        assert status(http)["driver"] == "client"
        # The app's schedule stands down: the update neither stops the client's step nor starts any.
        v4 = _publish(app, http, model_dir, 4)
        assert v4["schedule"] is None and status(http)["active_step"] == 9, v4
    finally:
        ok(http.post("/profile/stop", json={"step": 9}))
    assert wait_manifest(http, 9, ("complete", "partial"))["driver"] == "client"
    # The args' schedule stays the answer, but the app no longer drives by it.
    assert ok(http.post("/profile/schedule", json={"steps": [1, 2]}))["driver"] == "client"


def test_vllm_and_sglang_profile_routes_profile_the_step_the_served_weights_generate(app, http):
    served = status(http)["weight_version"]
    # SGLang's body (GET as SGLang's clients may send it): the step of the served weights, its options.
    started = http.request("GET", "/start_profile", json={"num_steps": 50, "activities": ["CPU"], "profile_id": "sg"})
    assert started.status_code == 200 and started.text == "Start profiling.\n", started.text
    st = status(http)
    assert st["active_step"] == served + 1 and st["driver"] == "client", st
    complete(http, max_tokens=4)
    stopped = http.post("/stop_profile")
    assert stopped.status_code == 200 and stopped.text == "Stop profiling. This will take some time.\n"
    manifest = wait_manifest(http, served + 1, ("complete", "partial"))
    assert manifest["tag"] == "sg" and manifest["options"]["max_forward_steps"] == 50, manifest
    assert manifest["status"] == "complete" and manifest["driver"] == "client", manifest
    # A stop with nothing active is vLLM's and SGLang's plain 200.
    assert http.post("/stop_profile").status_code == 200

    # vLLM's body; the step was recorded before: a fresh start sets that run aside, as /profile/start does.
    assert http.post("/start_profile", json={"max_iterations": 7, "profile_prefix": "vl"}).status_code == 200
    assert http.post("/start_profile").status_code == 200, "the active step again: nothing changes"
    assert status(http)["active_step"] == served + 1
    assert http.post("/stop_profile").status_code == 200
    assert wait_manifest(http, served + 1, ("complete", "partial"))["options"]["max_forward_steps"] == 7

    for body, field in (
        ({"output_dir": "/tmp/x"}, "output_dir"),
        ({"delay_iterations": 3}, "delay_iterations"),
        ({"profile_by_stage": True}, "profile_by_stage"),
        ({"max_iterations": 2, "num_steps": 2}, "num_steps"),
        ({"activities": ["RPD"]}, "activities"),
        ({"bogus": 1}, "bogus"),
    ):
        refused = http.post("/start_profile", json=body)
        assert refused.status_code == 422 and field in refused.json()["detail"], (body, refused.text)
    assert status(http)["active_step"] is None
