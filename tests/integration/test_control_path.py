"""The sync's critical path under RL-scale load and faults, over real Ray Serve and HTTP
(docs/design.md#control-path, #cancellation-safe-control, #desired-state):

* a profiled sync (stop -> update -> start) with 1024 generation requests in flight completes
  within a generous bound (the figures are benchmarks/control_under_load.py's), through Serve's
  port and again through the control listener (where /health is answered meanwhile), no
  request is lost or hung, and every step verifies clean;
* generation beyond a replica's queue is answered 503 with Retry-After, while control calls go on;
* a start and a weight update cut off at points all along their path (the client gives up after
  a delay, or sends Serve's `x-request-timeout-seconds`) leave the app consistent, the cut start's
  watchdog still ends the step, and a repeat answers as for a call that went through;
* the controller killed and restarted keeps the served version, its path and the active step (and
  a replica that restarts after it loads those weights); a fresh deployment of the app starts
  clean, one with `resume_state` takes over;
* two ingress replicas share one control plane, also when one of them is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

import aiohttp
import httpx
import pytest
from integ_util import (
    RESTART_TIMEOUT_S,
    HttpOptions,
    client,
    complete_concurrently,
    generate_until_all_recorded,
    kill_replica,
    ok,
    poll,
    status,
    stop_if_active,
    wait_for_fleet,
    wait_manifest,
    write_perturbed_weights,
)
from support.apps import deploy, deployed

from serve_app.net import free_port

pytestmark = pytest.mark.integration

IN_FLIGHT = 1024
SYNC_BOUND_S = 30.0
"""Generous: the benchmark's median at 1024 requests in flight is well under a second, and
before the control path had its own way through (the ingress's queue, the replicas' Serve
slots) one sync took 90 s."""
HEALTH_BOUND_S = 5.0
"""Generous too: the benchmark's p99 on the listener under 1024 clients is tens of milliseconds;
on Serve's port, behind the generation connections, seconds."""
PROMPT = "The rollout server answers question seven of the group"
UNCAPPED = 100_000


@pytest.fixture(scope="module")
def loaded_app(ray_cluster, model_dir, tmp_path_factory):
    listener = {"port": free_port()}
    with deployed(
        ray_cluster, model_dir, tmp_path_factory.mktemp("control"), "rollout", control_listener=listener
    ) as served:
        yield served


def _control_url(served) -> str:
    return f"http://127.0.0.1:{served.args['control_listener']['port']}"


HTTP = HttpOptions(app="loaded_app", stop_at_end=True)
"""How `http` (conftest.py) reaches this module's app."""


