"""verl's own trainers, unmodified, end to end on CPU, their rollout served by the app through the
verl plugin (docs/frameworks/verl.md): verl's fully-async trainer (`python -m
verl.experimental.fully_async_policy.fully_async_main`) and its synchronous AgentLoop trainer
(`python -m verl.trainer.main_ppo`, hybrid engine), each with the plugin's config lines and
`global_profiler.steps: [1, 2, 5]`, its trainer workers on FSDP2 over gloo (a test platform in
verl's platform registry), against a fresh app of two replicas (tests/support/verl/verl_run.py, in
verl's environment).

verl runs to its end; the app drives verl's steps by verl's own schedule and records them exactly
(every forward pass of step k on weights k-1, none outside the window); `python -m profiling verl`
adds verl's trainer traces, with the clocks the plugin measured, and `verify` finds nothing wrong.
After the fully-async run, verl's own client and replica against the same app: verl's sampling
parameters, a sync in the middle of a generation in verl's order, a request parked and one
rejected behind the closed gate, and the verl settings the plugin refuses by name
(tests/support/verl/plugin_checks.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.verl.env import verl_env, verl_python

from profiling.analysis.verify import verify_steps
from profiling.manifest import StepManifest
from profiling.store import TraceStore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

DRIVER = Path(__file__).parents[1] / "support" / "verl" / "verl_run.py"
TRAINERS = ["fully_async", "sync"]
TRANSFERS = {"fully_async": "path", "sync": "object_store"}
"""How each run's trainer rank 0 publishes (the checks after the fully-async run publish one version
by collective)."""
STEPS = [1, 2, 5]
VERSIONS = {"fully_async": 6, "sync": 5}
"""The versions each trainer publishes: the fully-async one a version per 4 prompts of
rollout.total_rollout_steps (24), the synchronous one trainer.total_training_steps (5)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, Any]]:
    work = tmp_path_factory.mktemp("verl-plugin")
    trainers = [f"{t}:{TRANSFERS[t]}" for t in TRAINERS]
    cmd = [str(verl_python()), str(DRIVER), "--work", str(work), "--trainers", *trainers, "--checks", "fully_async"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1400, env=verl_env(), check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["runs"]


@pytest.fixture(params=TRAINERS)
def run(request, runs) -> dict[str, Any]:
    """One trainer's run, which verl ran to its end."""
    ran = runs[request.param]
    log = Path(ran["verl_log"]).read_text(errors="replace")
    assert ran["verl_rc"] == 0, f"verl's {request.param} trainer failed (rc {ran['verl_rc']}):\n{log[-8000:]}"
    return {**ran, "trainer": request.param}


def test_verls_trainer_runs_to_its_end_with_the_app_driving_its_steps(run):
    status = run["status"]
    assert status["weight_version"] == VERSIONS[run["trainer"]], status
    # By file, the served version's stays (a replica that starts later loads it); through the
    # object store, no file at all.
    files = [f"verl-v{VERSIONS[run['trainer']]}.safetensors"] if run["transfer"] == "path" else []
    assert run["weight_files"] == files, run["weight_files"]
    assert status["schedule"] == {"steps": STEPS, "profile_continuous_steps": False}, status
    assert status["driver"] == "server" and status["active_step"] is None and not status["paused"], status


def test_each_profiled_step_holds_exactly_its_versions_rollout(run):
    assert sorted(map(int, run["manifests"])) == STEPS
    for k, manifest in run["manifests"].items():
        rollout = [e for e in manifest["entries"] if e["role"] == "rollout"]
        assert manifest["status"] == "complete" and manifest["driver"] == "server", manifest
        assert len(rollout) == 2 and all(e["forward_steps"] > 0 for e in rollout), rollout
        assert all(e["weight_versions"] == [int(k) - 1] for e in rollout), rollout
        assert all(e["forward_steps_outside"] == 0 for e in rollout), rollout


def test_the_ingest_adds_verls_trainer_traces_and_verify_finds_nothing_wrong(run):
    save = Path(run["save_path"])
    done = subprocess.run(
        [sys.executable, "-m", "profiling", "verl", str(save)], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    store = TraceStore(save)
    for k in STEPS:
        manifest = store.read_manifest(k)
        assert isinstance(manifest, StepManifest) and manifest.status == "complete", manifest
        trainer = [e for e in manifest.entries if e.role == "trainer"]
        assert len(trainer) == 1 and trainer[0].files and all(f"_step{k}_" in f for f in trainer[0].files), trainer
        assert trainer[0].clock_offset is not None, "the plugin measured rank 0's clock against the app's"
        assert (save / f"step_{k}" / "merged.trace.json.gz").is_file()
    report = verify_steps(store, STEPS)
    assert report.ok, [v.message for v in report.violations]


def test_verls_client_generates_through_the_app_with_verls_meanings(runs):
    checks = runs["fully_async"]["checks"]
    served = VERSIONS["fully_async"]
    plain = checks["plain"]
    assert plain["tokens"] == plain["log_probs"] > 0, plain
    assert plain["extra_fields"]["global_steps"] == checks["served_before"] == served, checks
    # A sync in the middle of it: ended `aborted` with its tokens, sent again by verl's client, the
    # rest sampled by the new version.
    assert checks["collective_publish"]["rollout_profiler/transfer_s"] > 0, checks["collective_publish"]
    long = checks["long"]
    assert long["tokens"] == long["log_probs"] == 400, long
    assert long["extra_fields"]["min_global_steps"] == served, long
    assert long["extra_fields"]["max_global_steps"] == served + 1, long
    assert checks["parked_waited"] and checks["parked"]["extra_fields"]["global_steps"] == served + 1, checks
    rejected = checks["rejected"]
    assert rejected["stop_reason"] == "aborted" and rejected["tokens"] == 0 and rejected["seconds"] < 1, rejected
    assert checks["other_schedule"]["status"] == 409 and "steps [1, 2, 5]" in checks["other_schedule"]["detail"]


def test_verl_settings_the_plugin_cannot_honour_are_refused_by_name(runs):
    said = runs["fully_async"]["checks"]["refusals"]
    assert "actor_rollout_ref.rollout.profiler.tool_config.torch.profile_token_start" in said["profile_token_start"]
    assert "actor_rollout_ref.rollout.enable_rollout_routing_replay" in said["routing_replay"]
    assert "checkpoint_engine.engine_kwargs.rollout_profiler.url" in said["no_url"]
    assert "checkpoint_engine.backend is 'nccl'" in said["backend"] and "=rollout_profiler" in said["backend"]
