"""Faults around a profiled step, over real Ray Serve and HTTP (docs/design.md#fan-out,
docs/design.md#status-codes, docs/design.md#manifest):

* a replica killed after acknowledging the stop while its trace export is still running;
* the controller (the control replica) killed mid-step and restarted by Serve, and an ingress
  replica likewise;
* the save path made unwritable, or full, mid-step;
* weight files that pass the ingress' checks but fail to load inside the replicas.

One app serves the whole module. Only processes this module started through Serve are killed:
replica pids come from the replicas' own reports, the controller and the ingress are found by the
names Serve gives this app's replica actors.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from integ_util import (
    RESTART_TIMEOUT_S,
    HttpOptions,
    check_entry_traces,
    complete,
    complete_concurrently,
    generate_until_all_recorded,
    kill_replica,
    ok,
    poll,
    stall_export,
    status,
    stop_if_active,
    wait_for_fleet,
    wait_manifest,
    write_perturbed_weights,
)
from support.apps import ServeApp, deployed

pytestmark = pytest.mark.integration

REPLICAS = 2
TMPFS_MB = 64
GREEDY = {"prompt": "Every replica keeps its own trace", "max_tokens": 6, "temperature": 0}


def _mount_tmpfs(mountpoint: Path) -> bool:
    """A small tmpfs at `mountpoint` (a disk that can be filled), if this machine lets us mount."""
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m", "tmpfs", str(mountpoint)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


@pytest.fixture(scope="module")
def disk(tmp_path_factory) -> Iterator[tuple[Path, bool]]:
    """The directory holding save_path, and whether it is a tmpfs of TMPFS_MB (so it can fill)."""
    root = tmp_path_factory.mktemp("faults")
    mnt = root / "disk"
    mnt.mkdir()
    mounted = shutil.which("mount") is not None and _mount_tmpfs(mnt)
    try:
        yield mnt, mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture(scope="module")
def faults(ray_cluster, model_dir, disk, tmp_path_factory) -> Iterator[ServeApp]:
    mnt, _ = disk
    with deployed(
        ray_cluster,
        model_dir,
        tmp_path_factory.mktemp("faults-app"),
        "faults",
        num_replicas=REPLICAS,
        save_path=str(mnt / "traces"),
        # Merges are covered elsewhere; here they would only compete for the 2 CI cores.
        merge_on_complete=False,
    ) as served:
        yield served


HTTP = HttpOptions(app="faults", timeout=30.0, stop_at_end=True)
"""How `http` (conftest.py) reaches this module's app."""


@pytest.fixture(scope="module")
def dead() -> set[str]:
    """Replica ids killed so far in this module."""
    return set()


@pytest.fixture
def fleet(http, dead) -> list[dict]:
    """Each test starts with REPLICAS live replicas (none a killed one), idle and admitting."""
    return wait_for_fleet(http, REPLICAS, dead, ingress_may_restart=True)


def replica_state(http: httpx.Client, replica_id: str) -> str | None:
    return next((r["state"] for r in status(http)["replicas"] if r["replica_id"] == replica_id), None)


def run_step(http: httpx.Client, app: ServeApp, step: int) -> dict:
    """Start, generate on every replica, stop: the step's manifest must be complete."""
    try:
        ok(http.post("/profile/start", json={"step": step}))
        generate_until_all_recorded(http, REPLICAS)
        stopped = ok(http.post("/profile/stop", json={"step": step}))
    finally:
        stop_if_active(http)
    assert all(r["ok"] and r["files"] for r in stopped["replicas"]), stopped
    manifest = wait_manifest(http, step, ("complete", "partial"))
    assert manifest["status"] == "complete", manifest
    rollout = [e for e in manifest["entries"] if e["role"] == "rollout"]
    assert len(rollout) == REPLICAS, manifest
    for e in rollout:
        check_entry_traces(app.save_path / f"step_{step}", e, step)
    return manifest


# -- a replica killed mid-export --------------------------------------------------------------


