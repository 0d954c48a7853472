"""`python -m profiling.analysis.background_merge ROOT STEP`: one background merge, as
`profiling.analysis.auto.AutoMerger` runs it in a child process: a settled step's merged
timeline and its `ranks/` view (every trace as one rank, for HTA and TensorBoard), each only where
stale, at the lowest CPU priority, importing only what they need."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from profiling.analysis.merge import MergeError, merge_step
from profiling.analysis.sources import load_manifest
from profiling.analysis.tool_view import ViewError, build_tool_view
from profiling.store import TraceStore


def merge_if_settled(root: Path, step: int) -> list[str]:
    """If `step` under `root` is settled (complete or partial): merge it, then write its ranks
    view, each only if stale. The view is written even when the merge fails (it needs only the
    traces). Returns what failed, each message naming the cause and the fix (a failed merge is
    also recorded in its merge.json); empty when all is done or was up to date."""
    store = TraceStore(root)
    if load_manifest(store, step).status not in ("complete", "partial"):
        return []  # still recording or exporting: the refresh that settles it merges again
    failed = []
    try:
        merge_step(store, step, only_if_stale=True)
    except MergeError as e:
        failed.append(str(e))
    try:
        build_tool_view(store, step, only_if_stale=True)
    except ViewError as e:
        failed.append(str(e))
    return failed


def main(argv: list[str]) -> int:
    os.nice(19)  # below the producers: a background merge must not slow a training or serving step
    root, step = Path(argv[0]), int(argv[1])
    failed = merge_if_settled(root, step)
    for message in failed:
        print(message, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
