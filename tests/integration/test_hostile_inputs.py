"""Hostile and oversized inputs against the real app (embedded engine, real Ray Serve and HTTP):
each is answered with a clear 4xx or 503, nothing else changes, generation keeps serving, and a
step being profiled meanwhile keeps recording (docs/design.md#status-codes)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from integ_util import client, complete, ok, poll, status, write_perturbed_weights
from support.apps import ServeApp, deployed

HOLD_S = 4.0
MAX_BODY = 128 * 1024
MAX_PROMPT_CHARS = 20_000
MAX_PROMPTS = 8
KEEP_STEPS = 5  # the least the default max_exporting_steps (4) allows


@pytest.fixture(scope="module")
def app(ray_cluster, model_dir, tmp_path_factory) -> Iterator[ServeApp]:
    with deployed(
        ray_cluster,
        model_dir,
        tmp_path_factory.mktemp("hostile"),
        "hostile",
        num_replicas=1,
        hold_timeout_s=HOLD_S,
        merge_on_complete=False,
        keep_steps=KEEP_STEPS,
        request_limits={
            "max_body_bytes": MAX_BODY,
            "max_prompts": MAX_PROMPTS,
            "max_prompt_chars": MAX_PROMPT_CHARS,
            "max_ongoing_requests": 2,
            "max_queued_requests": 1,
        },
    ) as served:
        shutil.copyfile(model_dir / "model.safetensors", served.weights_dir / "base.safetensors")
        yield served


@pytest.fixture(scope="module")
def answers() -> list[str]:
    """Every error body this module received: none may name an absolute server path."""
    return []


_steps = iter(range(1, 10_000))


@pytest.fixture
def recording(http) -> Iterator[int]:
    """A step profiled across the test: it must still be recording afterwards, and record."""
    step = next(_steps)
    # Uncapped in practice (the queue test alone runs 1600 forward passes).
    ok(http.post("/profile/start", json={"step": step, "max_duration_s": 300, "max_forward_steps": 50_000}))
    try:
        yield step
        before = status(http)["replicas"][0]["forward_steps"]
        assert complete(http, "One two three", max_tokens=4)["choices"][0]["token_ids"], "generation stopped serving"
        after = status(http)
        assert after["active_step"] == step and after["replicas"][0]["state"] == "profiling", after
        assert after["replicas"][0]["forward_steps"] > before, "the active step stopped recording"
    finally:
        ok(http.post("/profile/stop", json={"step": step}))


def refused(r: httpx.Response, code: int, answers: list[str], *named: str) -> dict:
    assert r.status_code == code, (r.status_code, r.text)
    answers.append(r.text)
    body = r.json()
    for text in named:
        assert text in body["detail"], body
    return body


# -- generation requests -----------------------------------------------------------------------


def test_an_800_kb_prompt_is_refused_at_the_door_and_control_calls_stay_fast(http, recording, answers):
    with ThreadPoolExecutor(1) as pool:
        huge = pool.submit(http.post, "/v1/completions", json={"prompt": "word " * 160_000, "max_tokens": 4})
        t0 = time.monotonic()
        status(http)
        assert time.monotonic() - t0 < 5.0, "a control call waited behind the huge prompt"
        refused(huge.result(), 413, answers, "request_limits.max_body_bytes")


def test_a_chunked_body_over_the_limit_is_refused_as_it_arrives(http, recording, answers):
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 8):
            yield b"x" * 1024
        yield b'", "max_tokens": 4}'

    r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    refused(r, 413, answers, "request_limits.max_body_bytes")


def test_a_prompt_over_max_prompt_chars_is_refused_before_tokenizing(http, recording, answers):
    r = http.post("/v1/completions", json={"prompt": "a" * (MAX_PROMPT_CHARS + 1), "max_tokens": 4})
    refused(r, 422, answers, "max_prompt_chars")


def test_a_prompt_that_leaves_no_room_in_the_context_is_refused(http, recording, answers):
    """Within max_prompt_chars but over the tiny model's 512-token context once tokenized
    (tokenized off the event loop: a control call meanwhile is not held up)."""
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(http.post, "/v1/completions", json={"prompt": "One two three " * 1400, "max_tokens": 4})
        t0 = time.monotonic()
        status(http)
        assert time.monotonic() - t0 < 5.0
        refused(long.result(), 422, answers, "context")


def test_too_many_prompts_are_refused(http, recording, answers):
    r = http.post("/v1/completions", json={"prompt": ["Red"] * (MAX_PROMPTS + 1), "max_tokens": 2})
    refused(r, 422, answers, "max_prompts")


def test_a_full_queue_answers_503_with_retry_after(http, recording, answers):
    """Two requests run and one waits per replica; the rest are turned away, not queued forever."""
    body = {"prompt": "The quick brown fox", "max_tokens": 200, "temperature": 0.0}
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: http.post("/v1/completions", json=body), range(8)))
    busy = [r for r in results if r.status_code == 503]
    assert busy and any(r.status_code == 200 for r in results), [r.status_code for r in results]
    for r in busy:
        assert r.headers.get("retry-after"), r.headers
        refused(r, 503, answers, "max_queued_requests")


def test_a_request_to_another_host_name_is_refused(app, answers):
    """DNS rebinding: a page that resolves its own name to 127.0.0.1 sends its own Host."""
    with client(app.base_url) as c:
        for path in ("/v1/models", "/profile/status"):
            r = c.get(path, headers={"Host": "attacker.example"})
            refused(r, 403, answers, "loopback")
        assert c.get("/v1/models", headers={"Host": "localhost:8000"}).status_code == 200
        # TRL's VLLMClient and GRPOConfig default to host 0.0.0.0: a local client, not a rebinding page.
        for host in ("0.0.0.0:8000", "[::]:8000"):
            assert c.get("/v1/models", headers={"Host": host}).status_code == 200, host
        refused(c.get("/v1/models", headers={"Host": "0.0.0.0.attacker.example"}), 403, answers, "loopback")


# -- control calls -----------------------------------------------------------------------------


def test_a_window_over_the_start_limits_is_refused_and_nothing_starts(http, answers):
    for extra, named in (
        ({"max_duration_s": 7200}, "start_limits.max_duration_s"),
        ({"with_stack": True}, "start_limits.with_stack"),
        ({"max_forward_steps": 10**6}, "start_limits.max_forward_steps"),
    ):
        r = http.post("/profile/start", json={"step": 9000, **extra})
        refused(r, 422, answers, named)
        assert status(http)["state"] == "idle"
    assert complete(http, "Red green", max_tokens=2)["choices"]


def test_a_continuous_window_of_too_many_steps_is_refused(http, recording, answers):
    r = http.post("/profile/start", json={"step": recording, "steps": list(range(1, 10_002))})
    refused(r, 422, answers)


def test_repeated_stops_cannot_stretch_a_hold_past_hold_timeout_s(http, answers):
    """stop(pause) when idle holds engine steps; repeating it every half second does not renew
    the hold, and once it expires the app's desired state no longer holds either."""
    t0 = time.monotonic()
    ok(http.post("/profile/stop", json={"step": 1, "pause": True}))
    assert status(http)["paused"] is True
    # Repeats until 1 s before the deadline, then none: a renewing repeat would hold until
    # HOLD_S after the last one (>= 2 * HOLD_S - 1 s); a repeat after the expiry would rightly
    # hold anew, so none is sent then.
    while time.monotonic() - t0 < HOLD_S - 1.0:
        ok(http.post("/profile/stop", json={"step": 1, "pause": True}))
        time.sleep(0.5)
    while time.monotonic() - t0 < 2 * HOLD_S:
        st = status(http)
        if not st["paused"] and not st["replicas"][0]["paused"]:
            break
        time.sleep(0.1)
    released = time.monotonic() - t0
    assert not st["paused"] and not st["replicas"][0]["paused"], st
    assert released < HOLD_S + 1.5, f"the hold lasted {released:.1f} s (hold_timeout_s={HOLD_S})"
    assert complete(http, "Red green", max_tokens=2)["choices"]