def test_replica_killed_mid_export_leaves_a_partial_manifest(faults, http, fleet, dead):
    step = 11
    started = ok(http.post("/profile/start", json={"step": step}))
    try:
        assert len(started["replicas"]) == REPLICAS and all(r["ok"] for r in started["replicas"]), started
        victim, survivor = started["replicas"]
        step_dir = faults.save_path / f"step_{step}"
        fifos = stall_export(step_dir / "rollout" / victim["replica_id"])
        generate_until_all_recorded(http, REPLICAS)
        stopped = ok(http.post("/profile/stop", json={"step": step}))
    finally:
        stop_if_active(http)
    # Both acknowledged: the recordings are closed, the traces are not written yet.
    assert all(r["ok"] and r["files"] and r["forward_steps"] > 0 for r in stopped["replicas"]), stopped

    poll(lambda: replica_state(http, survivor["replica_id"]) == "idle", timeout=60, what="the survivor's export")
    assert replica_state(http, victim["replica_id"]) == "exporting", "the victim's export did not stall"
    assert wait_manifest(http, step, ("exporting",))["status"] == "exporting"
    kill_replica(victim, {r["pid"] for r in started["replicas"]})
    dead.add(victim["replica_id"])

    manifest = wait_manifest(http, step, ("partial", "complete"))
    for fifo in fifos:
        fifo.unlink()
    assert manifest["status"] == "partial", manifest
    entries = {e["replica_id"]: e for e in manifest["entries"] if e["role"] == "rollout"}
    assert set(entries) == {victim["replica_id"], survivor["replica_id"]}, manifest
    lost = entries[victim["replica_id"]]
    assert lost["status"] == "error" and not lost["exporting"], lost
    assert "died" in lost["error"] and "export" in lost["error"], lost
    good = entries[survivor["replica_id"]]
    assert good["status"] == "ok" and not good["exporting"] and good["error"] is None, good
    by_id = {r["replica_id"]: r for r in stopped["replicas"]}
    assert good["forward_steps"] == by_id[survivor["replica_id"]]["forward_steps"]
    check_entry_traces(step_dir, good, step)

    # The restarted replica and the survivor profile the next step completely.
    wait_for_fleet(http, REPLICAS, dead, ingress_may_restart=True)
    run_step(http, faults, step + 1)


# -- the controller or the ingress restarted mid-step ---------------------------------------


def control_actor(app_name: str, deployment: str) -> str | None:
    """Name of the app's live replica actor of `deployment` (Serve names it after app and
    deployment), one of RolloutController and RolloutIngress (one replica each here)."""
    import ray

    prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    assert len(names) <= 1, names
    return names[0] if names else None


def restart(http: httpx.Client, app_name: str, deployment: str) -> float:
    """Kill the app's replica of `deployment` (no graceful shutdown: a crash), wait until Serve
    has started another and the app answers a control call; returns when (time.time())."""
    import ray

    old = control_actor(app_name, deployment)
    assert old is not None
    ray.kill(ray.get_actor(old, namespace="serve"), no_restart=True)

    def back() -> bool:
        name = control_actor(app_name, deployment)
        if name is None or name == old:
            return False
        try:
            return http.get("/profile/status").status_code == 200
        except httpx.HTTPError:
            return False

    poll(back, timeout=RESTART_TIMEOUT_S, what=f"Serve to restart the {deployment}", interval=0.5)
    return time.time()


@pytest.mark.parametrize("deployment", ["RolloutController", "RolloutIngress"])
def test_control_replica_restarted_mid_step_recovers_the_step(faults, http, fleet, deployment):
    step = 21 if deployment == "RolloutController" else 23
    try:
        ok(http.post("/profile/start", json={"step": step}))
        generate_until_all_recorded(http, REPLICAS)
        restart(http, faults.name, deployment)

        st = status(http)  # the controller's durable record, not the dead process's memory
        assert st["state"] == "profiling" and st["active_step"] == step and st["steps"] == [step], st
        assert len(st["replicas"]) == REPLICAS
        assert all(r["ok"] and r["active_step"] == step and r["state"] == "profiling" for r in st["replicas"]), st
        other = http.post("/profile/start", json={"step": step + 1})
        assert other.status_code == 409 and str(step) in other.json()["detail"], other.text
        again = ok(http.post("/profile/start", json={"step": step}))
        assert again["state"] == "already_profiling", again
        complete_concurrently(http)
        stopped = ok(http.post("/profile/stop", json={"step": step}))
    finally:
        stop_if_active(http)
    assert stopped["stopped"] is True and stopped["step"] == step, stopped
    assert len(stopped["replicas"]) == REPLICAS and all(r["ok"] and r["files"] for r in stopped["replicas"])
    manifest = wait_manifest(http, step, ("complete", "partial"))
    assert manifest["status"] == "complete", manifest
    rollout = [e for e in manifest["entries"] if e["role"] == "rollout"]
    assert {e["replica_id"] for e in rollout} == {r["replica_id"] for r in fleet}
    for e in rollout:
        assert e["status"] == "ok" and not e["late_start"], e
        check_entry_traces(faults.save_path / f"step_{step}", e, step)
    assert http.get(f"/profile/steps/{step + 1}").status_code == 404  # the refused start left nothing


