"""The trace budget end to end on the real app (docs/profiling.md#trace-budget): a start's
`max_trace_mb` reaches the replica, a trace over it is cut to whole forward steps and its entry
says so, the next window stops early on the learned estimate, and a budget above
`start_limits.max_trace_mb` is refused."""

from __future__ import annotations

import gzip

import pytest
from integ_util import client, complete_concurrently, ok, stop_if_active, wait_manifest
from support.apps import deployed

from profiling.markers import FORWARD_STEP
from profiling.step_ranges import count_engine_steps
from profiling.trace_budget import MIB

pytestmark = pytest.mark.integration


def record(http, step: int, **options: object) -> dict:
    """Start `step` with `options`, generate, stop; the replica's settled entry."""
    try:
        ok(http.post("/profile/start", json={"step": step, "max_forward_steps": 1000, **options}))
        for _ in range(3):
            complete_concurrently(http, n=2, max_tokens=8)
        ok(http.post("/profile/stop", json={"step": step}))
    finally:
        stop_if_active(http)
    manifest = wait_manifest(http, step, ("complete", "partial"))
    assert manifest["status"] == "complete", manifest
    (entry,) = manifest["entries"]
    return entry


def test_budget_cuts_then_stops_early_and_is_bounded_by_start_limits(ray_cluster, model_dir, tmp_path):
    with deployed(ray_cluster, model_dir, tmp_path, "budget", num_replicas=1) as app, client(app.base_url) as http:
        plain = record(http, 1)  # the default budget: nothing cut, a step's size measured
        assert not plain["truncated"] and plain["auto_stopped"] is None and plain["forward_steps"] > 8, plain
        budget_mb = plain["trace_mb"] / plain["forward_steps"] * 4

        # Other options (shapes): nothing learned for them, so the export cuts.
        cut = record(http, 2, max_trace_mb=budget_mb, record_shapes=True)
        assert cut["truncated"] and cut["trace_mb"] > budget_mb and not cut["over_budget"], cut
        assert 0 < cut["forward_steps_kept"] < cut["forward_steps"], cut
        path = app.save_path / "step_2" / cut["files"][0]
        assert len(gzip.decompress(path.read_bytes())) <= budget_mb * MIB
        assert count_engine_steps(path, FORWARD_STEP) == cut["forward_steps_kept"]

        # The options of step 1: the replica knows what a step costs and stops before the budget.
        early = record(http, 3, max_trace_mb=budget_mb)
        assert early["auto_stopped"] == "max_trace_mb" and 0 < early["forward_steps"] <= 4, early

        refused = http.post("/profile/start", json={"step": 4, "max_trace_mb": 10**6})
        assert refused.status_code == 422 and "start_limits.max_trace_mb" in refused.text, refused.text
