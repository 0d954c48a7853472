"""How much of a window a trace holds, in the entry's own words (ManifestEntry.kept), and the
rule that a window ran at least the forward steps its trace holds."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from profiling.manifest import ManifestEntry


def entry(**fields: object) -> ManifestEntry:
    return ManifestEntry.model_validate({"role": "rollout", "replica_id": "r0", **fields})


def test_a_capped_window_says_how_many_of_its_steps_it_kept_and_which_setting_to_raise():
    e = entry(forward_steps=200, forward_steps_in_window=3412, auto_stopped="max_forward_steps")
    assert e.kept == (
        "kept 200 of 3,412 forward steps: max_forward_steps stopped the recording; "
        "raise max_forward_steps (null: no limit) to keep them all"
    )


def test_a_cut_trace_counts_the_steps_left_in_it_against_all_the_window_ran():
    e = entry(
        forward_steps=200,
        forward_steps_in_window=900,
        auto_stopped="max_forward_steps",
        truncated=True,
        forward_steps_kept=120,
    )
    assert e.kept == (
        "kept 120 of 900 forward steps: max_forward_steps stopped the recording and the trace was cut to "
        "max_trace_mb; raise max_forward_steps or max_trace_mb (null: no limit) to keep them all"
    )
    cut = entry(forward_steps=50, forward_steps_in_window=50, truncated=True, forward_steps_kept=10)
    assert cut.kept is not None and cut.kept.startswith("kept 10 of 50 forward steps: the trace was cut")


def test_a_window_that_kept_everything_says_nothing():
    assert entry(forward_steps=12, forward_steps_in_window=12).kept is None
    # capped by time, and nothing ran after the cap: the trace holds the whole window
    assert entry(forward_steps=12, forward_steps_in_window=12, auto_stopped="max_duration_s").kept is None
    assert entry(forward_steps=12).kept is None


def test_an_uncounted_window_after_a_cap_says_so_rather_than_claiming_all():
    e = entry(forward_steps=64, auto_stopped="max_forward_steps")
    assert e.kept == (
        "kept 64 forward steps: max_forward_steps stopped the recording; the steps run after it are not counted"
    )


def test_the_note_is_in_the_entry_as_written_and_ignored_when_read_back():
    e = entry(forward_steps=2, forward_steps_in_window=5, auto_stopped="max_forward_steps")
    data = e.model_dump(mode="json")
    assert data["kept"].startswith("kept 2 of 5")
    assert ManifestEntry.model_validate(data) == e


def test_a_window_that_ran_fewer_steps_than_its_trace_holds_is_refused():
    with pytest.raises(ValidationError, match="forward_steps_in_window 3 is below the 5 forward steps recorded"):
        entry(forward_steps=5, forward_steps_in_window=3)