async def _flood(base_url: str, clients: int, stop: asyncio.Event, outcomes: Counter[str]) -> None:
    """`clients` closed-loop clients sending completions back to back until `stop` (so `clients`
    requests are in flight all along); counts every request's outcome in `outcomes` (a 503 must
    carry Retry-After, which is then honoured).
    aiohttp, not httpx: httpx's pool cannot keep a thousand requests in flight from one loop."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(base_url, connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as s:

        async def one_client(i: int) -> None:
            body = {"prompt": f"{PROMPT} {i}", "max_tokens": 16, "ignore_eos": True, "temperature": 1.0}
            while not stop.is_set():
                try:
                    async with s.post("/v1/completions", json=body) as r:
                        await r.read()
                        status, retry_after = r.status, r.headers.get("Retry-After")
                except (aiohttp.ClientError, TimeoutError) as e:
                    outcomes[type(e).__name__] += 1
                    continue
                if status == 503 and retry_after is not None:
                    outcomes["503 with Retry-After"] += 1
                    await asyncio.sleep(float(retry_after))
                else:
                    outcomes[str(status)] += 1

        await asyncio.wait_for(asyncio.gather(*(one_client(i) for i in range(clients))), timeout=600)


async def _held_requests(c: httpx.AsyncClient) -> int:
    """Generation requests the replicas hold now: running in their engines or waiting in their queue."""
    st = (await c.get("/profile/status")).json()
    return sum((r.get("requests_in_flight") or 0) + (r.get("requests_waiting") or 0) for r in st["replicas"])


def test_a_profiled_sync_completes_with_1024_requests_in_flight(loaded_app, http, model_dir, report_section):
    """Under a full load: the opening sync (update to v1 holding admission, start step 2), a second
    of generation, then the timed profiled sync (stop step 2 holding admission, update to v2, start
    step 3). Windows uncapped (the default caps at 200 passes), so exactness is checked whole:
    every pass on v1 in step 2's trace, none outside it."""
    from profiling.analysis.verify import verify_steps
    from profiling.store import TraceStore
    from trainer.client import RolloutClient

    first, second, third = (
        write_perturbed_weights(model_dir, loaded_app.weights_dir / f"load-v{v}.safetensors", seed=10 + v)
        for v in (1, 2, 3)
    )

    async def profiled_sync(trainer: RolloutClient, stop_step: int, version: int, path: str) -> tuple[float, str]:
        t0 = time.monotonic()
        await trainer.stop_profile(stop_step, pause=True)
        t1 = time.monotonic()
        await trainer.update_weights(version, path, resume=False)
        t2 = time.monotonic()
        await trainer.start_profile(stop_step + 1, max_forward_steps=UNCAPPED)
        t3 = time.monotonic()
        return t3 - t0, f"stop {t1 - t0:.2f}s, update {t2 - t1:.2f}s, start {t3 - t2:.2f}s"

    async def scenario() -> tuple[float, str, float, str, list[float], int, Counter[str]]:
        async with (
            RolloutClient(loaded_app.base_url) as trainer,
            RolloutClient(loaded_app.base_url, control_url=_control_url(loaded_app)) as listening,
            httpx.AsyncClient(base_url=loaded_app.base_url, timeout=60) as probe,
            httpx.AsyncClient(base_url=_control_url(loaded_app), timeout=60) as listener,
        ):
            stop, outcomes = asyncio.Event(), Counter[str]()
            flood = asyncio.ensure_future(_flood(loaded_app.base_url, IN_FLIGHT, stop, outcomes))
            # Once as many requests were answered as are in flight, the app has been full for a
            # whole turnover: its queues hold what the load keeps there.
            deadline = time.monotonic() + 300
            while sum(outcomes.values()) < IN_FLIGHT:
                assert time.monotonic() < deadline and not flood.done(), f"outcomes so far {outcomes}"
                await asyncio.sleep(0.5)
            await trainer.update_weights(1, str(first), resume=False)
            await trainer.start_profile(2, max_forward_steps=UNCAPPED)
            await asyncio.sleep(1.0)
            held = await _held_requests(probe)
            sync_s, parts = await profiled_sync(trainer, 2, 2, str(second))
            await asyncio.sleep(1.0)
            health_s = []
            for _ in range(5):
                t0 = time.monotonic()
                assert (await listener.get("/health")).status_code == 200
                health_s.append(time.monotonic() - t0)
            listened_s, listened_parts = await profiled_sync(listening, 3, 3, str(third))
            await asyncio.sleep(1.0)
            await listening.stop_profile(4)
            stop.set()
            await flood
            return sync_s, parts, listened_s, listened_parts, health_s, held, outcomes

    try:
        sync_s, parts, listened_s, listened_parts, health_s, held, outcomes = asyncio.run(scenario())
    finally:
        stop_if_active(http)
    report_section("control path under load")(
        f"profiled sync with {IN_FLIGHT} requests in flight ({held} held by the replicas): {sync_s:.2f}s "
        f"({parts}) through Serve's port, {listened_s:.2f}s ({listened_parts}) through the control listener, "
        f"whose /health took {max(health_s) * 1000:.0f} ms at most; outcomes {dict(outcomes)}"
    )
    assert sync_s < SYNC_BOUND_S, f"the sync took {sync_s:.1f}s behind the generation load"
    assert listened_s < SYNC_BOUND_S, f"the sync through the control listener took {listened_s:.1f}s"
    assert max(health_s) < HEALTH_BOUND_S, f"/health on the control listener took {max(health_s):.2f}s"
    assert set(outcomes) <= {"200", "503 with Retry-After"}, f"requests lost or refused without Retry-After: {outcomes}"
    assert outcomes["200"] >= IN_FLIGHT, outcomes
    with client(loaded_app.base_url) as c:
        for k in (2, 3, 4):
            assert wait_manifest(c, k, ("complete", "partial"), timeout=120)["status"] == "complete"
    store = TraceStore(loaded_app.save_path)
    report = verify_steps(store, [2, 3, 4])
    assert report.ok, [v.message for v in report.violations]
    manifest = store.read_manifest(2)
    assert manifest is not None
    outside = [e.forward_steps_outside for e in manifest.entries if e.role == "rollout"]
    assert outside and all(n == 0 for n in outside), outside


