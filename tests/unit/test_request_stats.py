"""The replica's request accounting (serve_app/engines/request_stats.py) on a fake clock: states
partition the window, counts cover the window only, the long tail stays bounded; and the trainer's
staleness record (Staleness.plus, ProfiledWeightSync.consumed)."""

from __future__ import annotations

import pytest

from profiling.schedule import StepSchedule
from profiling.step_stats import Staleness
from serve_app.engines.request_stats import RequestAccounting


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_states_partition_the_window_and_only_the_window_counts():
    clock = Clock()
    acc = RequestAccounting(slowest=2, clock=clock)
    before = acc.entered()  # in flight before the window opens
    clock.t += 5
    acc.open()
    clock.t += 1  # generating: `before` in flight
    acc.finished(before, prompt_tokens=3, output_tokens=4, versions=[0])
    clock.t += 2  # idle
    acc.paused(True)
    a = acc.entered()
    clock.t += 3  # held, with a request waiting
    acc.paused(False)
    clock.t += 0.5  # generating
    acc.finished(a, prompt_tokens=5, output_tokens=7, versions=[0, 1])
    b = acc.entered()
    clock.t += 0.25
    acc.finished(b, prompt_tokens=1, output_tokens=None)  # failed
    c = acc.entered()
    clock.t += 0.1
    acc.finished(c, prompt_tokens=2, output_tokens=2, versions=[1])
    stats = acc.close()
    assert stats is not None
    assert (stats.generating_s, stats.held_s, stats.idle_s) == pytest.approx((1.85, 3.0, 2.0))
    assert stats.window_s == pytest.approx(stats.generating_s + stats.held_s + stats.idle_s)
    assert (stats.requests, stats.failed) == (3, 1)
    assert (stats.prompt_tokens, stats.output_tokens) == (10, 13)
    assert stats.weight_versions == {0: 2, 1: 2}
    # the long tail: the two slowest, slowest first (`before` counts from when it entered)
    assert [s.latency_s for s in stats.slowest] == pytest.approx([6.0, 3.5])
    assert stats.slowest[1].weight_versions == [0, 1]
    # after the window nothing counts, and a new window starts from zero
    d = acc.entered()
    clock.t += 1
    acc.finished(d, prompt_tokens=1, output_tokens=1)
    assert acc.close() is None
    acc.open()
    clock.t += 1
    again = acc.close()
    assert again is not None and again.requests == 0 and again.idle_s == pytest.approx(1.0)


def test_the_slowest_list_stays_bounded():
    clock = Clock()
    acc = RequestAccounting(slowest=3, clock=clock)
    acc.open()
    for i in range(50):
        t = acc.entered()
        clock.t += (i * 7) % 11  # latencies in a scrambled order
        acc.finished(t, prompt_tokens=1, output_tokens=1)
    stats = acc.close()
    assert stats is not None and stats.requests == 50
    assert [s.latency_s for s in stats.slowest] == [10.0, 10.0, 10.0]


def test_staleness_accumulates_a_histogram():
    s = Staleness().plus([0, 1, 1, 2], dropped=1).plus([0], dropped=2)
    assert s.histogram == {0: 2, 1: 2, 2: 1} and s.samples == 5
    assert (s.max, s.mean, s.dropped) == (2, pytest.approx(0.8), 3)


class FakeSession:
    def __init__(self) -> None:
        self.notes: dict[int, dict] = {}

    def annotate(self, step: int, **fields: object) -> None:
        self.notes.setdefault(step, {}).update(fields)


@pytest.mark.parametrize("continuous", [False, True])
def test_the_trainer_records_staleness_in_the_profiled_window(continuous):
    from trainer.profiled_sync import ProfiledWeightSync, RankRole

    sync = ProfiledWeightSync(
        StepSchedule([1, 2, 5], continuous=continuous), client=None, save_path=None, role=RankRole(drives=False)
    )
    session = FakeSession()
    sync._session = session  # type: ignore[assignment]
    for version, lags in ((1, [0, 0]), (2, [1, 0]), (3, [2]), (4, [1]), (5, [1, 1])):
        sync.consumed(version, lags, dropped=1)
    notes = {k: v["staleness"] for k, v in session.notes.items()}
    if continuous:  # window {1, 2}: both steps' samples; step 3 and 4 are not profiled
        assert set(notes) == {1, 5}
        assert notes[1].histogram == {0: 3, 1: 1} and notes[1].dropped == 2
    else:
        assert set(notes) == {1, 2, 5}
        assert notes[2].histogram == {0: 1, 1: 1} and notes[2].dropped == 1
    assert notes[5].histogram == {1: 2} and notes[5].max == 1