def test_watchdog_survives_a_controller_restart(faults, http, fleet):
    """Nobody calls stop: the restarted controller still ends the step at max_duration_s,
    counted from the step's start, not from the restart."""
    step, limit = 22, 6.0
    try:
        ok(http.post("/profile/start", json={"step": step, "max_duration_s": limit}))
        back_at = restart(http, faults.name, "RolloutController")
        poll(lambda: status(http)["state"] == "idle", timeout=limit + 30, what="the watchdog to stop the step")
    finally:
        stop_if_active(http)
    manifest = wait_manifest(http, step, ("complete", "partial"))
    assert manifest["status"] == "complete" and manifest["auto_stopped"] == "max_duration_s", manifest
    ran = manifest["stopped_at"] - manifest["started_at"]
    assert ran >= limit, manifest
    # Re-armed with the time left, not a fresh max_duration_s from the restart.
    due = max(back_at, manifest["started_at"] + limit + 1.0)
    assert manifest["stopped_at"] <= due + 5.0, (manifest["stopped_at"] - due, manifest)


# -- the save path unwritable or full mid-step -------------------------------------------------


def generation_keeps_answering(http: httpx.Client) -> None:
    results = complete_concurrently(http, n=4, max_tokens=4)
    assert all(r["choices"][0]["token_ids"] for r in results)


def assert_step_reports_loss(http: httpx.Client, step: int, replica_ids: set[str], cause: str) -> dict:
    """GET /profile/steps/{step} must say that its records could not be written, why, and
    whose traces were lost (507; the manifest on disk is missing or out of date)."""

    def answered() -> dict | None:
        r = http.get(f"/profile/steps/{step}")
        if r.status_code != 507:
            return None
        detail = r.json()["detail"]
        return r.json() if all(rid in detail for rid in replica_ids) else None

    body = poll(answered, timeout=60, what=f"step {step} to report its lost records (507)")
    assert cause in body["detail"], body
    return body


def test_save_path_unwritable_mid_step(faults, http, fleet):
    step = 31
    save_path = faults.save_path
    moved = save_path.with_name("traces.moved")
    try:
        started = ok(http.post("/profile/start", json={"step": step}))
        generate_until_all_recorded(http, REPLICAS)
        # Break the save path: a regular file where its directory was (root ignores permissions).
        save_path.rename(moved)
        save_path.write_text("not a directory")
        generation_keeps_answering(http)
        stopped = ok(http.post("/profile/stop", json={"step": step}))
        assert stopped["stopped"] is True and all(r["ok"] for r in stopped["replicas"]), stopped
        generation_keeps_answering(http)

        ids = {r["replica_id"] for r in started["replicas"]}
        body = assert_step_reports_loss(http, step, ids, "Not a directory")
        # The answer names the directory by its key, never by its server path (that goes to the log).
        assert "save_path" in body["detail"] and str(save_path) not in body["detail"], body
        refused = http.post("/profile/start", json={"step": step + 1})
        assert refused.status_code == 507, refused.text
        detail = refused.json()["detail"]
        assert "save_path" in detail and str(save_path) not in detail and "not a directory" in detail, detail
        assert status(http)["state"] == "idle"
        listed = http.get("/profile/steps")
        assert listed.status_code == 507 and str(save_path) not in listed.text, listed.text
        assert http.get("/metrics").status_code == 200
    finally:
        stop_if_active(http)
        if moved.exists():
            save_path.unlink(missing_ok=True)
            moved.rename(save_path)
    generation_keeps_answering(http)
    run_step(http, faults, step + 1)


