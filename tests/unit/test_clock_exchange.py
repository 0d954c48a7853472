"""The clock exchange's offset math (profiling/clock_exchange.py) and how a measured offset
reaches the merged timeline: the manifest carries it, the alignment adds it, the trainer's
control calls are shifted by it, the report shows it."""

from __future__ import annotations

import pytest

from profiling.analysis.clocks import ClockProbe, reference_s, to_reference
from profiling.analysis.sources import control_calls
from profiling.clock_exchange import ClockReading, offset_from, tightest
from profiling.config import ProfileOptions
from profiling.manifest import (
    ClockOffset,
    ClockSample,
    ClockSync,
    ManifestEntry,
    ProcessAlignment,
    SessionRecord,
    StepManifest,
    SyncCost,
)

NOW = 1_800_000_000_000_000_000
SKEW = 2_500_000_000  # the remote clock runs 2.5 s ahead


def exchange(sent: int, one_way_out: int, one_way_back: int, skew: int = SKEW) -> ClockReading:
    """An exchange whose request took `one_way_out` ns and whose answer took `one_way_back` ns."""
    return ClockReading(sent, sent + one_way_out + skew, sent + one_way_out + one_way_back)


def test_symmetric_exchange_measures_the_skew_exactly():
    got = offset_from([exchange(NOW, 500_000, 500_000)])
    assert got.offset_ns == -SKEW
    assert got.bound_ns >= 500_000


@pytest.mark.parametrize("out,back", [(10, 3_000_000), (3_000_000, 10), (1_000_000, 2_000_000)])
def test_asymmetric_exchange_is_off_by_at_most_its_bound(out, back):
    got = offset_from([exchange(NOW, out, back)])
    assert got.offset_ns != -SKEW
    assert abs(got.offset_ns + SKEW) <= got.bound_ns
    assert got.bound_ns <= (out + back) // 2 + 2  # half the round trip (rounded up)


def test_the_shortest_round_trip_wins():
    queued = exchange(NOW, 40_000_000, 200_000)  # waited 40 ms in a queue on the way out
    quick = exchange(NOW + 10**9, 300_000, 300_000)
    got = offset_from([queued, quick, exchange(NOW + 2 * 10**9, 5_000_000, 5_000_000)])
    assert got.offset_ns == -SKEW
    assert got.bound_ns == 300_001
    assert got.samples == 3


def test_no_exchange_or_a_clock_stepped_backwards_is_refused_with_its_cause():
    with pytest.raises(ValueError, match="no clock exchange"):
        offset_from([])
    with pytest.raises(ValueError, match="went backwards"):
        offset_from([ClockReading(NOW, NOW, NOW - 1)])


def test_tightest_keeps_the_smallest_bound():
    loose, tight = ClockOffset(offset_ns=5, bound_ns=900), ClockOffset(offset_ns=7, bound_ns=100)
    assert tightest(loose, None, tight) == tight
    assert tightest(None, None) is None


# -- from the manifest to the timeline --------------------------------------------------------


def test_session_offsets_reach_their_replicas_entries_and_an_entrys_own_wins():
    session = SessionRecord(
        step=1,
        steps=[1],
        tool="torch",
        options=ProfileOptions(),
        started_at=1.0,
        stopped_at=2.0,
        clock_offsets={"a": ClockOffset(offset_ns=-SKEW, bound_ns=1000), "b": ClockOffset(offset_ns=1, bound_ns=1)},
    )
    own = ClockOffset(offset_ns=42, bound_ns=7)
    entries = [
        ManifestEntry(role="rollout", replica_id="a"),
        ManifestEntry(role="rollout", replica_id="b", clock_offset=own),
        ManifestEntry(role="trainer", rank=0),
    ]
    by_key = {e.key: e for e in StepManifest.assemble(1, session, entries).entries}
    assert by_key["rollout/a"].clock_offset == session.clock_offsets["a"]
    assert by_key["rollout/b"].clock_offset == own
    assert by_key["trainer/rank_0"].clock_offset is None


def test_alignment_adds_the_reference_offset_and_its_bound():
    base = 1_799_000_000_000_000_000
    marker = ClockSample(marker="clock_sync start", wall_before_ns=base + 1_000_000, wall_after_ns=base + 1_002_000)
    entry = ManifestEntry(
        role="rollout",
        replica_id="a",
        clock=ClockSync(start=marker),
        clock_offset=ClockOffset(offset_ns=-SKEW, bound_ns=800_000),
    )
    probe = ClockProbe(entry)
    probe.note("clock_sync start", 1000.0, 2.0)  # the marker's midpoint is 1001 µs after base
    got = probe.alignment("rollout/a/trace.json.gz", base)
    assert got.source == "clock_sync"
    assert got.reference_offset_ns == -SKEW and got.reference_bound_ns == 800_000
    assert got.offset_ns == 0 - SKEW  # in-process offset 0: marker midpoint == bracket midpoint
    assert got.uncertainty_ns == 1000 - 1000 + 800_000  # half bracket less half marker, plus bound

    unmeasured = ClockProbe(entry.model_copy(update={"clock": None})).alignment("f", base)
    assert unmeasured.source == "baseTimeNanoseconds"
    assert unmeasured.offset_ns == -SKEW and unmeasured.uncertainty_ns is None


