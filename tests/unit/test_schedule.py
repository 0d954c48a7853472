"""StepSchedule: the step semantics of docs/design.md#step-semantics (windows, begin, per-sync plans)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from profiling.config import GlobalProfilerConfig
from profiling.schedule import StepSchedule, SyncPlan


def plan(schedule: StepSchedule, k: int) -> tuple[int | None, int | None, bool]:
    p = schedule.sync(k)
    assert p.version == k
    return p.stop_step, p.start_step, p.update_inside_window


# -- windows -------------------------------------------------------------------------------


def test_discrete_windows_one_per_step():
    assert StepSchedule([1, 2, 5]).windows == [(1,), (2,), (5,)]


def test_continuous_windows_merge_consecutive_steps():
    assert StepSchedule([1, 2, 5], continuous=True).windows == [(1, 2), (5,)]


def test_windows_sorted_and_deduplicated():
    assert StepSchedule([5, 2, 1, 2]).windows == [(1,), (2,), (5,)]
    assert StepSchedule([5, 3, 4, 4, 9], continuous=True).windows == [(3, 4, 5), (9,)]


def test_window_label_and_steps():
    s = StepSchedule([1, 2, 5], continuous=True)
    assert [s.window_label(k) for k in range(1, 7)] == [1, 1, None, None, 5, None]
    assert s.window_steps(1) == (1, 2)
    assert s.window_steps(5) == (5,)
    with pytest.raises(KeyError):
        s.window_steps(2)  # 2 is inside window 1, not a label


# -- begin ---------------------------------------------------------------------------------


@pytest.mark.parametrize("continuous", [False, True])
def test_begin_starts_step_1_when_profiled(continuous):
    assert StepSchedule([1, 2, 5], continuous).begin() == 1


@pytest.mark.parametrize("continuous", [False, True])
def test_begin_is_none_when_step_1_not_profiled(continuous):
    assert StepSchedule([2, 5], continuous).begin() is None


# -- sync plans ----------------------------------------------------------------------------


def test_sync_plans_discrete():
    s = StepSchedule([1, 2, 5])
    assert plan(s, 1) == (1, 2, False)  # stop 1, update, start 2
    assert plan(s, 2) == (2, None, False)  # stop 2, nothing next
    assert plan(s, 3) == (None, None, False)
    assert plan(s, 4) == (None, 5, False)  # start 5 after publishing version 4
    assert plan(s, 5) == (5, None, False)
    assert plan(s, 6) == (None, None, False)


def test_sync_plans_continuous():
    s = StepSchedule([1, 2, 5], continuous=True)
    assert plan(s, 1) == (None, None, True)  # update inside window {1,2}: marked, not stopped
    assert plan(s, 2) == (1, None, False)  # stop names the window label, not 2
    assert plan(s, 3) == (None, None, False)
    assert plan(s, 4) == (None, 5, False)
    assert plan(s, 5) == (5, None, False)
    assert plan(s, 6) == (None, None, False)


@pytest.mark.parametrize("continuous", [False, True])
def test_unprofiled_sync_costs_zero_control_calls(continuous):
    s = StepSchedule([1, 2, 5], continuous)
    assert s.sync(3).control_calls == 0
    assert s.sync(6).control_calls == 0
    assert s.sync(100).control_calls == 0


def test_control_calls_counts_stop_and_start():
    assert SyncPlan(version=1, stop_step=1, start_step=2).control_calls == 2
    assert SyncPlan(version=1, stop_step=1).control_calls == 1
    assert SyncPlan(version=1, update_inside_window=True).control_calls == 0
    assert StepSchedule([1, 2], continuous=True).sync(1).control_calls == 0


@pytest.mark.parametrize("continuous", [False, True])
def test_no_steps_profiles_nothing(continuous):
    for s in (StepSchedule(None, continuous), StepSchedule([], continuous)):
        assert s.windows == []
        assert s.begin() is None
        assert all(s.sync(k).control_calls == 0 for k in range(1, 10))
        assert not s.sync(1).update_inside_window


def test_from_config_tool_none_profiles_nothing():
    assert GlobalProfilerConfig().tool is None, "verl's default: profiling off unless a tool is named"
    cfg = GlobalProfilerConfig(tool=None, steps=[1, 2, 5])
    s = StepSchedule.from_config(cfg)
    assert s.windows == [] and s.begin() is None
    assert all(s.sync(k).control_calls == 0 for k in range(1, 10))


def test_from_config_steps_none_profiles_nothing():
    s = StepSchedule.from_config(GlobalProfilerConfig(steps=None))
    assert s.windows == [] and s.begin() is None


def test_from_config_carries_steps_and_continuity():
    cfg = GlobalProfilerConfig(tool="torch", steps=[5, 1, 2], profile_continuous_steps=True)
    assert StepSchedule.from_config(cfg).windows == [(1, 2), (5,)]


# -- property: a full walk is well-formed --------------------------------------------------


def walk(schedule: StepSchedule, n: int) -> list[tuple[str, int]]:
    """The control calls a trainer makes over versions 1..n, in order, finally-stop included."""
    events: list[tuple[str, int]] = []
    active: int | None = None
    first = schedule.begin()
    if first is not None:
        events.append(("start", first))
        active = first
    for k in range(1, n + 1):
        p = schedule.sync(k)
        if p.update_inside_window:
            assert p.stop_step is None and p.start_step is None
            assert active == schedule.window_label(k), f"update inside a window that is not active at {k}"
        if p.stop_step is not None:
            events.append(("stop", p.stop_step))
            active = None
        if p.start_step is not None:
            events.append(("start", p.start_step))
            active = p.start_step
    return events


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(st.integers(min_value=1, max_value=30), max_size=12),
    continuous=st.booleans(),
    extra=st.integers(min_value=0, max_value=5),
)
def test_walk_is_well_formed(steps, continuous, extra):
    s = StepSchedule(steps, continuous)
    n = max(steps, default=0) + extra
    events = walk(s, n)

    active: int | None = None
    started: list[int] = []
    stopped: list[int] = []
    for kind, label in events:
        if kind == "start":
            assert active is None, f"start {label} while {active} is active: {events}"
            active = label
            started.append(label)
        else:
            assert active == label, f"stop {label} but active is {active}: {events}"
            active = None
            stopped.append(label)
    labels = [w[0] for w in s.windows]
    # every window started exactly once and stopped exactly once, in order
    assert started == labels
    assert stopped == labels
    assert active is None
    # every profiled window's start happens at the sync publishing version label-1 (or begin)
    for label in labels:
        if label == 1:
            assert s.begin() == 1
        else:
            assert s.sync(label - 1).start_step == label
        assert s.sync(s.window_steps(label)[-1]).stop_step == label


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.integers(min_value=1, max_value=30), max_size=12), continuous=st.booleans())
def test_unprofiled_steps_cost_nothing(steps, continuous):
    s = StepSchedule(steps, continuous)
    for k in range(1, 35):
        if not s.is_profiled(k) and not s.is_profiled(k + 1):
            assert s.sync(k).control_calls == 0


# -- a server's plan: versions as it sees them published ------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(st.integers(min_value=1, max_value=30), max_size=12),
    continuous=st.booleans(),
    extra=st.integers(min_value=0, max_value=5),
)
def test_on_publish_equals_the_trainer_plan_for_consecutive_versions(steps, continuous, extra):
    s = StepSchedule(steps, continuous)
    active = s.window_steps(1) if s.begin() == 1 else None
    for k in range(1, max(steps, default=0) + extra + 1):
        server = s.on_publish(k, list(active) if active else None)
        assert server == s.sync(k), k
        if server.stop_step is not None:
            active = None
        if server.start_step is not None:
            active = s.window_steps(server.start_step)


def test_on_publish_when_versions_skip():
    s = StepSchedule([1, 2, 5])
    # Step 2's window is recording and version 4 comes next: it stops, and step 5 starts.
    assert s.on_publish(4, [2]) == SyncPlan(version=4, stop_step=2, start_step=5)
    # Past every window: nothing is recording and nothing starts.
    assert s.on_publish(9, None) == SyncPlan(version=9)
    # A continuous window {1, 2} holds versions up to 2 inside it; 3 jumps past it and stops it.
    c = StepSchedule([1, 2, 5], continuous=True)
    assert c.on_publish(1, [1, 2]) == SyncPlan(version=1, update_inside_window=True)
    assert c.on_publish(3, [1, 2]) == SyncPlan(version=3, stop_step=1)
    # Step 5's window starts when version 4 is published; a publication past it starts nothing.
    assert c.on_publish(5, None) == SyncPlan(version=5)
