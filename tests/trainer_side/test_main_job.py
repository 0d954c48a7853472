"""The main job exactly as a user runs it, then the traces it leaves. The default run is the quick
start's main-job block, README.md's first command as written (the session fixture
`quickstart_main_job`, shared with test_quickstart.py so CI runs the job once); a second run with
its own overrides checks the end of the job."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from analysis.browser import assert_report_rendered, screenshot
from support.traces import read_trace

from profiling.markers import parse_forward_step

from .helpers import RAY_STARTUP_TIMEOUT, REPO_ROOT, by_role, entry_markers, read_manifest
from .quickstart import MAIN_JOB_TIMEOUT_S

CLI_TIMEOUT_S = 600
EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception)\b")
"""A line that ends a traceback (`RuntimeError: ...`, `trainer.client.RolloutError: ...`)."""
# The first test here also runs the session's quick-start main job (pip + 30 versions).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(MAIN_JOB_TIMEOUT_S + 180)]


@dataclass
class CliRun:
    returncode: int
    stdout: str
    stderr: str
    profile: Path

    @property
    def log(self) -> str:
        # Every exception line of the whole stderr: a rank's own cause can lie far above the tail
        # that another rank's traceback fills.
        raised = "\n".join(line for line in self.stderr.splitlines() if EXCEPTION_LINE.match(line))
        return (
            f"--- stdout tail ---\n{self.stdout[-6000:]}\n--- exceptions in stderr ---\n{raised[-4000:]}"
            f"\n--- stderr tail ---\n{self.stderr[-3000:]}"
        )


def run_cli(tmp: Path, *overrides: str, config: str = "config/trainer.yaml", retried: bool = False) -> CliRun:
    profile, weights = tmp / "profile", tmp / "weights"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable, "-m", "trainer",
        "--config", config,
        *overrides,
        f"global_profiler.save_path={profile}",
        f"trainer.weights_dir={weights}",
    ]
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        pytest.fail(
            f"CLI ran past {CLI_TIMEOUT_S}s\n--- stdout tail ---\n{out[-6000:]}\n--- stderr tail ---\n{err[-3000:]}"
        )
    run = CliRun(proc.returncode, proc.stdout, proc.stderr, profile)
    if run.returncode != 0 and RAY_STARTUP_TIMEOUT in proc.stderr and not retried:
        return run_cli(tmp / "retry", *overrides, config=config, retried=True)
    return run


def check_step(run: CliRun, k: int) -> None:
    """Step k's manifest is complete, its files exist, and its rollout traces are step k on weights k-1."""
    step_dir = run.profile / f"step_{k}"
    m = read_manifest(run.profile, k)
    assert m is not None, f"step_{k}/manifest.json missing\n{run.log}"
    assert m["status"] == "complete", f"step {k}: {m}\n{run.log}"
    assert m["step"] == k and m["steps"] == [k], m
    rollout, trainer = by_role(m, "rollout"), by_role(m, "trainer")
    assert rollout and trainer, f"step {k}: entries {m['entries']}"
    for e in m["entries"]:
        assert e["status"] == "ok" and e["files"], e
        for rel in e["files"]:
            assert (step_dir / rel).is_file(), f"{step_dir / rel} listed in the manifest but missing"
    for e in trainer:
        sync = e["sync"]
        assert sync is not None and sync["stop_s"] is not None and sync["update_s"] is not None, e
    for e in rollout:
        assert e["weight_version"] == k - 1, e
        markers = entry_markers(step_dir, e)
        assert markers, f"step {k}, replica {e['replica_id']}: no forward_step marker in its trace"
        assert {s for _, s, _ in markers} == {k}, sorted({s for _, s, _ in markers})
        assert {v for *_, v in markers} == {k - 1}, sorted({v for *_, v in markers})


@pytest.fixture(scope="module")
def main_job(quickstart_main_job) -> CliRun:
    """README.md's main job as written: config/trainer.yaml's steps [1, 2, 5] into outputs/profile."""
    run = quickstart_main_job
    return CliRun(run.returncode, run.stdout, run.stderr, REPO_ROOT / "outputs" / "profile")


