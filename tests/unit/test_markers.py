"""The one forward-step and weight-update marker contract (profiling/markers.py), and the trace
dialect an entry carries (profiling/manifest.py, `TraceDialect`)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from profiling.manifest import ManifestEntry, TraceDialect
from profiling.markers import (
    FORWARD_STEP,
    ForwardStepMarker,
    format_forward_step,
    format_weight_update,
    parse_forward_step,
    parse_weight_update,
)


@pytest.mark.parametrize(("index", "step", "version"), [(0, 1, 0), (12, 7, 6), (3, 2, -1)])
def test_a_forward_step_marker_round_trips(index, step, version):
    name = format_forward_step(index, step, version)
    assert name.startswith(FORWARD_STEP)
    assert parse_forward_step(name) == ForwardStepMarker(index=index, step=step, weight_version=version)


@pytest.mark.parametrize(
    "name",
    [
        "aten::mm",
        "weight_update version=1",
        "forward_step#1",  # the prefix alone: no step, no version
        "forward_step#1 step=2",
        "forward_step#1 step=2 weight_version=3 and more",
        "execute_context_1(4)_generation_0(0)",
        "",
    ],
)
def test_a_name_that_is_no_forward_step_marker_parses_to_none(name):
    assert parse_forward_step(name) is None


def test_a_weight_update_marker_round_trips():
    assert parse_weight_update(format_weight_update(4)) == 4
    assert parse_weight_update(format_forward_step(0, 1, 0)) is None
    assert parse_weight_update("weight_update") is None


def test_an_entry_written_before_the_dialect_reads_as_this_projects_markers():
    entry = ManifestEntry.model_validate_json('{"role": "rollout", "replica_id": "r0", "forward_steps": 3}')
    assert entry.trace_dialect == TraceDialect()
    assert (entry.trace_dialect.forward_range, entry.trace_dialect.version_in) == (FORWARD_STEP, "marker")
    again = ManifestEntry.model_validate_json(entry.model_dump_json())
    assert again.trace_dialect == entry.trace_dialect


def test_a_dialect_with_the_version_in_the_file_name_reads_it_and_the_recording():
    d = TraceDialect(forward_range="iter[", version_in="file_name", file_version=r"-v(\d+)-", rank_separator=".rank")
    assert d.file_version_of("step3-v2-x.rank0.json.gz") == 2
    assert d.file_version_of("step3-v2-then-v10-x.rank0.json") == 10  # the last match counts
    assert d.file_version_of("step3.rank0.json") is None
    assert d.recording_of("step3-v2-x.rank1.json") == d.recording_of("step3-v2-x.rank0.json") == "step3-v2-x"
    assert TraceDialect().file_version_of("step3-v2-x.rank0.json") is None
    assert TraceDialect().recording_of("a.json") == "a.json"


@pytest.mark.parametrize(
    "fields",
    [
        {"forward_range": "iter["},  # a marker dialect's ranges are this project's markers
        {"forward_range": "iter[", "version_in": "file_name"},  # where in the name?
        {"forward_range": "iter[", "version_in": "file_name", "file_version": r"-v\d+-"},  # no group
    ],
)
def test_an_inconsistent_dialect_is_refused(fields):
    with pytest.raises(ValidationError):
        TraceDialect(**fields)
