"""profile_continuous_steps (docs/design.md#continuous-windows) through the real main loop: steps
[1, 2] merge into one window labelled 1 (step_1/ only), spanning the weight update to version 1,
which is marked in the rollout and the trainer traces; no forward pass on weights 0 or 1 runs
unprofiled."""

from __future__ import annotations

import pytest

from .helpers import (
    by_role,
    entry_markers,
    entry_traces,
    forward_markers,
    forwards_by_version,
    get_status,
    run_training,
    training_config,
    wait_manifest,
    weight_update_versions,
)

pytestmark = pytest.mark.integration


def test_continuous_window_spans_the_update_and_records_everything(deployed, model_dir):
    app = deployed(
        "continuous",
        profiler={"max_forward_steps": None, "max_duration_s": 300},
        start_limits={"max_forward_steps": None},
    )
    cfg = training_config(
        app,
        "global_profiler.steps=[1,2]",
        "global_profiler.profile_continuous_steps=true",
        "trainer.total_versions=3",
    )
    result = run_training(cfg, app.base_url, model_dir)
    assert [v.version for v in result.versions] == [1, 2, 3]

    m = wait_manifest(app.save_path, 1)
    assert sorted(p.name for p in app.save_path.glob("step_*")) == ["step_1"], "one window, labelled by its first step"
    assert m["step"] == 1 and m["steps"] == [1, 2] and m["status"] == "complete", m
    step_dir = app.save_path / "step_1"
    status = get_status(app.base_url)
    assert status["state"] == "idle" and status["paused"] is False, status
    by_version = forwards_by_version(status)

    rollout = by_role(m, "rollout")
    assert {e["replica_id"] for e in rollout} == set(by_version) and len(rollout) == 2, (rollout, status)
    versions_seen: set[int] = set()
    problems = []
    for entry in rollout:
        rid = entry["replica_id"]
        assert entry["status"] == "ok" and entry["weight_version"] == 0, entry
        # A replica the load balancer sent no request between the update and the stop ran nothing
        # on version 1; across the replicas both versions are recorded (versions_seen below).
        assert entry["weight_versions"] in ([0], [0, 1]), entry
        traces = entry_traces(step_dir, entry)
        updates = [v for t in traces for v in weight_update_versions(t)]
        assert updates == [1], f"{rid}: weight_update ranges {updates}, expected exactly version 1"
        markers = entry_markers(step_dir, entry)
        assert {s for _, s, _ in markers} <= {1}, "markers carry the window label"
        assert {v for *_, v in markers} <= {0, 1}, sorted({v for *_, v in markers})
        assert entry["forward_steps"] == len(markers)
        versions_seen |= {v for *_, v in markers}
        for v in (0, 1):
            recorded = sum(1 for *_, mv in markers if mv == v)
            ran = by_version[rid].get(v, 0)
            if recorded != ran:
                problems.append(f"{rid}: {ran} forward passes on weights {v}, {recorded} recorded")
    assert versions_seen == {0, 1}, f"rollout traces hold forward passes on versions {sorted(versions_seen)}"
    assert not problems, "; ".join(problems)

    trainer = by_role(m, "trainer")
    assert len(trainer) == 1 and trainer[0]["status"] == "ok", trainer
    ttraces = entry_traces(step_dir, trainer[0])
    assert [v for t in ttraces for v in weight_update_versions(t)] == [1]
    tmarkers = [mk for t in ttraces for mk in forward_markers(t)]
    # one mini-batch per version: the one producing v1 (trained from v0), the one producing v2
    assert sorted(v for *_, v in tmarkers) == [0, 1], tmarkers
    assert trainer[0]["sync"] and trainer[0]["sync"]["stop_s"] is not None, trainer[0]