# -- generation beyond capacity -----------------------------------------------------------------


def test_generation_beyond_the_queue_is_answered_503_with_retry_after_and_control_goes_on(
    ray_cluster, model_dir, tmp_path
):
    limits = {"max_ongoing_requests": 1, "max_queued_requests": 1}
    with (
        deployed(
            ray_cluster,
            model_dir,
            tmp_path,
            "small",
            num_replicas=1,
            request_limits=limits,
            transformers={"max_batch_size": 1},
        ) as small,
        client(small.base_url) as c,
    ):

        async def crowd() -> tuple[list[httpx.Response], list[int]]:
            async with httpx.AsyncClient(base_url=small.base_url, timeout=120) as ac:
                body = {"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True}
                calls = [asyncio.ensure_future(ac.post("/v1/completions", json=body)) for _ in range(6)]
                await asyncio.sleep(1.0)  # one runs, one waits, four were refused
                control = [
                    (await ac.get("/profile/status")).status_code,
                    (await ac.post("/profile/start", json={"step": 40})).status_code,
                    (await ac.post("/profile/stop", json={"step": 40})).status_code,
                ]
                return list(await asyncio.gather(*calls)), control

        answers, control = asyncio.run(crowd())
        assert control == [200, 200, 200], "a control call waited for generation"
        codes = Counter(r.status_code for r in answers)
        assert codes == {200: 2, 503: 4}, codes
        for r in (r for r in answers if r.status_code == 503):
            assert r.headers["Retry-After"] == "1" and "max_queued_requests" in r.json()["detail"], r.text
        assert ok(c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}))["choices"]


# -- control calls cut off mid-flight -----------------------------------------------------------

CUTS_S = (0.001, 0.005, 0.02, 0.05, 0.1, 0.2)
"""Client-side delays after which a control call is given up: points all along its path (before
the controller has it, while it publishes, while it broadcasts, while its records are written)."""


def _cut(base_url: str, path: str, body: dict, after_s: float, how: str) -> None:
    """POST `body` and give up after `after_s`: the client closes the connection (`disconnect`),
    or asks Serve's proxy to time the request out (`header`)."""
    if how == "disconnect":
        with contextlib.suppress(httpx.TimeoutException), httpx.Client(base_url=base_url, timeout=after_s) as c:
            c.post(path, json=body)
    else:
        with httpx.Client(base_url=base_url, timeout=60) as c:
            c.post(path, json=body, headers={"x-request-timeout-seconds": str(after_s)})


def _settled_update(c: httpx.Client, version: int) -> dict | str:
    """The status once the app and every replica serve `version` or the one before (the cut came
    before the controller had the update); else what they serve (falsy: poll again)."""
    st = status(c)
    served = {st["weight_version"], *(r["weight_version"] for r in st["replicas"])}
    return st if len(served) == 1 and served <= {version - 1, version} else ""


def _all_replicas(c: httpx.Client, **expected: object) -> dict | None:
    st = status(c)
    return st if st["replicas"] and all(all(r[k] == v for k, v in expected.items()) for r in st["replicas"]) else None


def test_a_start_cut_off_at_once_still_ends_at_max_duration_s(loaded_app, http):
    """A start given up by its client after a few milliseconds, once it reached the controller:
    it runs to its end and keeps its watchdog, so nobody stops the step and it ends by itself;
    meanwhile another step's start is refused (the step is active, not half-started)."""
    step, limit = 20, 2.0
    for after_s in CUTS_S:  # the first cut late enough that the controller had the call
        _cut(loaded_app.base_url, "/profile/start", {"step": step, "max_duration_s": limit}, after_s, "disconnect")
        time.sleep(0.5)
        if status(http)["state"] == "profiling":
            break
    try:
        active = poll(
            lambda: _all_replicas(http, active_step=step, state="profiling"),
            timeout=30,
            what="the cut start to reach every replica",
        )
        assert active["active_step"] == step
        assert http.post("/profile/start", json={"step": step + 1}).status_code == 409
        poll(lambda: status(http)["state"] == "idle", timeout=limit + 15, what="the cut start's watchdog to end it")
    finally:
        stop_if_active(http)
    manifest = wait_manifest(http, step, ("complete", "partial"))
    assert manifest["status"] == "complete" and manifest["auto_stopped"] == "max_duration_s", manifest


