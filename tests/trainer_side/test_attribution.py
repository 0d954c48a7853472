"""Exact attribution (docs/design.md#exact-attribution) through the real main loop:
trainer.loop.run_training against a real 2-replica Ray Serve app with uncapped windows. For every
profiled step k and replica, the step-k trace holds only forward passes on weights k-1, and holds
all of them: the count of its forward_step markers equals the number of forward passes the replica
ran on weights k-1 (`forward_steps_by_version` of /profile/status).

With steps [2, 3], step 3 is entered by stop(2, pause) -> update(2, resume=False) -> start(3);
step 2 is entered by update(1, resume=False) -> start(2) with no stop before it (step 1 is not
profiled). Steps [2, 4, 6] enter every window that second way."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from .helpers import (
    by_role,
    entry_markers,
    forwards_by_version,
    get_status,
    run_training,
    training_config,
    wait_manifest,
)

pytestmark = pytest.mark.integration



@dataclass
class Run:
    steps: list[int]
    save_path: Path
    status: dict
    manifests: dict[int, dict]
    by_version: dict[str, dict[int, int]]


def _train(module_deployed, model_dir, name: str, steps: list[int], total_versions: int) -> Run:
    app = module_deployed(
        name, profiler={"max_forward_steps": None, "max_duration_s": 300}, start_limits={"max_forward_steps": None}
    )
    # On-policy samples only (max_staleness 0): every version trains on completions generated on
    # the version before it, so every profiled window has forward passes to attribute. With stale
    # samples allowed, a full queue of older completions can train a version with no generation
    # in its window, and the marker checks below would hold vacuously.
    cfg = training_config(
        app,
        f"global_profiler.steps={steps}",
        f"trainer.total_versions={total_versions}",
        "rollout.max_staleness=0",
    )
    result = run_training(cfg, app.base_url, model_dir)
    assert [v.version for v in result.versions] == list(range(1, total_versions + 1))
    manifests = {k: wait_manifest(app.save_path, k) for k in steps}
    status = get_status(app.base_url)
    return Run(steps, app.save_path, status, manifests, forwards_by_version(status))


@pytest.fixture(scope="module")
def run(module_deployed, model_dir) -> Run:
    return _train(module_deployed, model_dir, "attrib", [2, 3], 4)


@pytest.fixture(scope="module")
def gap_run(module_deployed, model_dir) -> Run:
    return _train(module_deployed, model_dir, "attrib-gaps", [2, 4, 6], 6)


def _check_labels(run: Run, total_versions: int) -> None:
    """Only the profiled steps have directories; every marker is step k on weights k-1, and each
    rollout entry's forward_steps equals its marker count."""
    assert sorted(p.name for p in run.save_path.glob("step_*")) == sorted(f"step_{k}" for k in run.steps)
    assert run.status["state"] == "idle" and run.status["paused"] is False, run.status
    assert run.status["weight_version"] == total_versions
    assert len(run.by_version) == 2, run.status
    for k in run.steps:
        rollout = by_role(run.manifests[k], "rollout")
        assert {e["replica_id"] for e in rollout} == set(run.by_version)
        recorded = 0
        for entry in rollout:
            assert entry["status"] == "ok" and entry["weight_version"] == k - 1, entry
            assert entry["auto_stopped"] is None, f"uncapped window was capped: {entry}"
            markers = entry_markers(run.save_path / f"step_{k}", entry)
            assert {s for _, s, _ in markers} <= {k}, markers[:5]
            assert {v for _, _, v in markers} <= {k - 1}, f"step {k}: versions {sorted({v for *_, v in markers})}"
            assert entry["forward_steps"] == len(markers), (entry["forward_steps"], len(markers))
            assert sorted(i for i, _, _ in markers) == list(range(len(markers)))
            recorded += len(markers)
        assert recorded > 0, f"step {k}: no forward pass recorded on any replica (the count check proves nothing)"


def _unprofiled(run: Run, k: int) -> list[str]:
    problems = []
    for entry in by_role(run.manifests[k], "rollout"):
        rid = entry["replica_id"]
        recorded = len(entry_markers(run.save_path / f"step_{k}", entry))
        ran = run.by_version[rid].get(k - 1, 0)
        if recorded != ran:
            problems.append(
                f"step {k}, replica {rid}: {ran} forward passes ran on weights {k - 1}, "
                f"{recorded} recorded ({ran - recorded} ran unprofiled)"
            )
    return problems


def test_steps_2_3_markers_are_labelled_and_counted(run):
    _check_labels(run, 4)


def test_step_entered_by_stop_update_start_records_every_forward_pass(run):
    assert not _unprofiled(run, 3)


# Step 2 is entered by update(resume=false) -> start, not by stop -> update -> start: the update
# must hold admission so nothing runs on weights 1 before the start.
def test_step_entered_by_update_start_records_every_forward_pass(run):
    assert not _unprofiled(run, 2)


def test_steps_2_4_6_markers_are_labelled_and_counted(gap_run):
    _check_labels(gap_run, 6)


def test_windows_entered_by_update_start_record_every_forward_pass(gap_run):
    problems = [p for k in gap_run.steps for p in _unprofiled(gap_run, k)]
    assert not problems, "; ".join(problems)
