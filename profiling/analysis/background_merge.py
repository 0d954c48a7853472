"""`python -m profiling.analysis.background_merge ROOT STEP`: one background merge, as
`profiling.analysis.auto.AutoMerger` runs it in a child process: a settled step whose merge is
stale, at the lowest CPU priority, importing only what a merge needs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from profiling.analysis.merge import MergeError, merge_step
from profiling.analysis.sources import load_manifest
from profiling.store import TraceStore


def merge_if_settled(root: Path, step: int) -> None:
    """Merge `step` under `root` if it is settled (complete or partial) and its merge is stale.
    MergeError when the merge fails (also recorded in its merge.json)."""
    store = TraceStore(root)
    if load_manifest(store, step).status in ("complete", "partial"):
        merge_step(store, step, only_if_stale=True)
    # else still recording or exporting: the refresh that settles it merges again


def main(argv: list[str]) -> int:
    os.nice(19)  # below the producers: a background merge must not slow a training or serving step
    root, step = Path(argv[0]), int(argv[1])
    try:
        merge_if_settled(root, step)
    except MergeError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