def test_the_served_version_with_other_weights_is_a_conflict(app, http, model_dir, recording, answers):
    write_perturbed_weights(model_dir, app.weights_dir / "v1.safetensors", seed=1)
    write_perturbed_weights(model_dir, app.weights_dir / "v1b.safetensors", seed=2)
    ok(http.post("/weights/update", json={"version": 1, "path": "v1.safetensors"}))
    ok(http.post("/weights/update", json={"version": 1, "path": "v1.safetensors"}))  # the same again: idempotent
    r = http.post("/weights/update", json={"version": 1, "path": "v1b.safetensors"})
    refused(r, 409, answers, "served already")
    assert status(http)["weight_version"] == 1


def test_weights_that_are_not_one_fitting_checkpoint_are_refused_and_the_old_version_serves(
    app, http, model_dir, recording, answers
):
    import torch
    from safetensors.torch import load_file, save_file

    state = load_file(str(model_dir / "model.safetensors"))
    served = status(http)["weight_version"]
    two = app.weights_dir / "two"
    two.mkdir(exist_ok=True)
    shutil.copyfile(model_dir / "model.safetensors", two / "a.safetensors")
    shutil.copyfile(model_dir / "model.safetensors", two / "b.safetensors")
    emb = "model.embed_tokens.weight"
    save_file({**state, emb: state[emb][:-1].contiguous()}, str(app.weights_dir / "shape.safetensors"))
    save_file({**state, emb: state[emb].to(torch.bfloat16)}, str(app.weights_dir / "dtype.safetensors"))
    for path, named in (
        ("~/base.safetensors", "not expanded"),
        ("two", "keep one checkpoint per directory"),
        ("shape.safetensors", emb),
        ("dtype.safetensors", "dtype"),
    ):
        r = http.post("/weights/update", json={"version": served + 1, "path": path})
        refused(r, 422, answers, named)
        assert status(http)["weight_version"] == served


def test_a_corrupt_manifest_is_507_naming_the_step(app, http, answers):
    ok(http.post("/profile/start", json={"step": 9500}))
    complete(http, "Red green", max_tokens=2)
    ok(http.post("/profile/stop", json={"step": 9500}))
    manifest = app.save_path / "step_9500" / "manifest.json"
    poll(lambda: manifest.exists() and '"complete"' in manifest.read_text(), timeout=60, what="step 9500 complete")
    good = manifest.read_text()
    try:
        manifest.write_text('{"step": 9500, "status": ')  # cut short
        refused(http.get("/profile/steps/9500"), 507, answers, "step_9500/manifest.json")
        refused(http.get("/profile/steps"), 507, answers, "step_9500/manifest.json")
    finally:
        manifest.write_text(good)
    assert http.get("/profile/steps/9500").status_code == 200


def test_save_path_keeps_only_the_newest_steps(app, http):
    """keep_steps: every fresh start above removed the least recently written step directories."""
    kept = sorted(p.name for p in app.save_path.glob("step_*"))
    assert 0 < len(kept) <= KEEP_STEPS, kept
    assert "step_9500" in kept  # the newest


def test_no_error_body_named_a_server_path(app, answers):
    """Runs last: every refusal above named its cause without the server's directories."""
    assert answers, "the tests above collected no error body"
    for text in answers:
        for path in (app.save_path, app.weights_dir, app.save_path.parent):
            assert str(path) not in text, text
        assert "Traceback" not in text, text
