"""Prometheus metrics of the control plane, served at /metrics by the ingress (the single control
replica) from prometheus_client's default registry in the ingress process.

Ray Serve's own metrics (requests, latencies, replica health) are not here: Ray's metrics agent
exports them (docs/operations.md, "Metrics"). docs/operations.md lists every metric defined here;
tests/unit/test_metrics_doc.py keeps the two in sync.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator
from typing import get_args

from prometheus_client import Counter, Gauge, Histogram

from profiling.manifest import StepManifest
from profiling.session import SessionState
from profiling.store import TraceStore
from serve_app.api import UNKNOWN_REPLICA, ReplicaReport, StatusResponse
from serve_app.errors import ControlError

REPLICA_STATES: tuple[str, ...] = get_args(SessionState)
"""The states of `rollout_profiler_replica_state`: every profiling session state."""

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_EXPORT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# -- control calls ------------------------------------------------------------------------
CONTROL_SECONDS = Histogram(
    "rollout_profiler_control_seconds",
    "Latency of control calls (start, stop, update_weights) as served by the ingress.",
    ["call"],
    buckets=_LATENCY_BUCKETS,
)
CONTROL_ERRORS = Counter(
    "rollout_profiler_control_replica_errors_total",
    "Replicas that failed or did not answer a control call.",
    ["call"],
)
CONTROL_CALL_ERRORS = Counter(
    "rollout_profiler_control_call_errors_total",
    "Control calls (start, stop, update_weights) answered with an error status, by HTTP status.",
    ["call", "status"],
)

# -- stop critical path and trace export -------------------------------------------------
STOP_CRITICAL_PATH_SECONDS = Histogram(
    "rollout_profiler_stop_critical_path_seconds",
    "Seconds a stop of the active step took until it answered: what the trainer's weight sync waits for.",
    buckets=_LATENCY_BUCKETS,
)
STOP_ACK_SECONDS = Histogram(
    "rollout_profiler_stop_ack_seconds",
    "Seconds each replica took to acknowledge a stop (one sample per replica per stop).",
    buckets=_LATENCY_BUCKETS,
)
EXPORT_SECONDS = Histogram(
    "rollout_profiler_export_seconds",
    "Seconds a replica spent writing one step's trace, off the critical path (one sample per rollout trace).",
    buckets=_EXPORT_BUCKETS,
)
EXPORTING_STEPS = Gauge(
    "rollout_profiler_exporting_steps",
    "Stopped steps whose traces are still being written; a start is refused (429) at max_exporting_steps.",
)
TRACE_BYTES = Counter(
    "rollout_profiler_trace_bytes_total",
    "Bytes of rollout trace files written under save_path.",
)

# -- fleet state, refreshed at scrape time -------------------------------------------------
ACTIVE_STEP = Gauge(
    "rollout_profiler_active_step",
    "The step being profiled, from the controller's desired state (0: idle).",
)
REPLICA_UP = Gauge(
    "rollout_profiler_replica_up",
    "1 if the replica answered the status call made for this scrape, 0 if it failed or timed out.",
    ["replica_id"],
)
REPLICA_STATE = Gauge(
    "rollout_profiler_replica_state",
    "Profiling state of each replica that answered: 1 for its current state, 0 for the others.",
    ["replica_id", "state"],
)
REPLICA_WEIGHT_VERSION = Gauge(
    "rollout_profiler_replica_weight_version",
    "Weight version each replica that answered is serving.",
    ["replica_id"],
)

_exports_lock = threading.Lock()
_exports_pending: dict[int, set[str]] = {}
"""Stopped steps whose manifest has not settled yet -> keys of the entries already counted."""


@contextlib.asynccontextmanager
async def timed_call(call: str) -> AsyncIterator[None]:
    """Observe a control call's latency in CONTROL_SECONDS and its error status in CONTROL_CALL_ERRORS."""
    t0 = time.perf_counter()
    try:
        yield
    except ControlError as e:
        CONTROL_CALL_ERRORS.labels(call, str(e.status)).inc()
        raise
    finally:
        CONTROL_SECONDS.labels(call).observe(time.perf_counter() - t0)


def observe_stop(critical_path_s: float, reports: list[ReplicaReport]) -> None:
    """Record a stop of the active step: its critical path and each replica's acknowledgement."""
    STOP_CRITICAL_PATH_SECONDS.observe(critical_path_s)
    for r in reports:
        if r.stop_ack_s is not None:
            STOP_ACK_SECONDS.observe(r.stop_ack_s)


def observe_exports(manifest: StepManifest) -> None:
    """Count the finished rollout traces of a stopped step's manifest, each once.

    The controller calls this once it has collected the step's exports. A replica can answer
    that collection before its export is even queued (it acknowledges the stop first), so a
    manifest that has not settled keeps the step pending: `refresh_exports` counts the rest at
    scrape time. Trainer traces are not counted: the trainer writes them, not this app.
    """
    with _exports_lock:
        _count_exports(manifest, _exports_pending.setdefault(manifest.step, set()))


def refresh_exports(store: TraceStore) -> None:
    """Count the traces of pending steps that finished since their manifest was last read."""
    with _exports_lock:
        steps = list(_exports_pending)
    for step in steps:
        manifest = store.read_manifest(step)  # outside the lock: a file read
        with _exports_lock:
            counted = _exports_pending.get(step)  # None: settled meanwhile, all counted
            if manifest is not None and counted is not None:
                _count_exports(manifest, counted)


def _count_exports(manifest: StepManifest, counted: set[str]) -> None:
    """Count the entries not in `counted` yet; forget the step once settled. Holds the lock."""
    for e in manifest.entries:
        if e.role != "rollout" or e.exporting or e.export_s is None or e.key in counted:
            continue
        counted.add(e.key)
        EXPORT_SECONDS.observe(e.export_s)
        TRACE_BYTES.inc(e.bytes)
    if manifest.status in ("complete", "partial"):
        del _exports_pending[manifest.step]


def refresh_fleet(status: StatusResponse | None) -> None:
    """Set the fleet gauges from a status broadcast (None: it failed, no replica is known).

    Label sets are rebuilt from scratch, so replicas that no longer exist disappear. Callers
    run this and the exposition in the event loop with no await between, so a scrape never
    sees the gauges half rebuilt.
    """
    for gauge in (REPLICA_UP, REPLICA_STATE, REPLICA_WEIGHT_VERSION):
        gauge.clear()
    if status is None:
        return
    ACTIVE_STEP.set(status.active_step or 0)
    for r in status.replicas:
        if r.replica_id == UNKNOWN_REPLICA:
            continue  # an anonymous failure: no replica to label
        REPLICA_UP.labels(r.replica_id).set(1 if r.ok else 0)
        if not r.ok:
            continue  # its state and version are unknown, not zero
        for state in REPLICA_STATES:
            REPLICA_STATE.labels(r.replica_id, state).set(1 if r.state == state else 0)
        if r.weight_version is not None:
            REPLICA_WEIGHT_VERSION.labels(r.replica_id).set(r.weight_version)