@pytest.mark.parametrize("how", ["disconnect", "header"])
def test_starts_and_updates_cut_off_anywhere_leave_the_app_consistent(loaded_app, http, model_dir, how):
    base = 100 if how == "disconnect" else 200
    weights = write_perturbed_weights(model_dir, loaded_app.weights_dir / f"cut-{how}.safetensors", seed=base)
    version = status(http)["weight_version"]
    for i, after_s in enumerate(CUTS_S):
        step = base + i
        _cut(loaded_app.base_url, "/profile/start", {"step": step}, after_s, how)
        try:
            # Either the cut came before the controller had the call (nothing happened) or the
            # start ran to its end on every replica; never in between for long.
            poll(
                lambda: status(http)["state"] == "idle" or _all_replicas(http, active_step=step),  # noqa: B023
                timeout=30,
                what=f"a start cut after {after_s}s to settle",
            )
            again = ok(http.post("/profile/start", json={"step": step}))
            assert again["state"] in ("profiling", "already_profiling") and all(r["ok"] for r in again["replicas"])
            assert _all_replicas(http, active_step=step, state="profiling"), status(http)
            session = loaded_app.save_path / f"step_{step}" / "session.json"
            poll(session.is_file, timeout=30, what=f"step {step}'s session record")  # written after the answer
            stopped = ok(http.post("/profile/stop", json={"step": step}))
            repeat = ok(http.post("/profile/stop", json={"step": step}))
            assert repeat == stopped, "a repeated stop must answer as the stop it repeats"
        finally:
            stop_if_active(http)
        assert wait_manifest(http, step, ("complete", "partial"))["status"] == "complete"

        version += 1
        update = {"version": version, "path": str(weights)}
        _cut(loaded_app.base_url, "/weights/update", update, after_s, how)
        poll(
            lambda: _settled_update(http, version),  # noqa: B023
            timeout=30,
            what=f"an update cut after {after_s}s to settle",
        )
        answer = ok(http.post("/weights/update", json=update))
        assert answer["version"] == version and all(r["ok"] for r in answer["replicas"]), answer
        assert _all_replicas(http, weight_version=version, paused=False), status(http)


# -- the controller restarted; fresh and resumed deployments ------------------------------------


def _controller_actor(app_name: str) -> str | None:
    """The app's live controller replica actor (None between a kill and its successor)."""
    import ray

    prefix = f"SERVE_REPLICA::{app_name}#RolloutController#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    assert len(names) <= 1, names
    return names[0] if names else None


def test_a_restarted_controller_keeps_version_path_and_step_and_joiners_load_those_weights(
    ray_cluster, model_dir, tmp_path
):
    import ray

    listener = {"port": free_port()}
    with (
        deployed(ray_cluster, model_dir, tmp_path, "restarts", control_listener=listener) as served,
        client(served.base_url) as c,
    ):
        weights = write_perturbed_weights(model_dir, served.weights_dir / "v3.safetensors", seed=3)
        ok(c.post("/weights/update", json={"version": 3, "path": str(weights)}))
        step = 4
        ok(c.post("/profile/start", json={"step": step}))
        try:
            old = _controller_actor(served.name)
            assert old is not None
            ray.kill(ray.get_actor(old, namespace="serve"), no_restart=True)
            poll(
                lambda: (
                    _controller_actor(served.name) not in (None, old) and c.get("/profile/status").status_code == 200
                ),
                timeout=RESTART_TIMEOUT_S,
                what="Serve to restart the controller",
                interval=0.5,
            )
            st = status(c)
            assert st["weight_version"] == 3 and st["active_step"] == step and st["state"] == "profiling", st
            # The restarted controller listens on the same port again.
            with client(_control_url(served)) as listening:
                assert status(listening)["weight_version"] == 3
            again = ok(c.post("/weights/update", json={"version": 3, "path": str(weights)}))
            assert again["version"] == 3, "the restarted controller lost the served version's path"
            # A replica that starts now loads version 3 from that path and joins the step late.
            victim = st["replicas"][0]
            kill_replica(victim, {r["pid"] for r in st["replicas"]})
            live = wait_for_fleet(c, 2, {victim["replica_id"]})
            assert all(r["weight_version"] == 3 and r["active_step"] == step for r in live), live
            complete_concurrently(c, n=4, max_tokens=4)
            ok(c.post("/profile/stop", json={"step": step}))
        finally:
            stop_if_active(c)
        manifest = wait_manifest(c, step, ("complete", "partial"))
        late = [e for e in manifest["entries"] if e["role"] == "rollout" and e["late_start"]]
        assert len(late) == 1 and late[0]["weight_version"] == 3, manifest


