"""docs/examples/verl_style_integration.py, run as a user runs it, against a real 2-replica app:
its profiled steps come out complete, labelled, with the trainer's traces in the same step."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .helpers import REPO_ROOT, by_role, entry_markers, wait_manifest

EXAMPLE = REPO_ROOT / "docs" / "examples" / "verl_style_integration.py"
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_verl_style_example_profiles_steps_1_and_2(app, model_dir):
    proc = subprocess.run(
        [
            sys.executable, str(EXAMPLE),
            "--url", app.base_url,
            "--save-path", str(app.save_path),
            "--weights-dir", str(app.weights_dir),
            "--model-path", str(model_dir),
            "--versions", "2",
            "--mini-batches", "1",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, log
    assert "v1: " in proc.stdout and "v2: " in proc.stdout, log
    for k in (1, 2):
        m = wait_manifest(app.save_path, k, timeout=120.0)
        rollout, trainer = by_role(m, "rollout"), by_role(m, "trainer")
        assert len(rollout) == 2 and len(trainer) == 1, m["entries"]
        assert trainer[0]["forward_steps"] == 1 and trainer[0]["sync"] is not None, trainer[0]
        for e in rollout:
            assert e["weight_version"] == k - 1, e
            assert {(s, v) for _, s, v in entry_markers(app.save_path / f"step_{k}", e)} <= {(k, k - 1)}, e
    # Step 3 is not profiled: the sync publishing version 2 made only its stop.
    assert not (app.save_path / "step_3").exists()
