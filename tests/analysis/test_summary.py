"""Summaries and diffs from synthetic traces with exactly known durations."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from profiling.analysis.diff import diff_steps
from profiling.analysis.summary import _self_times, summarize_step
from profiling.step_stats import RequestStats, SlowRequest, Staleness

from .synth import Ev, Proc, forward, write_step

MS = 1_000_000


def test_self_time_subtracts_direct_children_only():
    # a [0,100) > b [10,60) > c [20,30); d [70,90) under a; e [200,210) alone; f overlaps a's end
    ts = np.array([0.0, 10.0, 20.0, 70.0, 200.0, 95.0])
    dur = np.array([100.0, 50.0, 10.0, 20.0, 10.0, 10.0])
    nid = np.array([0, 1, 2, 3, 4, 5])
    own, ids = _self_times(ts, dur, nid)
    got = dict(zip(ids.tolist(), own.tolist(), strict=True))
    # a: 100 - 50 (b) - 20 (d) - 5 (f clipped to a's end) = 25; b: 50 - 10 = 40
    assert got == {0: 25.0, 1: 40.0, 2: 10.0, 3: 20.0, 4: 10.0, 5: 10.0}


def test_same_start_longer_event_is_the_parent():
    own, ids = _self_times(np.array([0.0, 0.0]), np.array([5.0, 20.0]), np.array([7, 8]))
    assert dict(zip(ids.tolist(), own.tolist(), strict=True)) == {8: 15.0, 7: 5.0}


def replica(name: str, fwd_us: float, mm_us: float, start_ms: int, stop_ms: int, step: int = 1) -> Proc:
    events = [
        e
        for i in range(4)
        for e in forward(
            i, step, step - 1, (start_ms + 1 + 2 * i) * MS, fwd_us, [("aten::mm", mm_us), ("aten::add", 10.0)]
        )
    ]
    events.append(Ev(f"weight_update version={step}", (stop_ms - 1) * MS, 300.0, cat="user_annotation"))
    events.append(Ev("CUPTI overhead", (start_ms + 1) * MS, 7.0, cat="overhead", tid=99))
    return Proc(
        "rollout",
        name,
        os_pid=100 + int(name[1:]),
        events=events,
        window=(start_ms * MS, stop_ms * MS),
        weight_version=step - 1,
    )


def test_per_process_and_cross_replica_summary(store):
    write_step(
        store,
        1,
        [
            replica("r0", 500.0, 200.0, 0, 12),
            replica("r1", 800.0, 500.0, 3, 14),
            Proc(
                "trainer",
                "0",
                os_pid=7,
                events=forward(0, 1, 0, 2 * MS, 900.0, [("aten::addmm", 300.0)]),
                window=(MS, 10 * MS),
            ),
        ],
        sync_at_ns=15 * MS,
        sync=(0.010, 0.020, 0.005),
    )
    s = summarize_step(store, 1)
    r0, r1 = s.by_role("rollout")
    assert (r0.key, r1.key) == ("rollout/r0", "rollout/r1")
    assert (
        r0.forward_steps == 4
        and r0.forward_ms == pytest.approx(2.0)
        and r0.forward_mean_ms == pytest.approx(0.5)
    )
    assert r1.forward_max_ms == pytest.approx(0.8)
    assert r0.weight_updates == 1 and r0.weight_update_ms == pytest.approx(0.3)
    assert r0.overhead.kineto_ms == pytest.approx(0.007)
    assert r0.overhead.finalize_ms == pytest.approx(50.0) and r0.overhead.export_ms == pytest.approx(200.0)
    ops = {o.name: o for o in r0.ops}
    assert set(ops) == {"aten::mm", "aten::add"}  # ranges and overhead are not ops
    assert ops["aten::mm"].self_ms == pytest.approx(0.8) and ops["aten::mm"].count == 4
    assert r0.ops[0].name == "aten::mm"
    assert s.skew.replicas == 2
    assert s.skew.start_spread_ms == pytest.approx(3.0) and s.skew.stop_spread_ms == pytest.approx(2.0)
    assert (s.skew.first_to_start, s.skew.last_to_start) == ("r0", "r1")
    assert s.skew.slowest_replica == "r1" and s.skew.slowest_forward_mean_ms == pytest.approx(0.8)
    assert [c.name for c in s.control] == ["stop step 1", "update_weights v1", "start step 2"]
    assert s.control[1].start == pytest.approx(s.control[0].start + 0.010)
    # phases for the picture, at their wall-clock times
    assert [p.kind for p in r0.phases].count("forward") == 4
    assert "phases" not in s.model_dump()["processes"][0]


def test_diff_says_what_got_slower(store):
    write_step(
        store, 1, [replica("r0", 500.0, 200.0, 0, 12, step=1), replica("r1", 500.0, 200.0, 0, 12, step=1)]
    )
    write_step(
        store, 2, [replica("r0", 900.0, 600.0, 0, 12, step=2), replica("r1", 500.0, 200.0, 0, 12, step=2)]
    )
    d = diff_steps(summarize_step(store, 1), summarize_step(store, 2))
    assert (d.a, d.b) == (1, 2) and d.ops_basis == {"rollout": "per forward step"}
    top = d.ops[0]
    # aten::mm: (200 + 200) µs per step -> (600 + 200) µs, over 4 steps each on 2 replicas
    assert (top.name, top.role) == ("aten::mm", "rollout")
    assert (
        top.a_ms == pytest.approx(0.2) and top.b_ms == pytest.approx(0.4) and top.ratio == pytest.approx(2.0)
    )
    phases = {(p.role, p.name): p for p in d.phases}
    fwd = phases[("rollout", "forward step, mean")]
    assert (
        fwd.a_ms == pytest.approx(0.5)
        and fwd.b_ms == pytest.approx(0.7)
        and fwd.delta_ms == pytest.approx(0.2)
    )
    assert phases[("rollout", "forward step, slowest process mean")].b_ms == pytest.approx(0.9)
    assert phases[(None, "sync: stop")].a_ms is None  # no trainer, no sync timing


def test_a_trace_that_breaks_half_way_is_left_out_whole(store):
    r0 = replica("r0", 500.0, 200.0, 0, 12)
    r0.extra_files = {
        "cut.pt.trace.json.gz": gzip.compress(
            b'{"traceEvents": [' + b'{"ph": "X", "name": "aten::mm", "ts": 1, "dur": 1},' * 20_000
        )
    }
    write_step(store, 1, [r0])
    s = summarize_step(store, 1)
    [p] = s.processes
    assert [x.split(":")[0] for x in s.skipped] == ["rollout/r0/cut.pt.trace.json.gz"]
    assert "unreadable trace" in s.skipped[0]
    assert p.trace_files == 1 and {o.name: o.count for o in p.ops}["aten::mm"] == 4


def with_records(store, step: int, requests: dict[str, RequestStats], staleness: Staleness | None = None) -> None:
    """Give the step's entries the records the replicas and the trainer annotate them with."""
    for e in store.read_entries(step):
        if e.role == "rollout" and e.replica_id in requests:
            store.write_entry(step, e.model_copy(update={"requests": requests[e.replica_id]}))
        elif e.role == "trainer" and staleness is not None:
            store.write_entry(step, e.model_copy(update={"staleness": staleness}))
    store.refresh_manifest(step)