def test_a_fresh_deployment_starts_clean_and_resume_state_takes_over(ray_cluster, model_dir, tmp_path):
    from ray import serve

    name = "redeployed"
    try:
        first = deploy(ray_cluster, model_dir, tmp_path / "a", name)
        with client(first.base_url) as c:
            weights = write_perturbed_weights(model_dir, first.weights_dir / "v5.safetensors", seed=5)
            ok(c.post("/weights/update", json={"version": 5, "path": str(weights)}))
            ok(c.post("/profile/stop", json={"step": 1, "pause": True}))  # a hold, left behind
        resumed = deploy(ray_cluster, model_dir, tmp_path / "a", name, resume_state=True)
        with client(resumed.base_url) as c:
            st = status(c)
            assert st["weight_version"] == 5 and all(r["weight_version"] == 5 for r in st["replicas"]), st
        fresh = deploy(ray_cluster, model_dir, tmp_path / "a", name)
        with client(fresh.base_url) as c:
            st = status(c)
            assert st["weight_version"] == 0 and st["state"] == "idle" and not st["paused"], st
            assert all(r["weight_version"] == 0 and not r["paused"] for r in st["replicas"]), st
    finally:
        serve.delete(name)


# -- several ingress replicas -------------------------------------------------------------------


def _ingress_actors(app_name: str) -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::{app_name}#RolloutIngress#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def test_two_ingress_replicas_share_one_control_plane(ray_cluster, model_dir, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    import ray

    with (
        deployed(ray_cluster, model_dir, tmp_path, "fronts", num_ingress_replicas=2) as served,
        client(served.base_url) as c,
    ):
        assert len(_ingress_actors(served.name)) == 2
        post = lambda body: c.post("/profile/start", json=body)  # noqa: E731
        try:
            for race in range(3):  # the proxy spreads the two calls over the two ingress replicas
                a, b = 10 * race + 1, 10 * race + 2
                with ThreadPoolExecutor(2) as pool:
                    answers = list(pool.map(post, [{"step": a}, {"step": b}]))
                assert sorted(r.status_code for r in answers) == [200, 409], [r.text for r in answers]
                winner = next(r.json()["step"] for r in answers if r.status_code == 200)
                views = [status(c) for _ in range(6)]
                assert {v["active_step"] for v in views} == {winner}, "the ingress replicas disagree"
                ok(c.post("/profile/stop", json={"step": winner}))
            ok(c.post("/profile/start", json={"step": 50}))
            generate_until_all_recorded(c, 2)
            killed = _ingress_actors(served.name)[0]
            ray.kill(ray.get_actor(killed, namespace="serve"), no_restart=True)
            # The other ingress answers meanwhile (a request the proxy sent to the dead one may fail).
            poll(lambda: _answers_status(c), timeout=RESTART_TIMEOUT_S, what="the other ingress to answer")
            st = status(c)
            assert st["active_step"] == 50 and all(r["active_step"] == 50 for r in st["replicas"]), st
            ok(c.post("/profile/stop", json={"step": 50}))
        finally:
            stop_if_active(c)
        assert wait_manifest(c, 50, ("complete", "partial"))["status"] == "complete"


def _answers_status(c: httpx.Client) -> bool:
    try:
        return c.get("/profile/status").status_code == 200
    except httpx.HTTPError:
        return False
