"""Reading the Chrome traces the tests check: gzip-compressed JSON (one gzip member or several,
as the merge writes them). Which events are forward steps is the tests' own business (their
markers' names); this only opens the files."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any


def read_trace(path: Path) -> dict[str, Any]:
    """The whole document of a gzip Chrome trace (`traceEvents`, metadata keys)."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        trace: dict[str, Any] = json.load(f)
    return trace


def trace_events(path: Path) -> list[dict[str, Any]]:
    """The `traceEvents` of a gzip Chrome trace (a trace without them is an error)."""
    events: list[dict[str, Any]] = read_trace(path)["traceEvents"]
    return events
