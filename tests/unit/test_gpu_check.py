"""tools/gpu_check.sh and tools/gpu_profile_check.py on CPU: the check's logic, its report lines
and exit codes, and that its checks fail when what they check is missing. The CUDA parts
(activities [cpu, cuda], the kernel check on a real trace) need a GPU: docs/operations.md#gpu-check."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools.gpu_profile_check import Report, kernels_in_ranges, run_verify

ROOT = Path(__file__).resolve().parents[2]
CHECK = [sys.executable, "-m", "tools.gpu_profile_check"]


def _run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory, model_dir) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One in-process check on CPU (activities [cpu]); returns its out dir and the finished run."""
    out = tmp_path_factory.mktemp("gpu-check")
    done = _run([*CHECK, "run", "--out", str(out), "--device", "cpu", "--cache-dir", str(model_dir.parent)])
    return out, done


def test_cpu_run_passes_every_check(cpu_run):
    out, done = cpu_run
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for k, v in ((1, 0), (2, 1)):
        assert (
            f"PASS manifest step {k}: status complete, forward_steps rollout/gpu-check-0=4, trainer/rank_0=2" in lines
        )
        assert f"PASS markers step {k} rollout/gpu-check-0: 4 forward_step ranges, all weight_version={v}" in lines
        assert f"PASS markers step {k} trainer/rank_0: 2 forward_step ranges, all weight_version={v}" in lines
        assert any(line.startswith(f"PASS merge step {k}: ") for line in lines)
        assert any(line.startswith(f"PASS weights step {k}: version {k} loaded") for line in lines)
    assert any(line.startswith("PASS verify: no violation") for line in lines)
    assert "SKIP cuda-kernels: cpu mode: no CUDA activity recorded" in lines
    assert lines[-1] == "12 passed, 0 failed, 1 skipped"
    assert (out / "traces" / "step_2" / "merged.trace.json.gz").is_file()


def test_kernel_check_fails_on_a_trace_without_cuda_activity(cpu_run):
    out, _ = cpu_run
    done = _run([*CHECK, "kernels", str(out / "traces")])
    assert done.returncode == 1
    assert "FAIL cuda-kernels step 1 gpu-check-0: 0/4 engine-step ranges launched kernels" in done.stdout


def test_verify_violation_is_a_failed_check(cpu_run, tmp_path):
    out, _ = cpu_run
    traces = tmp_path / "traces"
    shutil.copytree(out / "traces", traces)
    trace = traces / "step_2" / "rollout" / "gpu-check-0" / "trace.pt.trace.json.gz"
    text = gzip.decompress(trace.read_bytes()).decode()
    assert "step=2 weight_version=1" in text
    trace.write_bytes(gzip.compress(text.replace("step=2 weight_version=1", "step=2 weight_version=2", 1).encode()))
    report = Report()
    run_verify(report, traces)
    [check] = report.checks
    assert check.status == "FAIL" and check.detail.startswith("violations: ")
    assert "weight_version" in check.detail


def _range(name: str, ts: float, dur: float, pid: int = 1) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": pid, "tid": 1, "ts": ts, "dur": dur}


def _launch(ts: float, corr: int, pid: int = 1) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": 1, "ts": ts, "dur": 1,
            "args": {"correlation": corr}}  # fmt: skip


def _kernel(ts: float, corr: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": ts, "dur": 5,
            "args": {"correlation": corr}}  # fmt: skip


def test_kernels_belong_to_the_range_that_launched_them():
    events = [
        _range("forward_step#0 step=1 weight_version=0", 0, 100),
        _launch(10, corr=1),
        _kernel(500, corr=1),  # runs after its range closed: still that range's
        _kernel(510, corr=1),
        _range("forward_step#1 step=1 weight_version=0", 200, 100),
        _launch(150, corr=2),  # between the ranges: its kernel is no range's
        _kernel(250, corr=2),  # inside the second range's time, launched outside it
        _launch(250, corr=3, pid=2),  # another process
        _kernel(260, corr=3),
        _range("other range", 0, 1000),
    ]
    c = kernels_in_ranges(events, ("forward_step#",))
    assert (c.ranges, c.ranges_with_kernels, c.kernels_in_ranges, c.kernels) == (2, 1, 2, 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_script_without_cuda_says_so_and_exits_3(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "GPU_CHECK_ALLOW_CPU"}
    done = _run(["bash", "tools/gpu_check.sh", str(tmp_path)], env={**env, "PYTHON": sys.executable})
    assert done.returncode == 3, done.stdout + done.stderr
    assert (tmp_path / "report.txt").read_text().startswith("SKIP: no CUDA device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_script_in_cpu_mode_reports_each_check(tmp_path, model_dir):
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "GPU_CHECK_ALLOW_CPU": "1",
        "GPU_CHECK_BUDGET_S": "120",  # leaves too little for the vLLM part: skipped, as reported
        "GPU_CHECK_WORK": str(tmp_path / "work"),
        "ROLLOUT_PROFILER_CACHE": str(model_dir.parent),
        "PATH": "/usr/bin:/bin",  # no nsys
    }
    done = _run(["bash", "tools/gpu_check.sh", str(tmp_path / "out")], env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    report = (tmp_path / "out" / "report.txt").read_text().splitlines()
    assert "PASS inproc markers step 2 rollout/gpu-check-0: 4 forward_step ranges, all weight_version=1" in report
    assert any(line.startswith("PASS inproc verify: no violation") for line in report)
    assert "SKIP vllm: under 150 s of the 120s budget left" in report
    assert "SKIP nsys: nsys is not on PATH" in report
    assert report[-1] == "12 passed, 0 failed, 3 skipped"
    assert (tmp_path / "out" / "traces.tar.gz").is_file()
