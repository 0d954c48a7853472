"""The controller's clock exchange with every replica (docs/analysis.md#how-clocks-are-aligned).

The controller's wall clock is the app's reference clock. A replica on another node, or one whose
clock is skewed, has another wall clock, and its trace's own clock markers cannot see that; so
the controller asks every replica for its `time.time_ns()` a few times (`RolloutReplica.
wall_clock`, by broadcast), bracketing each ask with its own readings, and keeps the tightest
exchange per replica (`profiling.clock_exchange`). Best effort and off every answer's path: a
replica that does not answer just has no offset recorded.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ray.serve.handle import DeploymentHandle

from profiling.clock_exchange import PINGS, ClockReading, offset_from
from profiling.manifest import ClockOffset
from serve_app.control.fleet import replica_results

log = logging.getLogger(__name__)


async def measure_replicas(handle: DeploymentHandle, *, timeout_s: float, pings: int = PINGS) -> dict[str, ClockOffset]:
    """replica_id -> its wall clock against this process's, for every replica that answered."""
    readings: dict[str, list[ClockReading]] = {}
    for _ in range(pings):
        sent = time.time_ns()
        try:
            # Per-replica results, as the fleet's broadcast reads them: one slow replica must
            # not void the others' exchanges. Not broadcast() itself: it waits for every answer,
            # and each reading is taken as its own answer lands.
            results = await replica_results(handle, "wall_clock", timeout_s=timeout_s)
        except Exception as e:  # noqa: BLE001 - best effort: no replica reachable this round
            log.info("clock exchange: no replica reachable (%s)", e)
            continue
        tasks = [asyncio.ensure_future(rr.get_async()) for rr in results]
        try:
            for done in asyncio.as_completed(tasks, timeout=timeout_s):
                try:
                    replica_id, remote = await done
                except Exception as e:  # noqa: BLE001 - that replica has fewer exchanges
                    log.info("clock exchange: a replica did not answer (%s)", e)
                    continue
                # Read as soon as this answer is in: a later reading only widens the bound.
                readings.setdefault(replica_id, []).append(ClockReading(sent, remote, time.time_ns()))
        except TimeoutError:
            for task in tasks:
                task.cancel()
    offsets = {}
    for rid, found in readings.items():
        try:
            offsets[rid] = offset_from(found)
        except ValueError as e:  # this controller's clock was stepped meanwhile
            log.warning("clock exchange with replica %s not recorded: %s", rid, e)
    return offsets
