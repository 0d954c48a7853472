"""The status-code rules of docs/design.md#status-codes over real HTTP: idempotent start, 409
conflicts, 422 that names the field, 404s, and 401 on the control routes of a token-protected app.
(That no request turns into a 5xx is fuzzed from the app's OpenAPI schema in test_openapi_fuzz.py.)"""

from __future__ import annotations

import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from integ_util import HttpOptions, client, complete, generate_until_all_recorded, ok, status, stop_if_active
from support.apps import deployed

pytestmark = pytest.mark.integration


HTTP = HttpOptions(stop_at_end=True)
"""How `http` (conftest.py) reaches this module's app."""


@pytest.fixture(scope="module")
def base_weights(app, model_dir):
    """The served model's own weights, as a file inside weights_dir."""
    dst = app.weights_dir / "base.safetensors"
    shutil.copyfile(model_dir / "model.safetensors", dst)
    return dst


def assert_422_naming(resp: httpx.Response, field: str) -> None:
    assert resp.status_code == 422, f"{resp.status_code} {resp.text}"
    detail = resp.json()["detail"]
    assert isinstance(detail, str) and field in detail, detail


# -- start / stop rules ---------------------------------------------------------------------------


def test_fresh_app_is_idle_at_version_zero(http):
    """A newly deployed app (same name as the other modules' apps) inherits no desired state."""
    st_ = status(http)
    assert st_["state"] == "idle" and st_["active_step"] is None and st_["steps"] == []
    assert st_["weight_version"] == 0 and st_["paused"] is False
    assert len(st_["replicas"]) == 2
    for r in st_["replicas"]:
        assert r["ok"] and r["state"] == "idle" and r["weight_version"] == 0 and not r["paused"], r


def test_start_of_active_step_is_idempotent(http):
    step = 31
    try:
        first = ok(http.post("/profile/start", json={"step": step}))
        assert first["state"] == "profiling"
        generate_until_all_recorded(http, 2)
        before = {r["replica_id"]: r["forward_steps"] for r in status(http)["replicas"]}
        assert all(n > 0 for n in before.values()), before

        again = ok(http.post("/profile/start", json={"step": step}))
        assert again["step"] == step and again["state"] == "already_profiling"
        assert all(r["ok"] and r["state"] == "profiling" for r in again["replicas"]), again

        st_ = status(http)
        assert st_["state"] == "profiling" and st_["active_step"] == step
        after = {r["replica_id"]: r["forward_steps"] for r in st_["replicas"]}
        assert after == before  # no restart: the recordings (and their counts) carry on
        ok(http.post("/profile/stop", json={"step": step}))
    finally:
        stop_if_active(http)


def test_start_of_another_step_while_active_is_409(http):
    try:
        ok(http.post("/profile/start", json={"step": 32}))
        r = http.post("/profile/start", json={"step": 33})
        assert r.status_code == 409, r.text
        assert "32" in r.json()["detail"]
        assert status(http)["active_step"] == 32
    finally:
        stop_if_active(http)
    assert http.get("/profile/steps/33").status_code == 404  # the refused start recorded nothing


def test_stop_of_a_step_that_is_not_active_is_409(http):
    try:
        ok(http.post("/profile/start", json={"step": 34}))
        r = http.post("/profile/stop", json={"step": 35})
        assert r.status_code == 409, r.text
        assert "35" in r.json()["detail"] and "34" in r.json()["detail"]
        st_ = status(http)
        assert st_["active_step"] == 34 and all(r["state"] == "profiling" for r in st_["replicas"])
        ok(http.post("/profile/stop", json={"step": 34}))
    finally:
        stop_if_active(http)


def test_concurrent_control_calls_are_serialised(http):
    post = lambda body: http.post("/profile/start", json=body)  # noqa: E731
    try:
        with ThreadPoolExecutor(4) as pool:
            same = list(pool.map(post, [{"step": 37}] * 4))
        assert [r.status_code for r in same] == [200] * 4, [r.text for r in same]
        assert sorted(r.json()["state"] for r in same) == ["already_profiling"] * 3 + ["profiling"]
        with ThreadPoolExecutor(2) as pool:
            others = list(pool.map(post, [{"step": 38}, {"step": 39}]))
        assert [r.status_code for r in others] == [409, 409]
        ok(http.post("/profile/stop", json={"step": 37}))
        with ThreadPoolExecutor(2) as pool:
            race = list(pool.map(post, [{"step": 38}, {"step": 39}]))
        assert sorted(r.status_code for r in race) == [200, 409], [r.text for r in race]
        winner = next(r.json()["step"] for r in race if r.status_code == 200)
        assert status(http)["active_step"] == winner
    finally:
        stop_if_active(http)


def test_stop_when_idle_stops_nothing(http):
    assert status(http)["state"] == "idle"
    body = ok(http.post("/profile/stop", json={"step": 36}))
    assert body["stopped"] is False and body["step"] is None and body["replicas"] == []


