"""Fuzz every route of the running app from its own OpenAPI schema (GET /openapi.json) with
schemathesis: valid and invalid path parameters, headers and bodies, none may answer >= 500
(docs/design.md#status-codes: malformed input is a 422 naming the field, never a bare 500).

The app has a control token, so the control routes are fuzzed past the auth guard (most
requests carry the token, the others the schema's generated Authorization header). Between
requests the fuzz steers the state so handlers are reached, not only validation: a step is
active when stops are fuzzed, a successful start or stop is undone, and some weight updates
name a real checkpoint inside weights_dir. A 429 (export backlog full) is an answer, not a
failure: rapid start/stop cycles are what the fuzz does.
"""

from __future__ import annotations

import collections
import itertools
import json
import shutil
from collections.abc import Iterator

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from integ_util import HttpOptions, client, ok, status
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from support.apps import ServeApp, deployed

from serve_app.generate_api import version_label

pytestmark = pytest.mark.integration

TOKEN = "fuzz-token-fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FUZZ_STEP = 950
BASE_WEIGHTS = "base.safetensors"

# Every operation the schema must have, with how many examples each gets (positive and
# negative together), in the order they run: steps are recorded before they are looked up.
OPERATIONS: dict[tuple[str, str], int] = {
    ("GET", "/health"): 5,
    ("GET", "/ready"): 5,
    ("GET", "/metrics"): 5,
    ("GET", "/v1/models"): 5,
    ("POST", "/v1/completions"): 50,
    ("POST", "/v1/chat/completions"): 40,
    ("POST", "/inference/v1/generate"): 30,
    ("GET", "/get_world_size"): 5,
    ("GET", "/server_info"): 5,
    ("POST", "/tokenize"): 15,
    ("POST", "/detokenize"): 10,
    ("POST", "/reset_prefix_cache"): 10,
    ("POST", "/pause"): 15,
    ("POST", "/resume"): 5,
    ("POST", "/abort_requests"): 10,
    ("GET", "/is_paused"): 5,
    ("GET", "/weight_info"): 5,
    ("POST", "/update_weight_version"): 10,
    ("POST", "/init_weight_transfer_engine"): 5,
    ("POST", "/start_weight_update"): 5,
    ("POST", "/start_draft_weight_update"): 5,
    ("POST", "/update_weights"): 15,
    ("POST", "/finish_weight_update"): 5,
    ("POST", "/shutdown_weight_transfer_engine"): 5,
    ("POST", "/generate"): 30,
    ("GET", "/model_info"): 5,
    ("GET", "/get_server_info"): 5,
    ("GET", "/get_weight_version"): 5,
    ("GET", "/health_generate"): 5,
    ("POST", "/update_weights_from_disk"): 20,
    ("POST", "/pause_generation"): 10,
    ("POST", "/continue_generation"): 5,
    ("GET", "/flush_cache"): 5,
    ("POST", "/flush_cache"): 5,
    ("POST", "/init_weights_update_group"): 5,
    ("POST", "/begin_weight_update"): 5,
    ("POST", "/update_weights_from_distributed"): 5,
    ("POST", "/end_weight_update"): 5,
    ("POST", "/destroy_weights_update_group"): 5,
    ("GET", "/profile/status"): 15,
    ("GET", "/profile/clock"): 15,
    ("POST", "/profile/start"): 60,
    ("POST", "/profile/stop"): 60,
    # After /profile/start: a client drives by then, so a schedule is refused and steers nothing else.
    ("POST", "/profile/schedule"): 10,
    ("POST", "/start_profile"): 20,
    ("GET", "/start_profile"): 10,
    ("POST", "/stop_profile"): 5,
    ("GET", "/stop_profile"): 5,
    ("POST", "/weights/update"): 60,
    ("GET", "/profile/steps"): 15,
    ("GET", "/profile/steps/{k}"): 30,
}
STATEFUL = {
    "/profile/start",
    "/profile/stop",
    "/weights/update",
    "/pause",
    "/start_profile",
    "/update_weights_from_disk",
    "/update_weights",
    "/pause_generation",
}
GENERATION = {"/v1/completions", "/v1/chat/completions", "/inference/v1/generate", "/generate"}
REFUSED = {
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/start_draft_weight_update",
    "/finish_weight_update",
    "/shutdown_weight_transfer_engine",
    "/init_weights_update_group",
    "/begin_weight_update",
    "/update_weights_from_distributed",
    "/end_weight_update",
    "/destroy_weights_update_group",
}
"""Routes of other servers the app answers only with a refusal (never a 200)."""


