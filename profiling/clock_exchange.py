"""NTP-style clock exchange: another process's wall clock against a reference clock.

The reference reads its clock (`sent_ns`), the other process answers its `time.time_ns()`
(`remote_ns`), and the reference reads its clock again (`received_ns`). The remote reading was
taken somewhere between the two, so the reference's time at that instant is the midpoint of its
readings within half the round trip: `offset = midpoint - remote`, error at most `rtt / 2`. Of
several exchanges the one with the shortest round trip is the tightest (the others waited in a
queue or an event loop on the way). No transport here: the controller (Ray) and the trainer's
client (HTTP) each make their exchanges and hand the readings in.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import NamedTuple

from profiling.manifest import ClockOffset

PINGS = 5
"""Exchanges per measurement: a few, so that one of them meets no queue on the way."""


class ClockReading(NamedTuple):
    """One exchange: the reference's clock before and after, the other process's in between."""

    sent_ns: int
    remote_ns: int
    received_ns: int


def offset_from(readings: Iterable[ClockReading]) -> ClockOffset:
    """The offset (added to the remote clock gives the reference clock) and its bound, from the
    exchange with the shortest round trip. ValueError when there is none, or when the reference's
    clock went backwards within an exchange (it was stepped: the bound would be meaningless)."""
    readings = list(readings)
    if not readings:
        raise ValueError("no clock exchange to measure an offset from")
    if backwards := [r for r in readings if r.received_ns < r.sent_ns]:
        raise ValueError(
            f"the reference clock went backwards during a clock exchange ({backwards[0]}): it was "
            "stepped (NTP or an operator); measure again"
        )
    best = min(readings, key=lambda r: r.received_ns - r.sent_ns)
    rtt = best.received_ns - best.sent_ns
    # Integers throughout: unix nanoseconds as floats would lose ~256 ns. The bound rounds up.
    return ClockOffset(
        offset_ns=(best.sent_ns + best.received_ns) // 2 - best.remote_ns,
        bound_ns=(rtt + 1) // 2 + 1,
        samples=len(readings),
    )


def own_offset() -> ClockOffset:
    """This process's clock against itself, measured as an exchange with a remote clock is: the
    entry of a run with no app as its reference (a GPU check, a benchmark) then carries what a
    real run's would, and `verify`'s clock check applies to it."""
    readings = []
    for _ in range(PINGS):
        sent = time.time_ns()
        remote = time.time_ns()
        readings.append(ClockReading(sent, remote, time.time_ns()))
    return offset_from(readings)


def reversed_offset(offset: ClockOffset) -> ClockOffset:
    """The same measurement from the other side: an exchange that this process made with the
    reference (the remote) gives the reference's clock against this one; this process's clock
    against the reference is its negation, with the same bound."""
    return offset.model_copy(update={"offset_ns": -offset.offset_ns})


def tightest(*offsets: ClockOffset | None) -> ClockOffset | None:
    """Of several measurements of one process's offset, the one with the smallest bound."""
    known = [o for o in offsets if o is not None]
    return min(known, key=lambda o: o.bound_ns) if known else None
