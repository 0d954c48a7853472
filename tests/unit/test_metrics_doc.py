"""docs/operations.md's metrics table names every metric serve_app/metrics.py defines."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

from serve_app import metrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def exposed_names() -> set[str]:
    """The name each metric of serve_app/metrics.py is scraped under (counters end in _total)."""
    names = set()
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            for family in value.describe():
                names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def test_every_metric_is_documented():
    names = exposed_names()
    assert len(names) >= 11, names  # the module's metrics were found at all
    table = set(re.findall(r"^\| `(rollout_profiler_\w+)` \|", DOC.read_text(), flags=re.MULTILINE))
    assert names - table == set(), f"metrics missing from {DOC.name}'s metrics table"
    assert table - names == set(), f"{DOC.name} documents metrics serve_app/metrics.py does not define"
