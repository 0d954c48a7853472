"""verl's own profiler output made into steps, for real (docs/analysis.md#verl).

A verl save_path written by verl 0.9.1's own profiler classes: the trainer rank's `DistProfiler`
(torch, built from verl's own config blocks) in verl's environment around CPU torch work, and a
rollout replica's vLLM on CPU configured with what verl's `build_vllm_profiler_args` returns,
started and stopped in the order verl's fully-async trainer makes the calls, 2 trainer steps per
version (`trigger_parameter_sync_step: 2`), steps [1, 2, 5] over versions 1..5
(tests/support/verl/profiled_run.py). Nothing of verl is copied or patched. verl's own
`finish_hook_cmd` runs `python -m profiling verl "$VERL_PROFILE_SAVE_PATH"` after the last
profiled step, as written; the steps it builds are complete, merged, summarized and reported,
`verify` notes how each recording was assigned and finds no violation, and a recording moved to
another step is caught.

Needs verl's environment (`tools/setup.sh --tests` builds `.venv/verl`; `$VERL_PYTHON` names
another): without it this test fails, naming the fix.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.verl.profiled_run import write_verl_save_path

from profiling.manifest import StepManifest
from profiling.store import TraceStore

pytestmark = pytest.mark.integration

STEPS = [1, 2, 5]
VERSIONS = 5
SYNC_EVERY = 2
HOOK = f'python -m profiling verl "$VERL_PROFILE_SAVE_PATH" --trigger-parameter-sync-step {SYNC_EVERY}'
"""verl's global_profiler.finish_hook_cmd, as a user writes it."""
_HOOK_LINE = re.compile(r"^\[Profiler\]\[finish_hook\] rank 0: (.*)$", re.M)


def profiling(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "profiling", *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_a_verl_save_path_becomes_verified_steps(model_dir, tmp_path, report_section):
    say = report_section("verl's save_path made into steps (python -m profiling verl)")
    began = time.monotonic()
    save = tmp_path / "profile"
    run = write_verl_save_path(save, model_dir, tmp_path, STEPS, VERSIONS, SYNC_EVERY, HOOK)
    ran = time.monotonic() - began

    hook = _HOOK_LINE.findall(run.hook_log)
    assert "command exited with 0" in hook, run.hook_log[-4000:]
    output = hook[hook.index(f"running command: {HOOK}") + 2 : hook.index("command exited with 0")]
    say("\n".join([f"$ {HOOK}   (verl's finish hook, VERL_PROFILE_SAVE_PATH={save})", *output]))

    store = TraceStore(save)
    assert store.steps() == STEPS
    for k in STEPS:
        m = StepManifest.model_validate_json((save / f"step_{k}" / "manifest.json").read_text())
        assert m.status == "complete" and m.merge is not None and m.merge.status == "ok", m
        by_key = {e.key: e for e in m.entries}
        assert set(by_key) == {"trainer/rank_0", "rollout/replica0"}
        trainer, rollout = by_key["trainer/rank_0"], by_key["rollout/replica0"]
        assert len(trainer.files) == SYNC_EVERY and trainer.weight_version == k - 1
        opened, stopped = run.rollout_windows[k]
        assert rollout.started_at is not None and rollout.stopped_at is not None
        assert opened - 1 <= rollout.started_at and rollout.stopped_at <= stopped  # the recording, by its own events
        assert rollout.forward_steps > 0 and rollout.window_match is not None
        assert rollout.window_match.trainer_steps == [2 * k - 1, 2 * k] and rollout.window_match.margin_s > 0
        for name in ("merged.trace.json.gz", "report.html", "ranks/view.record"):
            assert (save / f"step_{k}" / name).is_file(), name
    assert (save / "index.html").is_file()

    summary = profiling("summarize", str(save), "--json")
    assert summary.returncode == 0, summary.stderr
    replicas = [p for s in json.loads(summary.stdout) for p in s["processes"] if p["role"] == "rollout"]
    assert [p["forward_steps"] > 0 for p in replicas] == [True] * len(STEPS)

    verified = profiling("verify", str(save), "--json")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    report = json.loads(verified.stdout)
    assert report["violations"] == []
    assigned = [n for n in report["notes"] if n["check"] == "versions"]
    assert [(n["step"], n["entry"]) for n in assigned] == [(k, "rollout/replica0") for k in STEPS]
    assert all("carry no weight version: assigned to step" in n["message"] for n in assigned)
    say(
        "\n".join(
            ["verify, a note per recording:", *(f"  step {n['step']} {n['entry']}: {n['message']}" for n in assigned)]
        )
    )

    moved = Path(shutil.copytree(save, tmp_path / "moved", symlinks=True))
    shutil.rmtree(moved / "step_5" / "rollout" / "replica0")
    shutil.copytree(moved / "step_2" / "rollout" / "replica0", moved / "step_5" / "rollout" / "replica0")
    TraceStore(moved).refresh_manifest(5)
    caught = profiling("verify", str(moved), "--step", "5", "--json")
    assert caught.returncode == 1, caught.stdout + caught.stderr
    problems = [v["message"] for v in json.loads(caught.stdout)["violations"]]
    assert any("outside step 5's trainer window" in p for p in problems), problems
    say(f"run (engines, drivers, hook) {ran:.1f} s, in all {time.monotonic() - began:.1f} s; cpus {os.cpu_count()}")