@contextlib.contextmanager
def filled(disk: Path) -> Iterator[None]:
    """Fill the filesystem of `disk` to the last byte, and free it on exit."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for chunk in (1 << 20, 1 << 12):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
        yield
    finally:
        os.close(fd)
        filler.unlink()


def test_save_path_full_mid_step(faults, http, fleet, disk):
    mnt, is_tmpfs = disk
    if not is_tmpfs:
        pytest.skip("needs a small tmpfs to fill (mount -t tmpfs is not permitted here)")
    step = 33
    try:
        started = ok(http.post("/profile/start", json={"step": step}))
        generate_until_all_recorded(http, REPLICAS)
        with filled(mnt):
            generation_keeps_answering(http)
            stopped = ok(http.post("/profile/stop", json={"step": step}))
            assert stopped["stopped"] is True and all(r["ok"] for r in stopped["replicas"]), stopped
            generation_keeps_answering(http)
            ids = {r["replica_id"] for r in started["replicas"]}
            assert_step_reports_loss(http, step, ids, "No space left on device")
            refused = http.post("/profile/start", json={"step": step + 1})
            assert refused.status_code == 507, refused.text
            assert "min_free_disk_mb" in refused.json()["detail"], refused.text
            assert status(http)["state"] == "idle"
    finally:
        stop_if_active(http)
    generation_keeps_answering(http)
    run_step(http, faults, step + 1)


# -- weights that fail to load inside the replicas ----------------------------------------------


def model_state(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def save(state: dict, path: Path) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def broken_weights(model_dir: Path, weights_dir: Path) -> list[tuple[str, str, str]]:
    """(path relative to weights_dir, text the answer must name, why it cannot load) per broken
    checkpoint. The first INGRESS_REFUSED fail the ingress' checks; the others pass them (each is
    one well-formed checkpoint) and are refused inside the replicas, from their headers."""
    import torch

    state = model_state(model_dir)
    names = sorted(state)
    emb = "model.embed_tokens.weight"
    out: list[tuple[str, str, str]] = []

    data = (model_dir / "model.safetensors").read_bytes()
    (weights_dir / "truncated.safetensors").write_bytes(data[: len(data) - 4096])
    out.append(("truncated.safetensors", "truncated.safetensors", "a copy cut short"))

    (weights_dir / "linked").mkdir()
    (weights_dir / "linked" / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    out.append(("linked", "links outside", "a shard linked from outside weights_dir"))

    dup = weights_dir / "duplicated"
    save(state, dup / "model-00001-of-00002.safetensors")
    save({emb: torch.zeros_like(state[emb])}, dup / "model-00002-of-00002.safetensors")
    out.append(("duplicated", "no .safetensors.index.json", "two checkpoints in one directory: which one is meant?"))

    save({**state, emb: state[emb][:-1]}, weights_dir / "shape.safetensors")
    out.append(("shape.safetensors", emb, "one tensor of the wrong shape"))

    save({f"transformer.{k}": v for k, v in state.items()}, weights_dir / "names.safetensors")
    out.append(("names.safetensors", f"transformer.{names[0]}", "tensors under other names"))

    half = len(names) // 2
    save({k: state[k] for k in names[:half]}, weights_dir / "sharded" / "model-00001-of-00002.safetensors")
    out.append(("sharded", names[half], "a sharded checkpoint missing a shard"))
    return out


INGRESS_REFUSED = 3


def test_weights_that_fail_to_load_keep_the_old_version(faults, http, fleet, model_dir):
    served = write_perturbed_weights(model_dir, faults.weights_dir / "v1.safetensors", seed=11)
    ok(http.post("/weights/update", json={"version": 1, "path": served.name}))
    reference = complete(http, **GREEDY)["choices"][0]
    assert reference["weight_version"] == 1

    broken = broken_weights(model_dir, faults.weights_dir)
    for i, (path, named, why) in enumerate(broken):
        r = http.post("/weights/update", json={"version": 2, "path": path})
        assert r.status_code == 422, (why, r.status_code, r.text)
        body = r.json()
        assert named in body["detail"], (why, body)
        if i < INGRESS_REFUSED:  # refused by the ingress before any replica read it
            assert body["replicas"] == [], (why, body)
        else:  # refused inside the replicas: each one says why
            assert "version 1 keeps serving" in body["detail"], (why, body)
            assert len(body["replicas"]) == REPLICAS, (why, body)
            for rep in body["replicas"]:
                assert not rep["ok"] and named in rep["error"] and rep["weight_version"] == 1, (why, rep)
        st = status(http)
        assert st["weight_version"] == 1, (why, st)
        assert all(rep["weight_version"] == 1 for rep in st["replicas"]), (why, st)
        for _ in range(REPLICAS):  # whichever replica answers: the old weights, intact
            again = complete(http, **GREEDY)["choices"][0]
            assert again["token_ids"] == reference["token_ids"] and again["weight_version"] == 1, why

    # The fleet is not stuck: a good checkpoint still loads.
    shutil.copyfile(model_dir / "model.safetensors", faults.weights_dir / "v2.safetensors")
    loaded = ok(http.post("/weights/update", json={"version": 2, "path": "v2.safetensors"}))
    assert all(rep["ok"] and rep["weight_version"] == 2 for rep in loaded["replicas"]), loaded
    assert complete(http, **GREEDY)["weight_version"] == 2
