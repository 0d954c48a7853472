"""Counting an engine's forward passes in its Chrome trace, by the name prefix of the range
around one pass (an entry's `TraceDialect.forward_range`): for a profiler that cannot count them
while it records."""

from __future__ import annotations

import gzip
from pathlib import Path

_NAME = '"name": "'


def count_engine_steps(trace: Path, prefix: str) -> int:
    """User-annotation ranges whose name starts with `prefix` in one Chrome trace file (plain or
    gzipped). Read line by line, since traces can be large: Kineto writes one field per line,
    `"cat"` before `"name"`."""
    opener = gzip.open if trace.name.endswith(".gz") else open
    count, annotation = 0, False
    with opener(trace, "rt") as f:
        for line in f:
            if '"cat":' in line:
                annotation = '"user_annotation"' in line
            elif annotation and (i := line.find(_NAME)) >= 0 and line.startswith(prefix, i + len(_NAME)):
                count += 1
    return count
