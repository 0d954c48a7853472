"""Unit-level tests of the trainer side without Ray: trainer/client.py against a fake of the
app's HTTP routes (a small FastAPI app under uvicorn on a loopback port), trainer/config.py, and
the call order of trainer.profiled_sync.ProfiledWeightSync with a recording fake client."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from profiling.manifest import SyncCost
from profiling.schedule import StepSchedule
from serve_app.api import StatusResponse, UpdateWeightsResponse
from serve_app.net import free_port
from trainer.client import RolloutClient, RolloutError, SyncRolloutClient
from trainer.config import ConfigError, load_config
from trainer.profiled_sync import ExternalPublisher, InClusterPublisher, ProfiledWeightSync

from .helpers import REPO_ROOT

STATUS_BODY = {
    "state": "idle",
    "active_step": None,
    "weight_version": 0,
    "paused": False,
    "replicas": [{"replica_id": "r1", "forward_steps_by_version": {"0": 3}}],
    "control_timeout_s": 30.0,
}
UPDATE_BODY = {"version": 1, "replicas": [{"replica_id": "r1", "weight_version": 1, "load_s": 0.01}], "load_s": 0.01}
CONFLICT_BODY = {
    "detail": "step 1 is being profiled; stop it before starting step 2",
    "replicas": [
        {"replica_id": "r1", "ok": True, "state": "profiling"},
        {"replica_id": "r2", "ok": False, "conflict": True, "error": "r2 is profiling step 1"},
    ],
}


class FakeRolloutApp:
    """A fake of the rollout app's HTTP API: every (method, path) answers from a script of
    (status, body[, headers]) tuples, taken in order, the last one repeating; every request is
    recorded."""

    def __init__(self) -> None:
        self.script: dict[tuple[str, str], list[tuple[int, Any]]] = {}
        self.delay_s: dict[tuple[str, str], float] = {}
        """How long a (method, path) takes to answer."""
        self.attempts: Counter[tuple[str, str]] = Counter()
        self.requests: list[dict[str, Any]] = []
        self.app = FastAPI()

        @self.app.api_route("/{path:path}", methods=["GET", "POST"])
        async def route(path: str, request: Request):
            key = (request.method, "/" + path)
            raw = await request.body()
            self.attempts[key] += 1
            self.requests.append(
                {"key": key, "headers": dict(request.headers), "json": (await request.json()) if raw else None}
            )
            await asyncio.sleep(self.delay_s.get(key, 0.0))
            answers = self.script.get(key)
            if not answers:
                return JSONResponse({"detail": f"fake: nothing scripted for {key}"}, status_code=404)
            status, body, *headers = answers.pop(0) if len(answers) > 1 else answers[0]
            if isinstance(body, str):
                return PlainTextResponse(body, status_code=status)
            return JSONResponse(body, status_code=status, headers=headers[0] if headers else None)

    def reset(self) -> None:
        self.script.clear()
        self.delay_s.clear()
        self.attempts.clear()
        self.requests.clear()


@pytest.fixture(scope="module")
def fake_server() -> Any:
    fake = FakeRolloutApp()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.05)
    fake.base_url = f"http://127.0.0.1:{port}"
    try:
        yield fake
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture
def fake(fake_server: FakeRolloutApp) -> FakeRolloutApp:
    fake_server.reset()
    return fake_server


def make_client(base_url: str, **kw: Any) -> RolloutClient:
    """A client with a fixed wait for control calls (the wait sized from the app is tested on its own)."""
    return RolloutClient(base_url, **{"retries": 2, "retry_backoff_s": 0.01, "control_wait_s": 30.0, **kw})


# -- trainer/client.py ---------------------------------------------------------------------------

BACKLOG_BODY = {"detail": "export backlog full: the traces of steps 1, 2 are still being written"}
START_BODY = {"step": 3, "steps": [3], "state": "profiling", "replicas": []}


async def test_a_control_call_waits_its_bound_on_the_app_not_the_read_timeout(fake):
    """The app's control_timeout_s (from /profile/status) sizes each control call's wait: a stop
    answered after longer than the client's read timeout is waited for, not given up and
    repeated; a collective update waits a control timeout per bucket."""
    from serve_app.api import UpdateWeightsRequest, control_bound_s
    from serve_app.weights.collective_schema import CollectiveTransfer, TensorMeta

    fake.script[("GET", "/profile/status")] = [(200, {**STATUS_BODY, "control_timeout_s": 2.0})]
    fake.script[("POST", "/profile/stop")] = [(200, {"step": 1, "stopped": True})]
    fake.delay_s[("POST", "/profile/stop")] = 1.0
    async with RolloutClient(fake.base_url, timeout_s=0.5, retries=0) as client:
        assert (await client.stop_profile(1)).stopped
        tensors = [TensorMeta(name=f"w{i}", dtype="float32", shape=[1 << 10]) for i in range(10)]
        transfer = CollectiveTransfer(
            address="127.0.0.1", port=1, group="g", secret="ab" * 16, bucket_bytes=1 << 12, tensors=tensors
        )
        body = UpdateWeightsRequest(version=1, source="collective", collective=transfer)
        wait = await client._control_wait("collective", body)
    assert fake.attempts[("POST", "/profile/stop")] == 1, "the stop was repeated: the wait was the read timeout"
    assert wait == control_bound_s("collective", 2.0, transfer) + 10.0 and wait > 10 * 2.0
    assert fake.attempts[("GET", "/profile/status")] == 1, "the app's control timeout is read once"


async def test_without_the_app_s_status_a_control_call_waits_the_read_timeout(fake):
    fake.script[("POST", "/profile/stop")] = [(200, {"step": 1, "stopped": True})]
    fake.delay_s[("POST", "/profile/stop")] = 1.0
    async with RolloutClient(fake.base_url, timeout_s=0.3, retries=0) as client:
        with pytest.raises(RolloutError) as info:
            await client.stop_profile(1)
    assert info.value.status == 0 and "ReadTimeout" in info.value.detail


async def test_429_export_backlog_is_waited_out_following_retry_after(fake):
    fake.script[("POST", "/profile/start")] = [
        (429, BACKLOG_BODY, {"Retry-After": "0.2"}),
        (429, BACKLOG_BODY, {"Retry-After": "0.2"}),
        (200, START_BODY),
    ]
    async with make_client(fake.base_url, retries=0) as client:
        t0 = time.perf_counter()
        resp = await client.start_profile(3)
    assert resp.state == "profiling"
    assert fake.attempts[("POST", "/profile/start")] == 3, "429s do not use up the transport retries"
    assert time.perf_counter() - t0 >= 0.4, "Retry-After was not honoured"


async def test_429_past_backlog_wait_raises_with_the_apps_message(fake):
    fake.script[("POST", "/profile/start")] = [(429, BACKLOG_BODY, {"Retry-After": "0.2"})]
    async with make_client(fake.base_url, backlog_wait_s=0.5) as client:
        with pytest.raises(RolloutError) as info:
            await client.start_profile(3)
    assert info.value.status == 429 and "export backlog full" in info.value.detail
    assert 2 <= fake.attempts[("POST", "/profile/start")] <= 4


async def test_409_raises_rollout_error_with_detail_and_replica_failures(fake):
    fake.script[("POST", "/profile/start")] = [(409, CONFLICT_BODY)]
    async with make_client(fake.base_url) as client:
        with pytest.raises(RolloutError) as info:
            await client.start_profile(2)
    err = info.value
    assert err.status == 409
    assert err.detail == CONFLICT_BODY["detail"]
    assert [r.replica_id for r in err.replicas] == ["r1", "r2"]
    assert err.replicas[1].ok is False and err.replicas[1].conflict is True
    msg = str(err)
    assert "409" in msg and CONFLICT_BODY["detail"] in msg
    assert "r2: r2 is profiling step 1" in msg
    assert "r1:" not in msg, "only failed replicas belong in the message"
    assert fake.attempts[("POST", "/profile/start")] == 1, "a 409 must not be retried"
    assert fake.requests[0]["json"] == {"step": 2}


async def test_503_is_retried_until_success(fake):
    fake.script[("POST", "/weights/update")] = [
        (503, {"detail": "busy"}),
        (503, {"detail": "busy"}),
        (200, UPDATE_BODY),
    ]
    async with make_client(fake.base_url) as client:
        resp = await client.update_weights(1, "/w/v1.safetensors", resume=False)
    assert isinstance(resp, UpdateWeightsResponse) and resp.version == 1
    assert fake.attempts[("POST", "/weights/update")] == 3
    body = {"version": 1, "source": "path", "path": "/w/v1.safetensors", "resume": False}
    assert all(r["json"] == body for r in fake.requests)


async def test_503_gives_up_after_the_retries(fake):
    fake.script[("POST", "/profile/stop")] = [(503, {"detail": "no replica available"})]
    async with make_client(fake.base_url) as client:
        with pytest.raises(RolloutError) as info:
            await client.stop_profile(1, pause=True)
    assert info.value.status == 503 and info.value.detail == "no replica available"
    assert fake.attempts[("POST", "/profile/stop")] == 3, "1 attempt + retries=2"
    assert fake.requests[0]["json"] == {"step": 1, "pause": True}


@pytest.mark.parametrize("status", [409, 422])
async def test_4xx_is_not_retried(fake, status):
    fake.script[("POST", "/weights/update")] = [(status, {"detail": f"path: refused ({status})"}), (200, UPDATE_BODY)]
    async with make_client(fake.base_url) as client:
        with pytest.raises(RolloutError) as info:
            await client.update_weights(1, "/elsewhere")
    assert info.value.status == status
    assert info.value.detail == f"path: refused ({status})"
    assert info.value.replicas == []
    assert fake.attempts[("POST", "/weights/update")] == 1


async def test_non_json_error_body_becomes_the_detail(fake):
    fake.script[("GET", "/profile/status")] = [(500, "Internal Server Error (plain text)")]
    async with make_client(fake.base_url) as client:
        with pytest.raises(RolloutError) as info:
            await client.status()
    assert info.value.status == 500
    assert info.value.detail == "Internal Server Error (plain text)"
    assert fake.attempts[("GET", "/profile/status")] == 1, "500 is not a retried status"


async def test_connection_refused_raises_status_0_after_retries(monkeypatch):
    attempts = []
    real_request = httpx.AsyncClient.request

    async def counting_request(self, method, url, *a, **kw):
        attempts.append((method, url))
        return await real_request(self, method, url, *a, **kw)

    monkeypatch.setattr(httpx.AsyncClient, "request", counting_request)
    port = free_port()  # nothing listens there
    async with make_client(f"http://127.0.0.1:{port}") as client:
        with pytest.raises(RolloutError) as info:
            await client.status()
    err = info.value
    assert err.status == 0
    assert "cannot reach the app" in err.detail
    assert isinstance(err.__cause__, httpx.TransportError)
    assert len(attempts) == 3, attempts


async def test_control_token_is_sent_as_bearer(fake):
    fake.script[("GET", "/profile/status")] = [(200, STATUS_BODY)]
    async with make_client(fake.base_url, control_token="s3cret-token") as client:
        await client.status()
    async with make_client(fake.base_url) as client:
        await client.status()
    with_token, without = fake.requests
    assert with_token["headers"].get("authorization") == "Bearer s3cret-token"
    assert "authorization" not in without["headers"]


def test_sync_client_works_from_plain_sync_code(fake):
    fake.script[("GET", "/profile/status")] = [(200, STATUS_BODY)]
    fake.script[("POST", "/weights/update")] = [(200, UPDATE_BODY)]
    fake.script[("POST", "/profile/start")] = [(409, CONFLICT_BODY)]
    with SyncRolloutClient(fake.base_url, control_token="tok", retry_backoff_s=0.01, control_wait_s=30.0) as client:
        first = client.status()
        second = client.status()  # the private loop and the connection pool are reused
        assert isinstance(first, StatusResponse) and first == second
        assert first.replicas[0].forward_steps_by_version == {0: 3}
        assert client.update_weights(1, "/w/v1").version == 1
        with pytest.raises(RolloutError) as info:
            client.start_profile(2)
        assert info.value.status == 409
    assert fake.attempts[("GET", "/profile/status")] == 2
    assert all(r["headers"].get("authorization") == "Bearer tok" for r in fake.requests)


# -- trainer/config.py ---------------------------------------------------------------------------


def test_steps_override_is_parsed_as_yaml():
    cfg = load_config(None, ["global_profiler.steps=[1,2,5]"])
    assert cfg.global_profiler.steps == [1, 2, 5]


def test_repo_config_with_overrides():
    cfg = load_config(
        REPO_ROOT / "config" / "trainer.yaml",
        ["trainer.total_versions=6", "global_profiler.steps=[5, 2]", "global_profiler.profile_continuous_steps=true"],
    )
    assert cfg.trainer.total_versions == 6
    assert cfg.global_profiler.steps == [2, 5]
    assert cfg.global_profiler.profile_continuous_steps is True
    assert cfg.trainer.trigger_parameter_sync_step == 2  # untouched file value


@pytest.mark.parametrize(
    "override, key",
    [("trainer.no_such_key=1", "trainer.no_such_key"), ("global_profiler.stepz=[1]", "global_profiler.stepz")],
)
def test_unknown_key_names_the_dotted_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert f"'{key}'" in str(info.value)
    assert "unknown key" in str(info.value)


def test_invalid_value_names_the_dotted_key():
    with pytest.raises(ConfigError, match=r"trainer\.total_versions"):
        load_config(None, ["trainer.total_versions=0"])


@pytest.mark.parametrize("override", ["global_profiler.steps", "=5"])
def test_malformed_override_raises(override):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert repr(override) in str(info.value)


def test_missing_config_file_raises_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")


# -- trainer/profiled_sync.py: call order ----------------------------------------------------------


class FakeClient:
    """Records the profiling and weight calls ProfiledWeightSync makes, in order."""

    def __init__(self, fail_stop: bool = False) -> None:
        self.calls: list[tuple] = []
        self.start_steps: dict[int, list[int]] = {}
        self.paths: dict[int, str] = {}
        self.fail_stop = fail_stop

    async def start_profile(self, step: int, **options: Any) -> None:
        self.calls.append(("start", step))
        self.start_steps[step] = options.get("steps")

    async def stop_profile(self, step: int, *, pause: bool = False) -> None:
        self.calls.append(("stop", step, pause))
        if self.fail_stop:
            raise RolloutError("POST", "/profile/stop", 0, "cannot reach the app", [])

    async def update_weights(self, version: int, path: str, *, resume: bool = True) -> UpdateWeightsResponse:
        self.calls.append(("update", version, resume))
        self.paths[version] = path
        return UpdateWeightsResponse(version=version, replicas=[], load_s=0.01)


def _record_syncs(schedule: StepSchedule, versions: range) -> tuple[FakeClient, list[list[tuple]]]:
    client = FakeClient()

    async def go() -> list[list[tuple]]:
        per_phase = []
        sync = ProfiledWeightSync(schedule, client, save_path=None)
        try:
            async with sync:
                per_phase.append(list(client.calls))
                for v in versions:
                    before = len(client.calls)

                    async def publish(v: int = v) -> Path:
                        return Path(f"/weights/v{v}.safetensors")

                    # alternate the two forms of `publish`: a path, and an async callable
                    await sync.sync(v, publish if v % 2 else f"/weights/v{v}.safetensors")
                    per_phase.append(client.calls[before:])
                before = len(client.calls)
            per_phase.append(client.calls[before:])  # what end() did
        finally:
            sync.shutdown()
        return per_phase

    return client, asyncio.run(go())


def test_discrete_steps_call_order():
    client, phases = _record_syncs(StepSchedule([1, 2, 5]), range(1, 7))
    begin, s1, s2, s3, s4, s5, s6, end = phases
    assert begin == [("start", 1)]
    assert s1 == [("stop", 1, True), ("update", 1, False), ("start", 2)]
    assert s2 == [("stop", 2, True), ("update", 2, True)]
    assert s3 == [("update", 3, True)]
    assert s4 == [("update", 4, False), ("start", 5)]
    assert s5 == [("stop", 5, True), ("update", 5, True)]
    assert s6 == [("update", 6, True)]
    assert end == [], "nothing is active after step 5 was stopped"
    assert client.start_steps == {1: [1], 2: [2], 5: [5]}
    assert client.paths == {v: f"/weights/v{v}.safetensors" for v in range(1, 7)}


def test_continuous_steps_call_order():
    client, phases = _record_syncs(StepSchedule([1, 2, 5], continuous=True), range(1, 7))
    begin, s1, s2, s3, s4, s5, s6, end = phases
    assert begin == [("start", 1)]
    assert s1 == [("update", 1, True)], "the update inside window {1,2} is not stopped around"
    assert s2 == [("stop", 1, True), ("update", 2, True)]
    assert s3 == [("update", 3, True)]
    assert s4 == [("update", 4, False), ("start", 5)]
    assert s5 == [("stop", 5, True), ("update", 5, True)]
    assert s6 == [("update", 6, True)]
    assert end == []
    assert client.start_steps == {1: [1, 2], 5: [5]}


def test_async_with_stops_the_active_step_when_the_body_raises():
    client = FakeClient()

    async def go() -> ProfiledWeightSync:
        sync = ProfiledWeightSync(StepSchedule([1, 2, 5]), client, save_path=None)
        try:
            with pytest.raises(ValueError, match="trainer died"):
                async with sync:
                    await sync.sync(1, "/weights/v1.safetensors")  # step 2 is now active
                    raise ValueError("trainer died")
        finally:
            sync.shutdown()
        return sync

    sync = asyncio.run(go())
    assert client.calls == [
        ("start", 1),
        ("stop", 1, True),
        ("update", 1, False),
        ("start", 2),
        ("stop", 2, False),  # end(): the active step is stopped, admission not held
    ]
    assert sync.active is None


def test_end_swallows_a_failing_stop_and_keeps_the_original_error():
    client = FakeClient(fail_stop=True)

    async def go() -> None:
        sync = ProfiledWeightSync(StepSchedule([1]), client, save_path=None)
        try:
            async with sync:
                raise KeyError("original")
        finally:
            sync.shutdown()

    with pytest.raises(KeyError, match="original"):
        asyncio.run(go())
    assert client.calls == [("start", 1), ("stop", 1, False)]


def test_unprofiled_run_makes_no_profiling_call():
    client, _ = _record_syncs(StepSchedule(None), range(1, 4))
    assert client.calls == [("update", 1, True), ("update", 2, True), ("update", 3, True)]


class FakeInCluster:
    """Records what an InClusterWeights would publish through the object store."""

    def __init__(self, client: FakeClient) -> None:
        self.client = client

    async def update_weights(self, version: int, state_dict: dict, *, resume: bool = True) -> UpdateWeightsResponse:
        self.client.calls.append(("update_in_cluster", version, resume, sorted(state_dict)))
        return UpdateWeightsResponse(version=version, replicas=[], transfer_s=0.02, load_s=0.01)


def test_a_state_dict_goes_through_the_transport_in_the_same_order():
    client = FakeClient()
    state = {"w": torch.zeros(2)}

    async def publish() -> dict:
        return state

    async def go() -> SyncCost:
        publisher = InClusterPublisher(FakeInCluster(client))  # type: ignore[arg-type]
        sync = ProfiledWeightSync(StepSchedule([1, 2]), client, save_path=None, publisher=publisher)
        try:
            async with sync:
                return (await sync.sync(1, publish)).cost
        finally:
            sync.shutdown()

    cost = asyncio.run(go())
    assert (cost.transfer, cost.transfer_s, cost.load_s) == ("object_store", 0.02, 0.01), cost
    assert client.calls == [
        ("start", 1),
        ("stop", 1, True),
        ("update_in_cluster", 1, False, ["w"]),
        ("start", 2),
        ("stop", 2, False),
    ]


def test_a_state_dict_without_a_transport_is_refused_before_any_call():
    client = FakeClient()

    async def publish() -> dict:
        return {"w": torch.zeros(2)}

    async def go() -> None:
        sync = ProfiledWeightSync(StepSchedule([1, 2]), client, save_path=None)
        sync.active = 1  # step 1 is being profiled
        try:
            with pytest.raises(TypeError, match="transport=InClusterWeights"):
                await sync.sync(1, publish)
        finally:
            sync.shutdown()

    asyncio.run(go())
    assert client.calls == [], "no stop may be sent for a sync that cannot update the weights"


class FakeAdoptingClient(FakeClient):
    """A FakeClient whose app is told a version the trainer moved itself (POST /weights/update
    with source external)."""

    async def adopt_weights(self, version: int, *, resume: bool = True) -> UpdateWeightsResponse:
        self.calls.append(("adopt", version, resume))
        return UpdateWeightsResponse(version=version, replicas=[], load_s=0.0)


def test_bring_your_own_update_runs_between_the_stop_and_the_app_learning_the_version():
    client = FakeAdoptingClient()

    async def update(version: int) -> None:
        client.calls.append(("own transfer", version))

    async def go() -> SyncCost:
        sync = ProfiledWeightSync(StepSchedule([1, 2]), client, save_path=None, publisher=ExternalPublisher(update))
        try:
            async with sync:
                return (await sync.sync(1)).cost
        finally:
            sync.shutdown()

    cost = asyncio.run(go())
    assert client.calls == [
        ("start", 1),
        ("stop", 1, True),
        ("own transfer", 1),
        ("adopt", 1, False),
        ("start", 2),
        ("stop", 2, False),
    ]
    assert cost.transfer == "external" and cost.transfer_s is not None and cost.publish_s is None, cost
