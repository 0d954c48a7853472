"""Mapping one trace file's timestamps to wall-clock time.

Chrome-trace `ts` values are microseconds after `baseTimeNanoseconds` (Kineto floors wall time to
a ~3-month interval and subtracts it to keep `ts` small). Kineto's CPU timestamps come from
torch's approximate (TSC) clock converted to unix time, so `ts + baseTimeNanoseconds` is close to,
but not guaranteed to be, `time.time_ns()`. The session records clock markers (`ClockSample`):
a range in the trace bracketed by `time.time_ns()` readings. The marker's midpoint in the trace
and the midpoint of the bracket are the same instant, so their difference is the measured offset
(error at most half the bracket, less half the marker's duration). Traces without markers fall
back to `ts + baseTimeNanoseconds` (unmeasured), and the alignment says so.

That maps a trace to its own process's wall clock. Processes on other nodes (or with a skewed
clock) have other wall clocks, so each entry may also carry `clock_offset`: its wall clock against
the app's reference clock (the controller's), measured by a clock exchange
(`profiling.clock_exchange`). The timeline's mapping is the sum of both offsets, its uncertainty
the sum of both bounds; an entry without `clock_offset` is taken to share the reference clock,
and so is one whose offset lies within its bound of zero (`ClockOffset.applied_ns`).
"""

from __future__ import annotations

from profiling.analysis.events import Event
from profiling.manifest import ClockOffset, ClockSample, ManifestEntry, ProcessAlignment

EPOCH_US_FLOOR = 1e15
"""Microseconds of 2001-09-09: a trace without `baseTimeNanoseconds` whose first `ts` is below
this is not in unix microseconds (it counts from some process-local origin)."""


class ClockProbe:
    """Watches one file's events for its entry's clock markers and its earliest timestamp."""

    def __init__(self, entry: ManifestEntry):
        self.entry = entry
        clock = entry.clock
        self.samples: list[tuple[str, ClockSample]] = (
            [(at, s) for at, s in (("start", clock.start), ("stop", clock.stop)) if s is not None]
            if clock
            else []
        )
        self.wanted = frozenset(s.marker for _, s in self.samples)
        """Marker names to look for (hot loops test membership before calling `note`)."""
        self.found: dict[str, tuple[float, float]] = {}
        self.min_ts: float | None = None

    def see(self, ev: Event) -> None:
        """Note one event (call for every event, in any order)."""
        ts = ev.get("ts")
        if not isinstance(ts, (int, float)) or ev.get("ph") == "M":
            return
        if self.min_ts is None or ts < self.min_ts:
            self.min_ts = ts
        name = ev.get("name")
        if name in self.wanted:
            self.note(name, ts, ev.get("dur"))

    def note(self, name: str, ts: float, dur: object) -> None:
        """A clock marker `name` was found at `ts` (µs) lasting `dur` (µs); the first one counts."""
        if name not in self.found:
            self.found[name] = (float(ts), float(dur) if isinstance(dur, (int, float)) else 0.0)

    def alignment(self, rel: str, base_ns: int | None) -> ProcessAlignment:
        """How this file maps to wall clock, measured from the markers where they were found."""
        measured: dict[str, tuple[float, float]] = {}
        for at, s in self.samples:
            if s.marker not in self.found:
                continue
            ts, dur = self.found[s.marker]
            # Relative to the trace's base, in integers first: unix nanoseconds (~1.8e18) as
            # floats would lose ~256 ns.
            wall_mid_rel_ns = (s.wall_before_ns + s.wall_after_ns - 2 * (base_ns or 0)) / 2
            trace_mid_rel_ns = (ts + dur / 2) * 1000
            half_bracket = (s.wall_after_ns - s.wall_before_ns) / 2
            measured[at] = (wall_mid_rel_ns - trace_mid_rel_ns, max(0.0, half_bracket - dur * 1000 / 2))
        key = self.entry.key
        if measured:
            offsets = [o for o, _ in measured.values()]
            drift = measured["stop"][0] - measured["start"][0] if len(measured) == 2 else None
            local = ProcessAlignment(
                key=key,
                file=rel,
                source="clock_sync",
                offset_ns=round(sum(offsets) / len(offsets)),
                uncertainty_ns=round(max(u for _, u in measured.values())),
                drift_ns=None if drift is None else round(drift),
            )
        elif base_ns is not None:
            local = ProcessAlignment(key=key, file=rel, source="baseTimeNanoseconds")
        elif self.min_ts is not None and self.min_ts < EPOCH_US_FLOOR and self.entry.started_at is not None:
            offset = round(self.entry.started_at * 1e9 - self.min_ts * 1000)
            local = ProcessAlignment(key=key, file=rel, source="started_at", offset_ns=offset)
        else:
            local = ProcessAlignment(key=key, file=rel, source="epoch")
        return to_reference(local, self.entry.clock_offset)


def to_reference(local: ProcessAlignment, offset: ClockOffset | None) -> ProcessAlignment:
    """`local` (a trace mapped to its own process's wall clock) carried on to the reference
    clock by the process's measured `offset`; unchanged when it was not measured."""
    if offset is None:
        return local
    return local.model_copy(
        update={
            "offset_ns": local.offset_ns + offset.applied_ns,
            "uncertainty_ns": None if local.uncertainty_ns is None else local.uncertainty_ns + offset.applied_bound_ns,
            "reference_offset_ns": offset.offset_ns,
            "reference_bound_ns": offset.bound_ns,
        }
    )


def reference_s(entry: ManifestEntry, t: float) -> float:
    """A time the process of `entry` read from its own wall clock (unix seconds: `started_at`,
    `sync.began_at`), on the reference clock."""
    return t if entry.clock_offset is None else t + entry.clock_offset.applied_ns / 1e9


def wall_ns(ts_us: float, base_ns: int | None, alignment: ProcessAlignment) -> float:
    """Reference-clock (wall-clock) nanoseconds of a trace timestamp."""
    return ts_us * 1000 + (base_ns or 0) + alignment.offset_ns
