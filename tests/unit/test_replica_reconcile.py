"""A replica's Reconciler without Ray: a replica that a start, stop or client pause missed (it
was still starting, so not routable) converges on the desired state at its second health check
in a row, never on the first (a control call may be in flight), joins a step late at most once,
and drops a client pause whose bound has passed."""

from __future__ import annotations

import time

from profiling.session import StopOutcome
from serve_app.desired_state import ClientPause, DesiredState
from serve_app.reconcile import Reconciler


class FakeEngine:
    def __init__(self) -> None:
        self.active: int | None = None
        self.calls: list[tuple] = []

    @property
    def active_step(self) -> int | None:
        return self.active

    async def stop_profile(self, step, pause) -> StopOutcome:
        self.calls.append(("stop", step, pause))
        self.active = None
        return StopOutcome(step=step, stopped=True)

    async def start_profile(self, spec) -> bool:
        self.calls.append(("start", spec.step, spec.late_start))
        self.active = spec.step
        return True


class FakeDesired:
    def __init__(self) -> None:
        self.state = DesiredState()

    async def get(self) -> DesiredState:
        return self.state


class FakePauses:
    def __init__(self) -> None:
        self.client_pause_mode: str | None = None
        self.calls: list[tuple] = []

    async def client_pause(self, mode, for_s, drain=True):
        self.calls.append(("pause", mode, round(for_s), drain))
        self.client_pause_mode = mode

    async def client_resume(self):
        self.calls.append(("resume",))
        self.client_pause_mode = None


class Replica:
    """What the tests drive: the engine, the desired state, and the replica's reconciler."""

    def __init__(self) -> None:
        self.engine, self.desired, self.pauses = FakeEngine(), FakeDesired(), FakePauses()
        self.reconciler = Reconciler(self.engine, self.desired, self.pauses)  # type: ignore[arg-type]


async def test_a_recording_the_app_stopped_is_stopped_at_the_second_check():
    r = Replica()
    r.engine.active = 4  # joined step 4 late, just as the app stopped it
    await r.reconciler.check()
    assert r.engine.calls == [], "the first sighting may be a stop in flight"
    await r.reconciler.check()
    assert r.engine.calls == [("stop", 4, False)]


async def test_a_step_the_replica_missed_is_joined_late_once(spec):
    r = Replica()
    r.desired.state = DesiredState(active=spec(7))
    await r.reconciler.check()
    await r.reconciler.check()
    assert r.engine.calls == [("start", 7, True)]
    r.engine.active = None  # its start failed, say: not retried every 2 s
    await r.reconciler.check()
    await r.reconciler.check()
    assert r.engine.calls == [("start", 7, True)]


async def test_agreement_or_a_passing_difference_does_nothing(spec):
    r = Replica()
    r.desired.state = DesiredState(active=spec(2))
    r.engine.active = 2
    await r.reconciler.check()
    r.desired.state = DesiredState()  # a stop is published...
    await r.reconciler.check()
    r.engine.active = None  # ...and lands before the next check
    await r.reconciler.check()
    await r.reconciler.check()
    assert r.engine.calls == []


async def test_a_client_pause_the_replica_missed_is_applied_for_the_time_left_without_draining():
    r = Replica()
    r.desired.state = DesiredState(client_pause=ClientPause(mode="wait", until=time.time() + 100))
    await r.reconciler.check()
    assert r.pauses.calls == [], "the first sighting may be a pause in flight"
    await r.reconciler.check()
    assert r.pauses.calls == [("pause", "wait", 100, False)], "a health check never waits for requests to end"
    await r.reconciler.check()
    await r.reconciler.check()
    assert len(r.pauses.calls) == 1, "converged: nothing more"


async def test_a_pause_the_app_lifted_or_whose_bound_passed_is_resumed():
    r = Replica()
    r.pauses.client_pause_mode = "keep"
    r.desired.state = DesiredState(client_pause=ClientPause(mode="keep", until=time.time() - 1))
    await r.reconciler.check()
    await r.reconciler.check()
    assert r.pauses.calls == [("resume",)]