def test_weight_version_must_not_decrease(http, base_weights):
    assert ok(http.post("/weights/update", json={"version": 3, "path": str(base_weights)}))["version"] == 3
    r = http.post("/weights/update", json={"version": 2, "path": str(base_weights)})
    assert r.status_code == 409, r.text
    assert "2" in r.json()["detail"] and "3" in r.json()["detail"]
    again = ok(http.post("/weights/update", json={"version": 3, "path": "base.safetensors"}))
    assert again["version"] == 3 and all(r["ok"] and r["weight_version"] == 3 for r in again["replicas"])
    assert status(http)["weight_version"] == 3
    assert complete(http, "Red", max_tokens=2)["weight_version"] == 3


# -- malformed input: 422 naming the field --------------------------------------------------------

BAD_START = [
    ({"step": 0}, "step"),
    ({"step": -3}, "step"),
    ({"step": "abc"}, "step"),
    ({}, "step"),
    ({"step": 1, "bogus": 1}, "bogus"),
    ({"step": 1, "tag": "../x"}, "tag"),
    ({"step": 1, "tag": "a b"}, "tag"),
    ({"step": 1, "tag": ".."}, "tag"),
    ({"step": 1, "tag": "x" * 65}, "tag"),
    ({"step": 1, "max_forward_steps": 0}, "max_forward_steps"),
    ({"step": 1, "max_duration_s": 0}, "max_duration_s"),
    ({"step": 1, "activities": []}, "activities"),
    ({"step": 1, "activities": ["gpu"]}, "activities"),
    ({"step": 1, "tool": "nsys-nope"}, "tool"),
    ({"step": 2, "steps": [1, 3]}, "steps"),
    ({"step": 1, "steps": [2, 3]}, "steps"),
]


@pytest.mark.parametrize("body,field", BAD_START, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_START)])
def test_start_rejects_malformed_input(http, body, field):
    assert_422_naming(http.post("/profile/start", json=body), field)
    assert status(http)["state"] == "idle"


@pytest.mark.parametrize(
    "body,field",
    [
        ({"step": 0}, "step"),
        ({"step": "abc"}, "step"),
        ({}, "step"),
        ({"step": 1, "bogus": 1}, "bogus"),
        ({"step": 1, "pause": "maybe"}, "pause"),
    ],
)
def test_stop_rejects_malformed_input(http, body, field):
    assert_422_naming(http.post("/profile/stop", json=body), field)


def test_weights_update_rejects_malformed_input(app, http, base_weights):
    version = status(http)["weight_version"]
    bad = app.weights_dir / "bad.safetensors"
    bad.write_bytes(b"\x00\x01 this is not a safetensors file \xff" * 10)
    text = app.weights_dir / "notes.txt"
    text.write_text("hello")
    cases = [
        ({"version": version, "path": "/etc/passwd"}, "passwd' is outside"),  # no absolute path in answers
        ({"version": version, "path": "../../etc/passwd"}, "../../etc/passwd"),
        ({"version": version, "path": str(app.weights_dir / "missing.safetensors")}, "missing.safetensors"),
        ({"version": version, "path": str(bad)}, "bad.safetensors"),
        ({"version": version, "path": str(text)}, "notes.txt"),
    ]
    for body, mention in cases:
        r = http.post("/weights/update", json=body)
        assert_422_naming(r, "path")
        assert mention in r.json()["detail"], r.json()
    # A readable safetensors file that does not fit the model: every replica refuses it.
    import torch
    from safetensors.torch import save_file

    save_file({"not.a.weight": torch.zeros(2)}, str(app.weights_dir / "wrong.safetensors"))
    r = http.post("/weights/update", json={"version": version + 1, "path": "wrong.safetensors"})
    assert r.status_code == 422, r.text
    assert "not loaded" in r.json()["detail"] and len(r.json()["replicas"]) == 2
    assert all(not rep["ok"] and rep["error"] for rep in r.json()["replicas"])
    assert_422_naming(http.post("/weights/update", json={"version": -1, "path": "base.safetensors"}), "version")
    assert_422_naming(http.post("/weights/update", json={"version": version}), "path")
    assert_422_naming(http.post("/weights/update", json={"version": version, "path": ""}), "path")
    assert_422_naming(http.post("/weights/update", json={"path": "base.safetensors"}), "version")
    assert_422_naming(http.post("/weights/update", json={"version": version, "path": "x", "extra": 1}), "extra")
    st_ = status(http)
    assert st_["weight_version"] == version and all(r["weight_version"] == version for r in st_["replicas"])


@pytest.mark.parametrize(
    "body,field",
    [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [999999]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": ["ok", ""]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "stream": "maybe"}, "stream"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"prompt": "hi", "stop": [""]}, "stop"),
        ({"prompt": "hi", "top_k": -2}, "top_k"),
        ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "hi", "bogus": True}, "bogus"),
    ],
)
def test_completions_reject_malformed_input(http, body, field):
    assert_422_naming(http.post("/v1/completions", json=body), field)