def stats(generating: float, held: float, idle: float, requests: int, tokens: int, slow: list[float], v: int):
    return RequestStats(
        started_at=1.0,
        stopped_at=1.0 + generating + held + idle,
        window_s=generating + held + idle,
        generating_s=generating,
        held_s=held,
        idle_s=idle,
        requests=requests,
        prompt_tokens=requests * 4,
        output_tokens=tokens,
        weight_versions={v: requests},
        slowest=[
            SlowRequest(latency_s=x, prompt_tokens=4, output_tokens=16, weight_versions=[v], finished_at=2.0)
            for x in slow
        ],
    )


def rl_step(store, step: int, r1_generating: float) -> None:
    write_step(
        store,
        step,
        [
            replica("r0", 500.0, 200.0, 0, 12, step=step),
            replica("r1", 500.0, 200.0, 0, 12, step=step),
            Proc("trainer", "0", os_pid=7, events=forward(0, step, step - 1, 2 * MS, 900.0), window=(MS, 10 * MS)),
        ],
        sync_at_ns=15 * MS,
        sync=(0.001, 0.002, 0.001),
    )
    with_records(
        store,
        step,
        {
            "r0": stats(3.0, 0.5, 0.5, 30, 480, [0.9, 0.4], step - 1),
            "r1": stats(r1_generating, 0.5, 4.0 - r1_generating, 10, 160, [2.5], step - 1),
        },
        Staleness().plus([0, 0, 1, 2], dropped=1),
    )


