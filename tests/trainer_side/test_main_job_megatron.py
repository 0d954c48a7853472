"""The main job with `trainer.backend: megatron` (config/trainer.megatron.yaml; docs/trainer.md#megatron):
at tensor parallelism 2, steps 1, 2 and 5 complete with both ranks' traces and their Megatron
coordinates, the replicas on weights k-1, `verify` clean, weights by path; at pipeline parallelism 2
(shorter), the same with the weights through the app's object store, and summarize shows each
stage's training time and bubble."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.traces import read_trace

from .helpers import REPO_ROOT, by_role, read_manifest
from .test_main_job import check_step, run_cli

CONFIG = "config/trainer.megatron.yaml"
pytestmark = [pytest.mark.integration, pytest.mark.timeout(700)]


@pytest.fixture(scope="module")
def tp2_job(tmp_path_factory):
    return run_cli(tmp_path_factory.mktemp("megatron-tp2"), "trainer.total_versions=6", config=CONFIG)


@pytest.fixture(scope="module")
def pp2_job(tmp_path_factory):
    return run_cli(
        tmp_path_factory.mktemp("megatron-pp2"),
        "trainer.total_versions=3",
        "global_profiler.steps=[1,2]",
        "trainer.megatron.tensor_parallel_size=1",
        "trainer.megatron.pipeline_parallel_size=2",
        "trainer.weight_transfer=object_store",
        config=CONFIG,
    )


def _process_names(path) -> set[str]:
    events = read_trace(path)["traceEvents"]
    return {e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}


def _verify(job) -> None:
    verify = subprocess.run(
        [sys.executable, "-m", "profiling", "verify", str(job.profile)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


def _check_layout(job, steps: list[int], grid: dict[int, tuple[int, int]], transfer: str) -> None:
    assert job.returncode == 0, job.log
    assert f"{len(steps)} steps verified: 0 violations" in job.stdout, job.log
    assert "ERROR" not in job.stderr, job.stderr[-4000:]
    for k in steps:
        check_step(job, k)
        m = read_manifest(job.profile, k)
        trainer = {e["rank"]: e for e in by_role(m, "trainer")}
        assert {r: (e["parallel"]["tp"], e["parallel"]["pp"]) for r, e in trainer.items()} == grid, trainer
        assert m["sync"]["gather_s"] is not None and 0 < m["sync"]["gather_s"] <= m["sync"]["publish_s"], m["sync"]
        assert m["sync"]["transfer"] == transfer, m["sync"]
        names = _process_names(job.profile / f"step_{k}" / "merged.trace.json.gz")
        for tp, pp in grid.values():
            assert any(n.startswith(f"trainer tp{tp} pp{pp} (rank ") for n in names), names
        view = sorted(p.name for p in (job.profile / f"step_{k}" / "ranks").glob("*trainer*"))
        assert [n.split("-", 1)[1].split(".")[0] for n in view] == [
            f"trainer-rank_{r}-tp{tp}-pp{pp}" for r, (tp, pp) in sorted(grid.items())
        ], view
    _verify(job)


def test_tensor_parallel_2_profiles_steps_1_2_5_on_both_ranks(tp2_job):
    _check_layout(tp2_job, [1, 2, 5], {0: (0, 0), 1: (1, 0)}, "path")


def test_pipeline_parallel_2_profiles_both_stages_with_their_bubble_weights_by_object_store(pp2_job):
    _check_layout(pp2_job, [1, 2], {0: (0, 0), 1: (0, 1)}, "object_store")
    summary = subprocess.run(
        [sys.executable, "-m", "profiling", "summarize", str(pp2_job.profile), "--step", "1", "--json"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert summary.returncode == 0, summary.stderr
    (step,) = json.loads(summary.stdout)
    stages = step["breakdown"]["pipeline"]
    assert [s["stage"] for s in stages] == [0, 1], stages
    for s in stages:
        assert s["training_s"] > 0 and 0 < s["bubble_s"] < s["training_s"], s
        assert s["compute_s"] == pytest.approx(s["training_s"] - s["bubble_s"], abs=1e-5), s
    text = subprocess.run(
        [sys.executable, "-m", "profiling", "summarize", str(pp2_job.profile), "--step", "1"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "pipeline stages" in text.stdout and "trainer tp0 pp1 (rank 1)" in text.stdout, text.stdout
    report = (pp2_job.profile / "step_1" / "report.html").read_text()
    assert "pipeline stage" in report and "bubble" in report