def test_an_entry_without_an_offset_is_aligned_as_before():
    local = ProcessAlignment(key="trainer/rank_0", file="f", source="clock_sync", offset_ns=12, uncertainty_ns=5)
    assert to_reference(local, None) == local


def test_trainer_control_calls_are_shifted_to_the_reference_clock():
    began = 1_800_000_000.0
    trainer = ManifestEntry(
        role="trainer",
        rank=0,
        sync=SyncCost(began_at=began, stop_s=0.1, update_s=0.2, start_s=0.05),
        clock_offset=ClockOffset(offset_ns=1_300_000_000, bound_ns=2_000_000),  # its clock runs 1.3 s behind
    )
    manifest = StepManifest(step=2, steps=[2], tool="torch", status="complete", entries=[trainer])
    stop, update, start = control_calls(manifest)
    assert stop.start == pytest.approx(began + 1.3)
    assert update.start == pytest.approx(began + 1.3 + 0.1)
    assert start.start == pytest.approx(began + 1.3 + 0.3)
    assert reference_s(trainer, began) == pytest.approx(began + 1.3)
    unmeasured = manifest.model_copy(update={"entries": [trainer.model_copy(update={"clock_offset": None})]})
    assert control_calls(unmeasured)[0].start == began


def test_report_alignment_table_shows_offset_and_bound():
    from profiling.analysis.report import _alignment_table
    from profiling.analysis.summary import ProcessSummary, StepSummary

    a = ProcessAlignment(
        key="rollout/a",
        file="f",
        source="clock_sync",
        offset_ns=-SKEW + 40,
        uncertainty_ns=801_000,
        reference_offset_ns=-SKEW,
        reference_bound_ns=800_000,
    )
    proc = ProcessSummary.model_construct(key="rollout/a", alignment=[a])
    html = _alignment_table(StepSummary.model_construct(processes=[proc]))
    assert "clock vs app µs" in html
    assert "<td>-2500000.0</td><td>800.000</td>" in html


def test_reversed_offset_negates_and_keeps_the_bound():
    from profiling.clock_exchange import reversed_offset

    assert reversed_offset(ClockOffset(offset_ns=-SKEW, bound_ns=9, samples=4)) == ClockOffset(
        offset_ns=SKEW, bound_ns=9, samples=4
    )


async def test_trainer_client_measures_its_own_clock_against_the_apps():
    """The trainer brackets GET /profile/clock; the manifest wants the trainer's clock against
    the app's, so an app 2.5 s ahead gives the trainer +2.5 s (its clock plus that is the app's)."""
    import time

    import httpx

    from trainer.client import RolloutClient

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/profile/clock"
        return httpx.Response(200, json={"time_ns": time.time_ns() + SKEW})

    client = RolloutClient("http://app.invalid")
    client._http = httpx.AsyncClient(base_url="http://app.invalid", transport=httpx.MockTransport(answer))
    async with client:
        got = await client.clock_offset(pings=3)
    assert got.samples == 3
    assert abs(got.offset_ns - SKEW) <= got.bound_ns


def test_an_offset_within_its_bound_of_zero_moves_nothing_and_widens_the_uncertainty():
    """One machine: the exchange measures a few ms ± a few ms where the clocks agree exactly;
    applying it would only add error, so the timeline keeps the trace where it was and says how
    far off it could be."""
    local = ProcessAlignment(key="rollout/a", file="f", source="clock_sync", offset_ns=12, uncertainty_ns=5)
    near = to_reference(local, ClockOffset(offset_ns=-3_000_000, bound_ns=4_000_000))
    assert near.offset_ns == 12 and near.uncertainty_ns == 5 + 3_000_000 + 4_000_000
    assert near.reference_offset_ns == -3_000_000  # the measurement is still recorded
    far = to_reference(local, ClockOffset(offset_ns=-2_500_000_000, bound_ns=4_000_000))
    assert far.offset_ns == 12 - 2_500_000_000 and far.uncertainty_ns == 5 + 4_000_000
    trainer = ManifestEntry(role="trainer", rank=0, clock_offset=ClockOffset(offset_ns=2_000_000, bound_ns=3_000_000))
    assert reference_s(trainer, 100.0) == 100.0
