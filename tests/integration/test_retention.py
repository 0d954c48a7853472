"""Retention (`keep_steps`) over real Ray Serve and HTTP: a start that prunes while an earlier
step is still exporting keeps that step, which then completes (docs/design.md#traces-on-disk)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import httpx
import pytest
from integ_util import (
    check_entry_traces,
    generate_until_all_recorded,
    ok,
    release_export,
    stall_export,
    stop_if_active,
    wait_manifest,
)
from support.apps import ServeApp, deployed

pytestmark = pytest.mark.integration

MAX_EXPORTING_STEPS = 2
KEEP_STEPS = MAX_EXPORTING_STEPS + 1  # the least the config accepts


@pytest.fixture(scope="module")
def app(ray_cluster, model_dir, tmp_path_factory) -> Iterator[ServeApp]:
    # No background merges: they would rewrite step directories, and the test orders them itself.
    with deployed(
        ray_cluster,
        model_dir,
        tmp_path_factory.mktemp("retention"),
        "retention",
        num_replicas=1,
        keep_steps=KEEP_STEPS,
        max_exporting_steps=MAX_EXPORTING_STEPS,
        merge_on_complete=False,
    ) as served:
        yield served


def profile(http: httpx.Client, step: int) -> dict:
    """Start `step`, record a forward step, stop it; returns the start's answer."""
    try:
        started = ok(http.post("/profile/start", json={"step": step}))
        generate_until_all_recorded(http, 1)
        ok(http.post("/profile/stop", json={"step": step}))
    finally:
        stop_if_active(http)
    return started


def test_a_prune_during_an_export_keeps_the_step(app, http):
    for step in (1, 2, 3):
        profile(http, step)
        assert wait_manifest(http, step, ("complete", "partial"))["status"] == "complete"

    # Step 4's export hangs (a slow disk) past its stop and the next start.
    try:
        started = ok(http.post("/profile/start", json={"step": 4}))
        [replica] = started["replicas"]
        fifos = stall_export(app.save_path / "step_4" / "rollout" / replica["replica_id"])
        generate_until_all_recorded(http, 1)
        ok(http.post("/profile/stop", json={"step": 4}))
    finally:
        stop_if_active(http)
    # Steps 2 and 3 written since (as a report or a merge of them would): step 4 is now beyond
    # the keep_steps - 1 most recently written that a start keeps, step 1 the least recent.
    later = time.time() + 60
    for k in (2, 3):
        os.utime(app.save_path / f"step_{k}", (later + k, later + k))

    released = None
    try:
        ok(http.post("/profile/start", json={"step": 5}))  # prunes while step 4 still exports
        assert not (app.save_path / "step_1").exists(), "the start did not prune"
        assert (app.save_path / "step_4").is_dir(), "the prune removed step 4 while it was exporting"
        assert ok(http.get("/profile/steps/4"))["status"] == "exporting"
        ok(http.post("/profile/stop", json={"step": 5}))
        released = release_export(fifos)
        manifest = wait_manifest(http, 4, ("complete", "partial"))
    finally:
        stop_if_active(http)
        if released is None:
            for fifo in fifos:
                fifo.unlink(missing_ok=True)
    released.join(timeout=60)
    assert manifest["status"] == "complete", manifest
    [entry] = [e for e in manifest["entries"] if e["role"] == "rollout"]
    check_entry_traces(app.save_path / "step_4", entry, 4)
    assert wait_manifest(http, 5, ("complete", "partial"))["status"] == "complete"
    assert sorted(p.name for p in app.save_path.glob("step_*")) == ["step_2", "step_3", "step_4", "step_5"]
