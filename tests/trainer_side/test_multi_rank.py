"""Several trainer ranks (docs/trainer.md#several-ranks): the 2-rank FSDP main job on the embedded
engine, verified; a rank selection with a rank killed mid-step; and a non-driving rank that never
talks to the app."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from support.traces import read_trace

from profiling.markers import parse_forward_step
from profiling.schedule import StepSchedule
from trainer.profiled_sync import ProfiledWeightSync, RankRole

from .helpers import REPO_ROOT, read_manifest, wait_manifest
from .test_main_job import run_cli

FSDP_CONFIG = "config/trainer.fsdp.yaml"


@pytest.fixture(scope="module")
def fsdp_job(tmp_path_factory):
    return run_cli(tmp_path_factory.mktemp("fsdp"), config=FSDP_CONFIG)


@pytest.mark.integration
@pytest.mark.timeout(700)
def test_two_fsdp_ranks_record_steps_1_2_5_and_verify(fsdp_job):
    assert fsdp_job.returncode == 0, fsdp_job.log
    assert "3 steps verified: 0 violations" in fsdp_job.stdout, fsdp_job.log
    for k in (1, 2, 5):
        m = read_manifest(fsdp_job.profile, k)
        assert m["status"] == "complete", m
        trainer = {e["rank"]: e for e in m["entries"] if e["role"] == "trainer"}
        assert sorted(trainer) == [0, 1], m["entries"]
        for e in trainer.values():
            assert e["files"] and e["clock_offset"] is not None and e["sync"]["update_s"] is not None, e
        assert (
            m["sync"]["transfer"] == "collective"
            and m["sync"]["transfer_s"] is not None
            and m["sync"]["publish_s"] is not None
        ), m["sync"]
        trace = read_trace(fsdp_job.profile / f"step_{k}" / "merged.trace.json.gz")
        names = {
            e["pid"]: e["args"]["name"]
            for e in trace["traceEvents"]
            if e.get("ph") == "M" and e["name"] == "process_name"
        }
        forward_in = {names[e["pid"]] for e in trace["traceEvents"] if parse_forward_step(str(e.get("name", "")))}
        for rank in (0, 1):
            assert any(n.startswith(f"trainer rank {rank}") for n in forward_in), forward_in
    verify = subprocess.run(
        [sys.executable, "-m", "profiling", "verify", str(fsdp_job.profile)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.mark.integration
@pytest.mark.timeout(700)
def test_a_rank_killed_mid_step_leaves_the_step_partial_naming_it(tmp_path):
    """profiler.ranks [1]: only rank 1 records. Rank 1 is killed (SIGKILL) once it records step 3:
    the job exits nonzero naming it, leaves no rank behind, step 1 holds rank 1's trace alone and
    step 3 is partial, naming trainer/rank_1."""
    profile = tmp_path / "profile"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "--config",
        FSDP_CONFIG,
        "global_profiler.steps=[1,3]",
        "profiler.all_ranks=false",
        "profiler.ranks=[1]",
        "trainer.total_versions=30",
        f"global_profiler.save_path={profile}",
        f"trainer.weights_dir={tmp_path / 'w'}",
    ]
    job = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    entry = profile / "step_3" / "trainer" / "rank_1" / "entry.record"
    deadline = time.monotonic() + 400
    while not entry.is_file() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert entry.is_file(), (
        f"rank 1 never recorded step 3\n{job.communicate(timeout=60)[0][-6000:] if job.poll() is not None else ''}"
    )
    rank1 = json.loads(entry.read_text())["pid"]
    os.kill(rank1, signal.SIGKILL)
    try:
        out, _ = job.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail(f"the job hung after rank 1 died\n{job.communicate()[0][-6000:]}")
    assert job.returncode != 0, out[-6000:]
    assert "trainer rank 1 was killed by SIGKILL" in " ".join(out.split()), out[-6000:]
    m3 = wait_manifest(profile, 3, ("partial",), timeout=60)
    dead = [e for e in m3["entries"] if e["role"] == "trainer"]
    assert [(e["rank"], e["status"]) for e in dead] == [(1, "error")] and "SIGKILL" in dead[0]["error"], dead
    m1 = read_manifest(profile, 1)
    assert m1["status"] == "complete" and [e["rank"] for e in m1["entries"] if e["role"] == "trainer"] == [1], m1
    assert not (profile / "step_1" / "trainer" / "rank_0").exists(), "rank 0 was not selected"
    leftover = subprocess.run(["pgrep", "-f", f"save_path={profile}"], capture_output=True, text=True).stdout.split()
    assert not leftover, f"processes of the job left behind: {leftover}"


class AppUnreachable:
    """A fake client that fails on any use: a non-driving rank must never touch it."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"a non-driving rank used the app's client ({name})")


def test_a_non_driving_rank_profiles_from_the_schedule_alone(tmp_path):
    async def go() -> None:
        sync = ProfiledWeightSync(
            StepSchedule([1, 2]),
            AppUnreachable(),  # type: ignore[arg-type]
            save_path=str(tmp_path),
            role=RankRole(rank=1, drives=False),
        )
        try:
            async with sync:
                for v in (1, 2, 3):
                    with sync.fit_step(v - 1):
                        pass
                    await sync.sync(v, None)
            await sync.wait_exported()
        finally:
            sync.shutdown()

    asyncio.run(go())
    for k in (1, 2):
        entry = json.loads((tmp_path / f"step_{k}" / "trainer" / "rank_1" / "entry.record").read_text())
        assert entry["status"] == "ok" and entry["forward_steps"] == 1 and entry["files"], entry
    assert not (tmp_path / "step_1" / "trainer" / "ranks.record").exists(), "only the driving rank writes the record"


def test_the_driving_rank_needs_a_client():
    with pytest.raises(ValueError, match="driving rank needs a RolloutClient"):
        ProfiledWeightSync(StepSchedule([1]), None, save_path=None)


def test_a_publish_result_is_checked_only_where_it_is_used(tmp_path):
    """A non-driving rank's publish (its part of the gather) returns nothing, and that is fine."""
    calls: list[int] = []

    async def publish() -> None:
        calls.append(1)

    async def go() -> None:
        sync = ProfiledWeightSync(StepSchedule(None), None, save_path=None, role=RankRole(rank=1, drives=False))
        try:
            await sync.sync(1, publish)
        finally:
            sync.shutdown()

    asyncio.run(go())
    assert calls == [1]
