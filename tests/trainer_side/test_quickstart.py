"""docs/quickstart.md, run as written: its marked ```bash blocks run from the repo root in bash,
and what the page promises they print and write is checked (tests/trainer_side/quickstart.py says
how blocks are marked). The main job's run is shared with test_main_job.py, which checks its
traces in depth."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from . import quickstart
from .helpers import REPO_ROOT, by_role, read_manifest
from .quickstart import block, blocks, json_values, readme_commands

pytestmark = [pytest.mark.integration, pytest.mark.timeout(quickstart.MAIN_JOB_TIMEOUT_S + 300)]

PROFILE = REPO_ROOT / "outputs" / "profile"
APP_TRACES = Path("/tmp/rollout-profiler/traces")  # config/serve.yaml's save_path
APP_URL = "http://127.0.0.1:8000"  # config/serve.yaml's http_options
HTTP_TIMEOUT_S = 600.0


def test_the_page_runs_every_command_but_the_readme_test_command():
    main_job, tests = readme_commands()
    assert block("main-job").body == main_job, "the quick start's main job must be README.md's first command"
    unmarked = [b.body for b in blocks() if b.kind is None]
    assert unmarked == [tests], f"every other ```bash block must be marked to run: {unmarked}"
    assert [b.name for b in blocks() if b.kind] == ["main-job", "inspect", "serve", "http", "http-results"]


def test_main_job_prints_and_writes_what_the_page_says(quickstart_main_job):
    run = quickstart_main_job
    assert run.returncode == 0, run.log
    assert "starting a local Ray + rollout app ..." in run.stdout, run.log
    assert "Profiled steps" in run.stdout and f"traces under {PROFILE}" in run.stdout, run.log
    assert f"report: {PROFILE / 'index.html'}" in run.stdout, run.log
    assert sorted(p.name for p in PROFILE.glob("step_*")) == ["step_1", "step_2", "step_5"]
    assert (PROFILE / "index.html").is_file()
    for k in (1, 2, 5):
        step = PROFILE / f"step_{k}"
        m = read_manifest(PROFILE, k)
        assert m["status"] == "complete" and m["merge"]["status"] == "ok", m
        for name in ("manifest.json", "session.json", "merge.json", "merged.trace.json.gz", "report.html"):
            assert (step / name).is_file(), f"{step / name} missing"
        rollout, trainer = by_role(m, "rollout"), by_role(m, "trainer")
        assert len(rollout) == 2 and [e["rank"] for e in trainer] == [0], m["entries"]
        for e in rollout:
            trace = f"rollout/{e['replica_id']}/trace.pt.trace.json.gz"
            assert e["weight_version"] == k - 1 and e["files"] == [trace], e
            assert (step / "rollout" / e["replica_id"] / "entry.record").is_file()
        assert trainer[0]["files"] == ["trainer/rank_0/trace.pt.trace.json.gz"], trainer[0]
        assert (step / "trainer" / "rank_0" / "entry.record").is_file()
        assert m["sync"] is not None and m["sync"]["stop_s"] is not None, m["sync"]
    assert sorted(p.name for p in (REPO_ROOT / "outputs" / "weights").iterdir()) == [
        "v28.safetensors", "v29.safetensors", "v30.safetensors"
    ]


FALSE_ALARMS = {
    "Kineto's thread check (torch.profiler first started off the thread that imported torch)": (
        "External init callback must run in same thread as registerClient"
    ),
    "Kineto's USDT probe lines (KINETO_LOG_LEVEL)": "SyncActivityProfilerHandler.cpp",
    "Ray's retry warning for serve.shutdown()'s graceful_shutdown": "ServeController.graceful_shutdown failed",
}
"""Lines the main job once printed that look like failures and are not (trainer/local_app.py,
trainer/__main__.py and profiling/backends/torch_profiler.py say where each came from)."""


def test_main_job_prints_no_false_alarms(quickstart_main_job):
    run = quickstart_main_job
    assert run.returncode == 0, run.log
    lines = (run.stdout + run.stderr).splitlines()
    found = {what: hits for what, marker in FALSE_ALARMS.items() if (hits := [s for s in lines if marker in s])}
    assert not found, f"{found}\n{run.log}"
    assert not [s for s in lines if s.startswith("USDT:")], run.log


def test_inspect_commands(quickstart_main_job):
    assert quickstart_main_job.returncode == 0, quickstart_main_job.log
    run = quickstart.run(block("inspect"), timeout_s=300)
    assert run.returncode == 0, run.log
    assert f"steps under {PROFILE}" in run.stdout, run.log
    rows = [line for line in run.stdout.splitlines() if "│ complete │" in line]
    assert len(rows) == 3 and all(line.rstrip().endswith("yes │") for line in rows), run.log
    assert "step 1 (complete): processes" in run.stdout and "trainer/rank_0" in run.stdout, run.log
    assert "step 1: top 3 ops by self time" in run.stdout, run.log


def test_http_walkthrough(quickstart_lock, tmp_path):
    """serve run in the background, the curl calls and the CLI, as written; the server and its
    private Ray are stopped by pid whatever happens."""
    assert not quickstart.port_in_use(8000), "port 8000 is in use (another `serve run`?); the quick start serves there"
    log = tmp_path / "serve.log"
    with quickstart.set_aside(APP_TRACES), quickstart.background(block("serve"), log) as server:
        http = quickstart.run(block("http"), HTTP_TIMEOUT_S)
        where = f"{http.log}\n--- serve run (exit {server.poll()}) ---\n{log.read_text()[-4000:]}"
        assert http.returncode == 0, where
        start, completion, stop = json_values(http.stdout)
        assert start["state"] == "profiling" and start["steps"] == [1], where
        assert len(start["replicas"]) == 2 and all(r["ok"] for r in start["replicas"]), where
        assert completion["object"] == "text_completion" and completion["weight_version"] == 0, where
        generated = len(completion["choices"][0]["token_ids"])
        assert 1 <= generated <= 8, where
        assert stop["stopped"] is True and stop["manifest"] == str(APP_TRACES / "step_1" / "manifest.json"), where
        assert {r["files"][0] for r in stop["replicas"]} == {
            f"rollout/{r['replica_id']}/trace.pt.trace.json.gz" for r in start["replicas"]
        }, where

        results = quickstart.run(block("http-results"), HTTP_TIMEOUT_S)
        where = f"{results.log}\n--- serve run ---\n{log.read_text()[-4000:]}"
        assert results.returncode == 0, where
        assert "idle (step None, weights v0, paused False)" in results.stdout, where
        assert f"steps under {APP_TRACES}" in results.stdout, where
        assert f"index: {APP_TRACES / 'index.html'}" in results.stdout, where
        m = read_manifest(APP_TRACES, 1)
        assert m["status"] == "complete" and len(by_role(m, "rollout")) == 2, m
        assert sum(e["forward_steps"] for e in m["entries"]) == generated, m["entries"]  # one per token

        # The route reference in docs/http_api.md is what this running app serves.
        from tools.openapi_doc import build_openapi, render_reference

        with urllib.request.urlopen(f"{APP_URL}/openapi.json", timeout=30) as answer:
            live = json.load(answer)
        assert render_reference(live) == render_reference(build_openapi())