@pytest.fixture(scope="module")
def fuzz_app(ray_cluster, model_dir, tmp_path_factory) -> Iterator[ServeApp]:
    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "token").write_text(TOKEN)
    with deployed(
        ray_cluster, model_dir, tmp, "fuzz", control_token_file=str(tmp / "token"), merge_on_complete=False
    ) as served:
        shutil.copyfile(model_dir / "model.safetensors", served.weights_dir / BASE_WEIGHTS)
        # Version 1 names BASE_WEIGHTS, so `reopen` can always ask for the served version again
        # (version 0 is the initial weights: no path may be published as it).
        with client(served.base_url, token=TOKEN) as c:
            ok(c.post("/weights/update", json={"version": 1, "path": BASE_WEIGHTS}))
        yield served


@pytest.fixture(scope="module")
def schema(fuzz_app):
    return schemathesis.openapi.from_url(f"{fuzz_app.base_url}/openapi.json", timeout=30)


HTTP = HttpOptions(app="fuzz_app", token=TOKEN)
"""How `http` (conftest.py) reaches this module's app."""


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


def reopen(http) -> None:
    """Leave the app idle and admitting: no client pause, no step, then the same version with resume."""
    ok(http.post("/resume"))
    st_ = status(http)
    if st_["active_step"] is not None:
        ok(http.post("/profile/stop", json={"step": st_["active_step"]}))
    ok(http.post("/weights/update", json={"version": status(http)["weight_version"], "path": BASE_WEIGHTS}))


def ensure_active(http) -> int | None:
    """The active step, starting FUZZ_STEP if idle (None: the start was refused, e.g. 429)."""
    active = status(http)["active_step"]
    if active is None:
        r = http.post("/profile/start", json={"step": FUZZ_STEP})
        active = r.json()["step"] if r.status_code == 200 else None
    return active


def steer(path: str, case, data, http) -> None:
    """Point some cases at real state, so handlers run past validation."""
    body = case.body if isinstance(case.body, dict) else None
    if path == "/profile/stop":
        active = ensure_active(http)
        if active is not None and body is not None and data.draw(st.booleans(), label="stop the active step"):
            body["step"] = active
    elif path == "/weights/update" and body is not None and data.draw(st.booleans(), label="a real checkpoint"):
        body["path"] = data.draw(st.sampled_from([BASE_WEIGHTS, f"./{BASE_WEIGHTS}", f"../weights/{BASE_WEIGHTS}"]))
        if data.draw(st.booleans(), label="the served version"):
            body["version"] = status(http)["weight_version"]
    elif path == "/update_weights_from_disk" and body is not None:
        if not data.draw(st.booleans(), label="the generated path"):  # the simplest draw loads
            body["model_path"] = BASE_WEIGHTS
            body.pop("weight_version", None)  # the served version + 1
    elif path == "/update_weights" and body is not None:
        if not data.draw(st.booleans(), label="the generated body"):
            case.body = {"weight_dir": BASE_WEIGHTS}
    elif path in GENERATION and body is not None:
        # Valid but costly sizes shrunk, so the fuzz spends its time on inputs, not on decoding.
        sampling = body.get("sampling_params")
        for fields in (body, sampling if isinstance(sampling, dict) else {}):
            if type(fields.get("n")) is int and fields["n"] > 4:
                fields["n"] = 4
            for key in ("max_tokens", "max_completion_tokens", "max_new_tokens"):
                if type(fields.get(key)) is int and fields[key] > 8:
                    fields[key] = 8
        if path == "/generate" and not data.draw(st.booleans(), label="the generated prompt"):
            # SGLang's body takes `input_ids` or `text`, one of them: a rule no schema states.
            body.pop("text", None)
            body.pop("rid", None)
            body["input_ids"] = [1, 2, 3]
        if path == "/generate" and body.get("sampling_params") is None:
            body["sampling_params"] = {"max_new_tokens": 8}  # SGLang's default is 128
        elif path == "/generate" and isinstance(sampling, dict):
            sampling.setdefault("max_new_tokens", 8)
        if (
            path == "/v1/chat/completions"
            and body.get("max_tokens") is None
            and body.get("max_completion_tokens") is None
        ):
            body["max_tokens"] = 8
    elif path == "/update_weight_version" and body is not None and data.draw(st.booleans(), label="the served label"):
        body["new_version"] = version_label(status(http)["weight_version"])
    elif path == "/profile/steps/{k}" and data.draw(st.booleans(), label="a recorded step"):
        recorded = ok(http.get("/profile/steps"))["steps"]
        if recorded:
            case.path_parameters = {"k": data.draw(st.sampled_from([s["step"] for s in recorded]))}


