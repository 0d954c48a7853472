"""The control plane's own pieces without Ray: control calls that outlive their callers
(serve_app/control/shielded.py), the controller's hold deadline across a load
(serve_app/control/fleet.py) and a replica's admission of generation (serve_app/admission.py)."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from serve_app.admission import GenerationGate
from serve_app.control.fleet import Fleet
from serve_app.control.shielded import ShieldedCalls
from serve_app.desired_state import DesiredState
from serve_app.errors import Unavailable
from serve_app.limits import RequestLimits


async def test_a_cancelled_caller_does_not_cancel_the_call():
    calls = ShieldedCalls()
    reached: list[str] = []

    async def start() -> str:
        reached.append("published")
        await asyncio.sleep(0.2)
        reached.append("watchdog armed")
        return "started"

    caller = asyncio.ensure_future(calls.run("start", start))
    await asyncio.sleep(0.05)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.sleep(0.3)
    assert reached == ["published", "watchdog armed"], "the cancellation reached the call"


async def test_the_call_runs_outside_the_caller_s_context():
    """Serve finds the handle calls to cancel with a request by a context variable: the call must
    not carry the caller's."""
    request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
    request_id.set("cut-off request")

    async def start() -> str | None:
        return request_id.get()

    assert await ShieldedCalls().run("start", start) is None


async def test_an_error_reaches_the_caller_that_waits():
    async def fail() -> None:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        await ShieldedCalls().run("stop", fail)


class _Record:
    """A FAKE durable record (the real one is Ray's GCS store: tests/integration/test_control_path.py)."""

    def __init__(self) -> None:
        self.saved: list[DesiredState] = []

    async def load(self, resume: bool) -> DesiredState:
        return DesiredState()

    async def save(self, state: DesiredState) -> None:
        self.saved.append(state.model_copy())


async def test_the_controller_s_hold_counts_from_the_end_of_the_load_it_covered():
    fleet = Fleet(None, _Record(), control_timeout_s=1.0, hold_timeout_s=0.3)  # type: ignore[arg-type]  # no broadcast here
    await fleet.load(resume=False)
    await fleet.publish(DesiredState(paused=True))  # the stop's hold

    async def long_update() -> None:
        async with fleet.lock:  # an update holds the lock for its load, past the hold's deadline
            await asyncio.sleep(0.5)
            state = await fleet.desired()
            await fleet.publish(state.model_copy(update={"weight_version": 1, "paused": True}), renew_hold=True)

    await long_update()
    await asyncio.sleep(0.15)
    assert (await fleet.desired()).paused, "an expiry that fell due during the load ended the renewed hold"
    await asyncio.sleep(0.3)
    assert not (await fleet.desired()).paused, "the renewed hold outlived hold_timeout_s"


async def test_without_a_load_the_controller_s_hold_keeps_its_deadline():
    fleet = Fleet(None, _Record(), control_timeout_s=1.0, hold_timeout_s=0.3)  # type: ignore[arg-type]
    await fleet.load(resume=False)
    for _ in range(3):  # repeated stops with pause do not stretch it
        await fleet.publish(DesiredState(paused=True))
        await asyncio.sleep(0.12)
    assert not (await fleet.desired()).paused


async def test_generation_beyond_the_queue_is_refused_with_retry_after():
    gate = GenerationGate(RequestLimits(max_ongoing_requests=2, max_queued_requests=1, queue_timeout_s=5))
    release = asyncio.Event()
    admitted: list[int] = []

    async def generate(i: int) -> None:
        async with gate.admit():
            admitted.append(i)
            await release.wait()

    running = [asyncio.ensure_future(generate(i)) for i in range(3)]  # 2 run, 1 waits
    await asyncio.sleep(0.05)
    assert admitted == [0, 1] and gate.waiting == 1
    with pytest.raises(Unavailable) as refused:
        await generate(3)
    assert refused.value.retry_after_s == 1 and "max_queued_requests" in refused.value.detail
    release.set()
    await asyncio.gather(*running)
    assert admitted == [0, 1, 2], "the waiting call did not get the freed slot"


async def test_a_call_that_waits_past_queue_timeout_s_is_refused():
    gate = GenerationGate(RequestLimits(max_ongoing_requests=1, max_queued_requests=4, queue_timeout_s=0.2))
    async with gate.admit():
        with pytest.raises(Unavailable, match="queue_timeout_s"):
            async with gate.admit():
                pass
    assert gate.waiting == 0
    async with gate.admit():  # the slot is free again
        pass