def test_main_job_exits_0_with_exactly_the_profiled_step_dirs(main_job):
    assert main_job.returncode == 0, f"exit code {main_job.returncode}\n{main_job.log}"
    found = sorted(p.name for p in main_job.profile.glob("step_*"))
    assert found == ["step_1", "step_2", "step_5"], f"{found}\n{main_job.log}"
    assert all((main_job.profile / n).is_dir() for n in found)
    assert "Profiled steps" in main_job.stdout, main_job.log


@pytest.mark.parametrize("k", [1, 2])
def test_main_job_step_is_complete_and_attributed(main_job, k):
    assert main_job.returncode == 0, main_job.log
    check_step(main_job, k)


# Step 5 is stopped at the sync publishing version 5, shortly before the job ends: its exports must
# still be complete (the job waits for them before it shuts the app down).
def test_main_job_step_5_is_complete_and_attributed(main_job):
    assert main_job.returncode == 0, main_job.log
    check_step(main_job, 5)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_main_job_merges_the_step_from_every_process(main_job, k):
    """step_<k>/merged.trace.json.gz holds the trainer's and every replica's forward steps, each
    process named, clocks measured, and the sync's control calls."""
    assert main_job.returncode == 0, main_job.log
    m = read_manifest(main_job.profile, k)
    assert m["merge"] is not None and m["merge"]["status"] == "ok", m["merge"]
    assert {a["source"] for a in m["merge"]["processes"]} == {"clock_sync"}, m["merge"]["processes"]
    trace = read_trace(main_job.profile / f"step_{k}" / "merged.trace.json.gz")
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    unnamed = {e["pid"] for e in events if e.get("ph") != "M"} - set(names)
    assert not unnamed, f"events of unnamed processes {unnamed}"
    groups = ["trainer rank 0"] + [f"rollout {e['replica_id']} (" for e in by_role(m, "rollout")]
    forward_in = {names[e["pid"]] for e in events if parse_forward_step(str(e.get("name", "")))}
    for group in groups:
        assert any(n.startswith(group) for n in forward_in), f"step {k}: no forward step from {group!r}: {forward_in}"
    rollout_names = [n for n in names.values() if n.startswith("rollout ")]
    assert all(f"weights v{k - 1}" in n for n in rollout_names), rollout_names
    assert any(e.get("name") == f"stop step {k}" for e in events)


def test_main_job_writes_a_report_that_renders(main_job, tmp_path):
    assert main_job.returncode == 0, main_job.log
    index = main_job.profile / "index.html"
    assert f"report: {index}" in main_job.stdout, main_job.log
    for k in (1, 2, 5):
        assert (main_job.profile / f"step_{k}" / "report.html").is_file()
    assert_report_rendered(screenshot(main_job.profile / "step_1" / "report.html", tmp_path / "step_1.png"))


def test_last_step_export_survives_the_end_of_the_job(tmp_path):
    """The last version's step is profiled with a trace that takes a while to export (stacks and
    shapes on, uncapped, 64-token completions: tens of seconds): the job must still leave a
    complete step with every trace on disk."""
    serve_cfg = yaml.safe_load((REPO_ROOT / "config" / "serve.yaml").read_text())
    args = serve_cfg["applications"][0]["args"]
    args["profiler"].update(with_stack=True, record_shapes=True, max_forward_steps=None)
    args["start_limits"] = {"with_stack": True, "max_forward_steps": None}
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(serve_cfg))
    run = run_cli(
        tmp_path,
        "global_profiler.steps=[2]",
        "trainer.total_versions=2",
        "rollout.max_tokens=64",
        f"rollout.serve_config={tmp_path / 'serve.yaml'}",
    )
    assert run.returncode == 0, run.log
    assert sorted(p.name for p in run.profile.glob("step_*")) == ["step_2"]
    leftovers = [str(p) for p in run.profile.rglob("*.tmp*")]
    check_step(run, 2)
    assert not leftovers, f"half-written exports left behind: {leftovers}"


