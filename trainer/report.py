"""The end of the run: the table (per profiled step, its files, the sync's cost, forward steps),
and each step's merged timeline, trace-tool view (`ranks/`) and HTML report."""

from __future__ import annotations

import time
from pathlib import Path

from rich.table import Table

from profiling.analysis.merge import MergeError, merge_step
from profiling.analysis.report import write_reports
from profiling.analysis.tool_view import build_tool_view
from profiling.manifest import StepManifest
from profiling.store import TraceStore


def wait_for_manifests(store: TraceStore, labels: list[int], timeout_s: float) -> dict[int, StepManifest | None]:
    """The manifests of the windows `labels` once no export is pending (or the timeout passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = {k: store.read_manifest(k) for k in labels}
        settled = all(m is not None and m.status in ("complete", "partial") for m in found.values())
        if settled or time.monotonic() > deadline:
            return found
        time.sleep(0.25)


def profile_table(manifests: dict[int, StepManifest | None]) -> Table:
    table = Table(title="Profiled steps")
    for col in (
        "step",
        "status",
        "trainer files",
        "rollout files",
        "rollout fwd steps",
        "sync stop/update/start ms",
        "MB",
    ):
        table.add_column(col, justify="right" if col != "status" else "left")
    for label, m in manifests.items():
        if m is None:
            table.add_row(str(label), "missing", "-", "-", "-", "-", "-")
            continue
        trainer = [e for e in m.entries if e.role == "trainer"]
        rollout = [e for e in m.entries if e.role == "rollout"]
        s = m.sync
        cost = (
            "-"
            if s is None
            else "/".join("-" if x is None else f"{x * 1000:.0f}" for x in (s.stop_s, s.update_s, s.start_s))
        )
        table.add_row(
            ",".join(map(str, m.steps)),
            m.status,
            str(sum(len(e.files) for e in trainer)),
            str(sum(len(e.files) for e in rollout)),
            str(sum(e.forward_steps for e in rollout)),
            cost,
            f"{sum(e.bytes for e in m.entries) / 2**20:.1f}",
        )
    return table


def finish_steps(store: TraceStore, labels: list[int], merge: bool) -> tuple[Path, list[str]]:
    """Make sure each step's merged timeline is current (`merge`: waits for a background merge
    still running, merges if none did, retries one that failed) and its `ranks/` view is written
    (every trace as one rank, for HTA and TensorBoard), then write the steps' reports and the
    index. Returns the index and the errors."""
    errors = []
    if merge:
        for k in labels:
            try:
                merge_step(store, k, only_if_stale=True)
                last = store.read_merge(k)
                if last is None or last.status != "ok":
                    merge_step(store, k)
                build_tool_view(store, k)
            except (MergeError, OSError, ValueError) as e:
                errors.append(f"step {k}: {e}")
    return write_reports(store, labels).index, errors