def test_the_rl_step_breakdown(store):
    rl_step(store, 1, r1_generating=1.0)
    b = summarize_step(store, 1).breakdown
    r0, r1 = b.replicas
    assert (r0.replica_id, r0.generating_s, r0.held_s, r0.idle_s) == ("r0", 3.0, 0.5, 0.5)
    # finalizing and exporting: the entry's finalize_s and export_s
    assert (r0.finalizing_s, r0.exporting_s) == (pytest.approx(0.05), pytest.approx(0.2))
    assert (r1.requests, r1.output_tokens, r1.slowest_s) == (10, 160, 2.5)
    # imbalance: max over mean of the replicas' time generating (3 / 2) and tokens (480 / 320)
    assert b.imbalance.generating_max_over_mean == pytest.approx(1.5)
    assert b.imbalance.output_tokens_max_over_mean == pytest.approx(1.5)
    assert (b.imbalance.busiest, b.imbalance.least_busy) == ("r0", "r1")
    # the long tail over every replica, slowest first, naming the replica
    assert [(s.replica_id, s.latency_s) for s in b.slowest_requests] == [("r1", 2.5), ("r0", 0.9), ("r0", 0.4)]
    assert b.weight_versions_served == {0: 40} and (b.requests, b.output_tokens) == (40, 640)
    assert b.staleness is not None and b.staleness.histogram == {0: 2, 1: 1, 2: 1} and b.staleness.max == 2
    [t] = b.trainer
    # trainer window 9 ms: 0.9 ms training, 4 ms in the sync, the rest other
    assert t.training_s == pytest.approx(0.0009) and t.sync_s == pytest.approx(0.004)
    assert t.other_s == pytest.approx(0.009 - 0.0009 - 0.004)
    dumped = summarize_step(store, 1).model_dump(mode="json")["breakdown"]
    assert dumped["weight_versions_served"] == {"0": 40} and dumped["replicas"][0]["generating_s"] == 3.0


def test_a_step_without_records_has_an_empty_breakdown(store):
    write_step(store, 1, [replica("r0", 500.0, 200.0, 0, 12)])
    b = summarize_step(store, 1).breakdown
    [r0] = b.replicas
    assert r0.generating_s is None and r0.finalizing_s == pytest.approx(0.05)
    assert b.imbalance.replicas == 0 and b.imbalance.generating_max_over_mean is None and b.staleness is None


def test_diff_covers_the_breakdown(store):
    rl_step(store, 1, r1_generating=1.0)
    rl_step(store, 2, r1_generating=3.0)
    d = {c.name: c for c in diff_steps(summarize_step(store, 1), summarize_step(store, 2)).breakdown}
    gen = d["rollout generating, all replicas"]
    assert (gen.unit, gen.a, gen.b, gen.delta) == ("s", 4.0, 6.0, 2.0)
    assert d["rollout idle, all replicas"].delta == pytest.approx(-2.0)
    imbalance = d["imbalance: generating"]
    assert imbalance.b == pytest.approx(1.0) and imbalance.ratio == pytest.approx(0.667)
    assert d["staleness, max"].a == 2 and d["slowest request"].b == 2.5
