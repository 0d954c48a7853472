"""Merges started by `TraceStore(merge_on_complete=True)` when a step settles: its merged timeline
and its `ranks/` view (`background_merge`).

Each merge runs as a child process (`python -m profiling.analysis.background_merge DIR STEP`), waited on by
one background thread per store: the merge never holds the caller's GIL, thread or lock, so it
cannot slow a weight sync or a forward pass in the producer, and a crash in it cannot take the
producer down. The child skips a step that is not settled, and a merge or view already up to date,
records a merge's failure in `merge.json` (and so in the manifest), and runs at the lowest CPU
priority; what failed is logged here.
It imports only what a merge needs: the CLI's imports took twice the merge's own CPU for a
200-step window of a vLLM replica (0.45 s against 0.2 s), on every step.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MERGE_COMMAND = ("-m", "profiling.analysis.background_merge")
"""How a background merge is run (tools that watch processes tell these short-lived ones apart)."""

log = logging.getLogger(__name__)
_IMPORT_ROOT = Path(__file__).resolve().parents[2]
"""The directory `profiling` is imported from, put on the child's path (Ray workers may run
with another working directory)."""


class AutoMerger:
    """Queues step merges for one save_path; a step already queued is not queued twice."""

    def __init__(self, root: Path):
        self.root = root
        self._queued: set[int] = set()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="trace-merge")

    def request(self, step: int) -> None:
        """Merge `step` soon (returns at once)."""
        with self._lock:
            if step in self._queued:
                return
            self._queued.add(step)
        try:
            self._pool.submit(self._run, step)
        except RuntimeError:  # interpreter shutting down: `python -m profiling merge` can redo it
            log.warning("not merging step %s: the process is exiting", step)

    def _run(self, step: int) -> None:
        with self._lock:
            self._queued.discard(step)  # a request arriving from now on merges again
        cmd = [sys.executable, *MERGE_COMMAND, str(self.root), str(step)]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(_IMPORT_ROOT), os.environ.get("PYTHONPATH")])),
        }
        try:
            proc = subprocess.run(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                check=False,
            )
        except OSError as e:
            log.error(
                "could not start the merge of step %s (%s); run: python -m profiling merge %s --step %s, "
                "and python -m profiling ranks %s --step %s",
                step,
                e,
                self.root,
                step,
                self.root,
                step,
            )
            return
        if proc.returncode != 0:
            log.error(
                "background merge of step %s failed (exit %s): %s", step, proc.returncode, proc.stderr.strip()[-2000:]
            )

