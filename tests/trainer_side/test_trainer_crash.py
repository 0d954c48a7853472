"""A trainer that dies while step 3 is profiled (docs/design.md#sync-order: stop whatever is active
on any exception): run_training re-raises, the `finally` path stops rollout profiling without
leaving admission held, and step 3's traces and manifest are still complete."""

from __future__ import annotations

import pytest

from trainer.policy import Policy

from .helpers import by_role, entry_markers, entry_traces, get_status, run_training, training_config, wait_manifest

pytestmark = pytest.mark.integration


def test_crash_while_step_3_is_profiled_stops_it_and_completes_its_traces(deployed, model_dir, monkeypatch):
    app = deployed("crash")
    # On-policy samples only: each version trains on completions generated on the version before
    # it, so steps 2 and 3 both have forward passes to check (with stale samples allowed, queued
    # older completions can train a version with no generation in its window).
    cfg = training_config(
        app, "global_profiler.steps=[2,3]", "trainer.total_versions=6", "rollout.max_staleness=0"
    )
    calls = []
    real_train_step = Policy.train_step

    def train_step(self, batch, part=(0, 1)):
        calls.append(len(batch))
        if len(calls) == 3:  # trigger_parameter_sync_step=1: the 3rd mini-batch produces version 3
            raise RuntimeError("boom")
        return real_train_step(self, batch, part)

    monkeypatch.setattr(Policy, "train_step", train_step)
    with pytest.raises(RuntimeError, match="boom"):
        run_training(cfg, app.base_url, model_dir)
    assert len(calls) == 3

    status = get_status(app.base_url)
    assert status["state"] == "idle" and status["active_step"] is None, status
    assert status["paused"] is False, status
    assert all(r["ok"] and not r["paused"] and r["active_step"] is None for r in status["replicas"]), status
    assert status["weight_version"] == 2

    for k in (2, 3):
        m = wait_manifest(app.save_path, k, timeout=60.0)
        assert m["steps"] == [k]
        step_dir = app.save_path / f"step_{k}"
        rollout, trainer = by_role(m, "rollout"), by_role(m, "trainer")
        assert len(rollout) == 2 and len(trainer) == 1, m
        for e in rollout + trainer:
            assert e["status"] == "ok" and not e["exporting"], e
            entry_traces(step_dir, e)  # files exist and are gzip Chrome traces
        assert {e["weight_version"] for e in rollout} == {k - 1}
        markers = [mk for e in rollout for mk in entry_markers(step_dir, e)]
        assert markers and {(s, v) for _, s, v in markers} == {(k, k - 1)}, sorted({(s, v) for _, s, v in markers})
    assert sorted(p.name for p in app.save_path.glob("step_*")) == ["step_2", "step_3"]