@pytest.mark.parametrize("k", [1, 5])
def test_main_job_reports_the_rl_step_breakdown(main_job, k):
    """Each replica's entry accounts for its window (generating + held + idle), its requests and
    the versions it served; the trainer's records the staleness of what it consumed; summarize and
    the report show the breakdown."""
    from profiling.analysis.summary import summarize_step
    from profiling.store import TraceStore

    assert main_job.returncode == 0, main_job.log
    m = read_manifest(main_job.profile, k)
    for e in by_role(m, "rollout"):
        r = e["requests"]
        assert r is not None, f"step {k}, replica {e['replica_id']}: no request accounting"
        assert r["generating_s"] + r["held_s"] + r["idle_s"] == pytest.approx(r["window_s"], abs=1e-3), r
        assert r["generating_s"] > 0 and r["requests"] > 0 and r["output_tokens"] > 0, r
        # answered in step k's window: on weights k-1, or across the sync before it (k-2 and k-1)
        versions = {int(v) for v in r["weight_versions"]}
        assert k - 1 in versions and versions <= {k - 2, k - 1}, r
        assert 0 < len(r["slowest"]) <= 5 and r["slowest"][0]["latency_s"] >= r["slowest"][-1]["latency_s"], r
    [trainer] = by_role(m, "trainer")
    st = trainer["staleness"]
    assert st is not None and st["samples"] > 0 and 0 <= st["max"] <= 2, st  # config: max_staleness 2
    b = summarize_step(TraceStore(main_job.profile), k).breakdown
    assert b.imbalance.generating_max_over_mean is not None and b.imbalance.generating_max_over_mean >= 1.0
    assert b.requests == sum(e["requests"]["requests"] for e in by_role(m, "rollout"))
    assert b.staleness is not None and b.trainer[0].training_s > 0
    html = (main_job.profile / f"step_{k}" / "report.html").read_text()
    assert "RL step breakdown" in html and "Slowest requests" in html


@pytest.mark.parametrize("k", [1, 2])
def test_main_job_holds_are_recorded_and_hta_loads_the_step_as_ranks(main_job, k):
    """Each replica's entry says how long it was held for the sync that ended the step, and the
    step's `ranks/` view loads in Holistic Trace Analysis with the trainer and every replica as a
    rank of its own, each with its forward steps."""
    from hta.trace_analysis import TraceAnalysis

    assert main_job.returncode == 0, main_job.log
    m = read_manifest(main_job.profile, k)
    rollout = by_role(m, "rollout")
    for e in rollout:
        assert e["sync_held_s"] is not None and 0 < e["sync_held_s"] < 60, e
    analyzer = TraceAnalysis(trace_dir=str(main_job.profile / f"step_{k}" / "ranks"))
    assert sorted(analyzer.t.traces) == list(range(1 + len(rollout)))
    table = analyzer.t.symbol_table.get_sym_table()
    for rank in analyzer.t.traces:
        names = analyzer.t.get_trace(rank)["name"].map(lambda i: table[i])
        assert names.str.startswith("forward_step#").sum() > 0, f"step {k}: rank {rank} has no forward step"



def test_main_job_verifies_clean_and_a_corrupted_marker_fails(main_job, tmp_path):
    """The job verified itself (its verdict line); `python -m profiling verify` on its save_path
    passes; a copy of step 1 with one rollout marker's version changed fails, naming it."""
    import gzip
    import json
    import shutil

    assert main_job.returncode == 0, main_job.log
    assert "3 steps verified: 0 violations" in main_job.stdout, main_job.log
    verify = [sys.executable, "-m", "profiling", "verify"]
    ok = subprocess.run([*verify, str(main_job.profile)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "3 steps verified: 0 violations" in ok.stdout, ok.stdout

    shutil.copytree(main_job.profile / "step_1", tmp_path / "step_1", ignore=shutil.ignore_patterns("ranks", "merged*"))
    m = read_manifest(tmp_path, 1)
    replica = by_role(m, "rollout")[0]
    trace = tmp_path / "step_1" / replica["files"][0]
    text = gzip.decompress(trace.read_bytes()).decode()
    assert "step=1 weight_version=0" in text
    trace.write_bytes(gzip.compress(text.replace("step=1 weight_version=0", "step=1 weight_version=7", 1).encode()))
    bad = subprocess.run([*verify, str(tmp_path), "--json"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    [violation] = json.loads(bad.stdout)["violations"]
    assert violation["entry"] == f"rollout/{replica['replica_id']}" and violation["check"] == "versions", violation
    assert "weight_version=7" in violation["message"], violation
