"""Prometheus metrics of the control plane (served at /metrics by the ingress)."""

from prometheus_client import Counter, Histogram

CONTROL_SECONDS = Histogram(
    "rollout_profiler_control_seconds",
    "Latency of control calls (start, stop, update_weights) as served by the ingress.",
    ["call"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
CONTROL_ERRORS = Counter(
    "rollout_profiler_control_replica_errors_total",
    "Replicas that failed or did not answer a control call.",
    ["call"],
)
