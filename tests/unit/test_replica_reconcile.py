"""RolloutReplica._reconcile without Ray: a replica that a start or stop missed (it was still
starting, so not routable) converges on the desired state at its second health check in a row,
never on the first (a control call may be in flight), and joins a step late at most once."""

from __future__ import annotations

from types import SimpleNamespace

from profiling.config import ProfileOptions
from profiling.session import SessionSpec
from serve_app.desired_state import DesiredState
from serve_app.replica import RolloutReplica


class FakeEngine:
    def __init__(self) -> None:
        self.active: int | None = None
        self.calls: list[tuple] = []

    def status(self):
        return SimpleNamespace(active_step=self.active)

    async def stop_profile(self, step, pause):
        self.calls.append(("stop", step, pause))
        self.active = None

    async def start_profile(self, spec):
        self.calls.append(("start", spec.step, spec.late_start))
        self.active = spec.step


class FakeDesired:
    def __init__(self) -> None:
        self.state = DesiredState()

    async def get(self) -> DesiredState:
        return self.state


class Replica(RolloutReplica):
    def __del__(self) -> None:  # no engine to shut down
        pass


def replica() -> RolloutReplica:
    r = object.__new__(Replica)
    r.engine, r._desired, r._mismatch, r._joined_late = FakeEngine(), FakeDesired(), None, set()
    return r


def spec(k: int) -> SessionSpec:
    return SessionSpec(step=k, steps=[k], options=ProfileOptions())


async def test_a_recording_the_app_stopped_is_stopped_at_the_second_check():
    r = replica()
    r.engine.active = 4  # joined step 4 late, just as the app stopped it
    await r._reconcile()
    assert r.engine.calls == [], "the first sighting may be a stop in flight"
    await r._reconcile()
    assert r.engine.calls == [("stop", 4, False)]


async def test_a_step_the_replica_missed_is_joined_late_once():
    r = replica()
    r._desired.state = DesiredState(active=spec(7))
    await r._reconcile()
    await r._reconcile()
    assert r.engine.calls == [("start", 7, True)]
    r.engine.active = None  # its start failed, say: not retried every 2 s
    await r._reconcile()
    await r._reconcile()
    assert r.engine.calls == [("start", 7, True)]


async def test_agreement_or_a_passing_difference_does_nothing():
    r = replica()
    r._desired.state = DesiredState(active=spec(2))
    r.engine.active = 2
    await r._reconcile()
    r._desired.state = DesiredState()  # a stop is published...
    await r._reconcile()
    r.engine.active = None  # ...and lands before the next check
    await r._reconcile()
    await r._reconcile()
    assert r.engine.calls == []