def test_schema_has_every_route(schema):
    """The fuzz below covers exactly the schema's operations: a new route must be added here."""
    found = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}
    assert found == set(OPERATIONS), found ^ set(OPERATIONS)


@pytest.mark.parametrize(("method", "path"), list(OPERATIONS), ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_no_request_is_a_server_error(fuzz_app, schema, http, session, method, path):
    operation = schema[path][method]
    modes = [GenerationMode.POSITIVE]
    if any(len(part) for part in (operation.path_parameters, operation.headers, operation.query, operation.body)):
        modes.append(GenerationMode.NEGATIVE)  # something to get wrong
    cases = st.one_of(*(operation.as_strategy(generation_mode=m) for m in modes))
    seen: collections.Counter[int] = collections.Counter()
    calls = itertools.count()

    @settings(
        max_examples=OPERATIONS[(method, path)],
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases, data=st.data())
    def fuzz(case, data):
        steer(path, case, data, http)
        # Four in five requests carry the token; the others keep the generated Authorization
        # header (every fifth, not a draw: a draw may leave none of them without it).
        headers = None if next(calls) % 5 == 4 else AUTH
        response = case.call(base_url=fuzz_app.base_url, session=session, headers=headers, timeout=120)
        seen[response.status_code] += 1
        case.validate_response(response, checks=[not_a_server_error])
        if response.status_code == 200 and path in STATEFUL:
            reopen(http)

    try:
        fuzz()
    finally:
        reopen(http)
    # The fuzz reached past validation and auth.
    if path in REFUSED:
        assert seen[200] == 0 and seen[400] + seen[422] >= 1, seen
    elif path == "/profile/schedule":
        assert seen[409] >= 1, seen  # a client drives the steps (the fuzz of /profile/start took over)
    else:
        assert seen[200] >= 1, seen
    if path in STATEFUL or path in GENERATION:
        assert seen[422] >= 1, seen
    if path == "/profile/stop":
        assert seen[409] >= 1, seen  # a stop of a step that is not the active one
    if path.startswith(("/profile", "/weights")):
        assert seen[401] >= 1, seen


# -- what a JSON schema cannot generate: non-finite numbers ---------------------------------------

NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e999"]
NUMERIC_FIELDS = [
    ("/profile/start", {"step": FUZZ_STEP}, "max_duration_s"),
    ("/profile/start", {"step": FUZZ_STEP}, "max_forward_steps"),
    ("/profile/start", {}, "step"),
    ("/profile/stop", {}, "step"),
    ("/weights/update", {"path": BASE_WEIGHTS}, "version"),
    ("/v1/completions", {"prompt": "Red green", "max_tokens": 2}, "temperature"),
    ("/v1/completions", {"prompt": "Red green"}, "max_tokens"),
    ("/v1/completions", {"prompt": "Red green", "max_tokens": 2}, "seed"),
    ("/v1/completions", {"prompt": "Red green", "max_tokens": 2}, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, "presence_penalty"),
]


@pytest.mark.parametrize(("route", "body", "field"), NUMERIC_FIELDS, ids=[f"{r}:{f}" for r, _, f in NUMERIC_FIELDS])
def test_non_finite_numbers_are_422(http, route, body, field):
    """Python's json (and so the server) reads NaN and Infinity literals; they must be a 422
    naming the field, and echoing them back must not break the JSON answer."""
    try:
        for literal in NON_FINITE:
            raw = json.dumps(body)[:-1] + (", " if body else "") + f'"{field}": {literal}}}'
            r = http.post(route, content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == 422, (raw, r.status_code, r.text)
            assert field in r.json()["detail"], (raw, r.text)
    finally:
        reopen(http)
