"""What the profile and weight controls share: the replicas reached by broadcast, the app's
desired state, and the one lock that serialises control calls (so stop -> update -> start
sequences never interleave).

Control calls reach every replica through `DeploymentHandle.broadcast`, never the load
balancer (docs/design.md#fan-out). Each replica answers with a ReplicaReport naming itself; a
replica that raised, died, or did not answer within the timeout becomes an `ok: false` report
instead of failing the whole call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from serve_app.api import UNKNOWN_REPLICA, Outcome, ReplicaReport
from serve_app.desired_state import DesiredState, DesiredStateRecord
from serve_app.metrics import CONTROL_ERRORS

if TYPE_CHECKING:
    from ray.serve._private.replica_result import ReplicaResult  # private too: for the annotation only

log = logging.getLogger(__name__)


async def broadcast(
    handle: DeploymentHandle,
    method: str,
    *args: Any,
    timeout_s: float,
    expected: set[str] | None = None,
    probe: str = "status",
    **kwargs: Any,
) -> list[ReplicaReport]:
    """Call `method` on every live replica concurrently; one report per replica.

    `expected` names replicas that should answer; each one that does not gets its own
    `ok: false` report (it died or timed out), so failures are never anonymous when known.
    `probe` names a cheap replica method used to wait for the first replica.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            results = await replica_results(
                handle, method, *args, timeout_s=max(0.0, deadline - time.monotonic()), **kwargs
            )
            break
        except TimeoutError:
            results = []
            break
        except DeploymentUnavailableError as e:
            # broadcast() only sees replicas the handle's router already knows, and a fresh
            # router knows none (nor does one whose replicas are all still starting); a routed
            # call waits until one is running. Wait that way, within the timeout.
            try:
                await asyncio.wait_for(getattr(handle, probe).remote(), max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - still none: report it per replica below
                return _missing(expected, f"no replica reachable: {e}")
    tasks = [asyncio.ensure_future(rr.get_async()) for rr in results]
    if tasks:
        await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
    reports: list[ReplicaReport] = []
    anonymous: list[str] = []
    for task in tasks:
        if not task.done():
            task.cancel()
            anonymous.append(f"no answer within {timeout_s:.1f}s")
        elif (error := task.exception()) is not None:
            anonymous.append(f"{type(error).__name__}: {error}")
        else:
            reports.append(ReplicaReport.model_validate(task.result()))
    answered = {r.replica_id for r in reports}
    missing = sorted((expected or set()) - answered)
    for i, rid in enumerate(missing):
        why = anonymous[i] if i < len(anonymous) else "replica died or was removed"
        reports.append(ReplicaReport(replica_id=rid, ok=False, error=why))
    for why in anonymous[len(missing) :]:
        reports.append(ReplicaReport(replica_id=UNKNOWN_REPLICA, ok=False, error=why))
    return reports


async def replica_results(
    handle: DeploymentHandle, method: str, *args: Any, timeout_s: float, **kwargs: Any
) -> list[ReplicaResult]:
    """Call `method` on every replica the handle's router knows; one pending result per replica,
    each awaited on its own (`get_async()`), so one slow or dead replica costs only its own answer.
    TimeoutError: the call did not reach the replicas within `timeout_s`; DeploymentUnavailableError:
    the router knows no replica yet.

    The only door to Ray's private `DeploymentBroadcastResponse._fetch_replica_results_async`
    (written against Ray 2.60.0): its public `results_async()` fails or times out the whole call
    on one replica's error or silence. `broadcast` above and the clock exchange
    (control/clock_exchange.py, which reads its clock as each answer lands) come through here; a
    Ray upgrade that moves it is fixed here alone."""
    response = handle.broadcast(method, *args, **kwargs)
    return await asyncio.wait_for(response._fetch_replica_results_async(), timeout_s)


def _missing(expected: set[str] | None, why: str) -> list[ReplicaReport]:
    if not expected:
        return [ReplicaReport(replica_id=UNKNOWN_REPLICA, ok=False, error=why)]
    return [ReplicaReport(replica_id=rid, ok=False, error=why) for rid in sorted(expected)]


class Fleet:
    """The rollout replicas as the control plane sees them. One per controller."""

    def __init__(
        self,
        replicas: DeploymentHandle,
        record: DesiredStateRecord,
        *,
        control_timeout_s: float,
        hold_timeout_s: float,
    ):
        self.replicas = replicas
        self.lock = asyncio.Lock()
        """Held for the whole of each start, stop and weight update."""
        self._record = record
        self._timeout_s = control_timeout_s
        self._hold_timeout_s = hold_timeout_s
        self._hold_timer: asyncio.TimerHandle | None = None
        self._hold_armed = 0
        """Counts hold deadlines armed: an expiry that waited for the lock while a later one was
        armed (a load renewed the hold) is stale."""
        self._state = DesiredState()
        self._known: set[str] = set()
        self.weights_refs: list[Any] = []
        """The object-store ref of the served weights, for replicas that join (in memory only: a
        controller that restarts has none, and joiners copy from a peer replica instead)."""
        self.changes = 0
        """Counts publications of the desired state: a status read before the last one is stale."""
        self.before_hold_expires: Callable[[], Awaitable[None]] | None = None
        """Called under the lock when the hold's deadline ends it, before generation resumes
        (an engine mid-update must close it first: control/engine_transfer.py)."""

    async def load(self, resume: bool) -> DesiredState:
        """Read the desired state from its durable record, once, before any call is served."""
        self._state = await self._record.load(resume)
        return self._state

    async def desired(self) -> DesiredState:
        """The desired state; this controller is its only writer, so it is kept in memory."""
        return self._state

    async def publish(self, state: DesiredState, *, renew_hold: bool = False) -> None:
        """Make `state` the desired state (replicas that start read it) and record it.
        `renew_hold`: a weight load just ended, and a hold that goes on counts from now."""
        if state.active is not None and state.active_since is None:
            # A step (re)starting: its start time travels with it, for a controller that
            # restarts mid-step.
            state.active_since = time.time()
        elif state.active is None:
            state.active_since = None
        self._state = state
        self.changes += 1
        self._track_hold(state.paused, renew_hold)
        await self._record.save(state)

    def _track_hold(self, paused: bool, renew: bool) -> None:
        """The replicas' admission hold ends hold_timeout_s after it began, or after the load it
        covers ended, however often it is asked for again; so does the desired state's, or a
        replica that restarts later would hold again."""
        if self._hold_timer is not None and (not paused or renew):
            self._hold_timer.cancel()
            self._hold_timer = None
        if paused and self._hold_timer is None:
            self._hold_armed += 1
            armed = self._hold_armed
            self._hold_timer = asyncio.get_running_loop().call_later(
                self._hold_timeout_s, lambda: asyncio.ensure_future(self._hold_expired(armed))
            )

    async def _hold_expired(self, armed: int) -> None:
        async with self.lock:
            if armed != self._hold_armed:
                return  # renewed by a load while this expiry waited for the lock
            self._hold_timer = None
            state = await self.desired()
            if state.paused:
                log.warning("admission hold expired without a weight update or start; the app no longer holds")
                if self.before_hold_expires is not None:
                    try:
                        await self.before_hold_expires()
                    except Exception:  # the hold ends anyway: it is what bounds a stalled caller
                        log.exception("closing what the hold covered failed")
                await self.publish(state.model_copy(update={"paused": False}))

    async def broadcast(self, method: str, *args: Any, timeout_s: float | None = None) -> list[ReplicaReport]:
        """`method` on every replica; a replica that answered before and is silent now is
        reported by name."""
        timeout_s = timeout_s or self._timeout_s
        reports = await broadcast(self.replicas, method, *args, timeout_s=timeout_s, expected=self._known)
        self._known = {r.replica_id for r in reports if r.outcome in (Outcome.OK, Outcome.CONFLICT)}
        if failed := sum(not r.ok for r in reports):
            CONTROL_ERRORS.labels(method).inc(failed)
        return reports