def test_unknown_model_is_404(http):
    r = http.post("/v1/completions", json={"prompt": "hi", "model": "other"})
    assert r.status_code == 404, r.text
    assert "other" in r.json()["detail"]


def test_unknown_or_malformed_step_lookup(http):
    r = http.get("/profile/steps/999")
    assert r.status_code == 404 and "999" in r.json()["detail"], r.text
    assert http.get("/profile/steps/0").status_code == 404
    r = http.get("/profile/steps/abc")
    assert r.status_code == 422 and re.search(r"\bk\b", r.json()["detail"]), r.text


@pytest.mark.parametrize("route", ["/profile/start", "/profile/stop", "/weights/update", "/v1/completions"])
@pytest.mark.parametrize("content", [b"{not json", b"", b"[1, 2", b"\xff\xfe"])
def test_invalid_json_is_422(http, route, content):
    r = http.post(route, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text


# -- edge inputs that reach deeper than pydantic ---------------------------------------------------


def test_weights_path_with_nul_byte_is_422(http):
    r = http.post("/weights/update", json={"version": 1_000, "path": "a\u0000b.safetensors"})
    assert r.status_code == 422, r.text


def test_weights_path_with_overlong_name_is_422(http):
    r = http.post("/weights/update", json={"version": 1_000, "path": "a" * 300 + ".safetensors"})
    assert r.status_code == 422, r.text


def test_tiny_temperature_is_not_a_server_error(http):
    r = http.post("/v1/completions", json={"prompt": "Red green", "max_tokens": 2, "temperature": 1e-40})
    assert r.status_code < 500, r.text


def test_huge_seed_is_not_a_server_error(http):
    r = http.post("/v1/completions", json={"prompt": "Red green", "max_tokens": 2, "seed": 2**70})
    assert r.status_code < 500, r.text


def test_huge_step_is_not_a_server_error(http):
    try:
        r = http.post("/profile/start", json={"step": 10**300})
        assert r.status_code < 500, r.text
    finally:
        # If the failed start left the desired state claiming the step, clear it.
        st_ = status(http)
        if st_["active_step"] is not None:
            http.post("/profile/stop", json={"step": st_["active_step"]})


def test_a_window_spanning_a_billion_steps_is_a_quick_422(http):
    """Found by the OpenAPI fuzz test: checking that steps [1, 10**9] are consecutive once built
    a list of 10**9 numbers, freezing the ingress until its health check killed it."""
    r = http.post("/profile/start", json={"step": 10**9, "steps": [1, 10**9]}, timeout=10)
    assert r.status_code == 422, r.text
    assert "must be consecutive" in r.json()["detail"]
    assert status(http)["state"] == "idle"


def test_huge_step_lookup_is_404(http):
    r = http.get(f"/profile/steps/{10**300}")
    assert r.status_code == 404, r.text


# -- auth --------------------------------------------------------------------------------------------


TOKEN = "s3cret-s3cret-s3cret"


@pytest.fixture(scope="module")
def secure(ray_cluster, model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("secure")
    (tmp / "token").write_text(TOKEN + "\n")
    with deployed(
        ray_cluster, model_dir, tmp, "secure", control_token_file=str(tmp / "token"), num_replicas=1
    ) as served:
        yield served


CONTROL_CALLS = [
    ("POST", "/profile/start", {"step": 1}),
    ("GET", "/profile/status", None),
    ("GET", "/profile/steps", None),
    ("GET", "/profile/steps/1", None),
    ("POST", "/profile/stop", {"step": 1}),
    ("POST", "/weights/update", {"version": 0, "path": "missing.safetensors"}),
]


def test_control_routes_need_the_token(secure):
    with client(secure.base_url) as c:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": TOKEN},
            {"Authorization": f"Basic {TOKEN}"},
            {"Authorization": "Bearer"},
            {"Authorization": f"Bearer {TOKEN}2"},
        ):
            for method, path, body in CONTROL_CALLS:
                r = c.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (headers, path, r.status_code, r.text)
                assert r.headers.get("www-authenticate") == "Bearer"
                assert "s3cret" not in r.text
        # Nothing was started by the rejected calls.
        r = c.get("/profile/status", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200 and r.json()["state"] == "idle"


def test_control_routes_accept_the_token(secure):
    with client(secure.base_url, token=TOKEN) as c:
        answers = {path: c.request(method, path, json=body).status_code for method, path, body in CONTROL_CALLS}
        assert 401 not in answers.values(), answers
        assert answers["/profile/start"] == answers["/profile/stop"] == answers["/profile/status"] == 200
        assert answers["/weights/update"] == 422
        stop_if_active(c)


def test_generation_routes_need_no_token(secure):
    with client(secure.base_url) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/ready").json()["ready"] is True  # the image's health check sends no token
        assert c.get("/v1/models").status_code == 200
        assert complete(c, "Red green", max_tokens=2)["choices"]
