"""What a process did in an RL step besides running forward passes, as recorded in its manifest
entry (docs/analysis.md#rl-step-breakdown): a rollout replica's requests and the time it spent
generating, held or idle (`RequestStats`), and the staleness of the samples a trainer rank
consumed (`Staleness`)."""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, Field

SLOWEST_KEPT = 5
"""Slowest requests a replica keeps per window (the long tail, bounded)."""


class SlowRequest(BaseModel):
    """One request of the long tail: how long it took and what it asked for and got."""

    latency_s: float
    """From entering the engine's `generate` to its answer (queueing and holds included)."""
    prompt_tokens: int
    output_tokens: int
    weight_versions: list[int] = Field(default_factory=list)
    """The weight versions it was answered with (two when it ran across a sync)."""
    finished_at: float
    """Unix seconds."""
    replica_id: str | None = None
    """Set where requests of several replicas are listed together (the step's summary)."""


class RequestStats(BaseModel):
    """A rollout replica's requests and states over its accounting window: from its profiling
    start to its stop call. generating + held + idle = window_s."""

    started_at: float
    stopped_at: float
    """Unix seconds: the accounting window (for a capped recording it runs on to the stop call,
    past the trace's end)."""
    window_s: float
    generating_s: float
    """At least one request in flight on the engine and admission open."""
    held_s: float
    """Admission held: a sync's hold (stop with pause -> update -> start) or a weight load's pause."""
    idle_s: float
    """No request in flight and admission open."""
    requests: int = 0
    """Requests answered (successfully) in the window, whenever they entered."""
    failed: int = 0
    """Requests that ended with an error in the window."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    weight_versions: dict[int, int] = Field(default_factory=dict)
    """Weight version -> requests answered with it in the window (a request across a sync counts
    for each version it ran on)."""
    slowest: list[SlowRequest] = Field(default_factory=list)
    """The slowest answered requests, slowest first (at most SLOWEST_KEPT)."""


class Staleness(BaseModel):
    """How old the samples a trainer rank consumed were: for each sample, the trainer's current
    weight version minus the version that generated it (its oldest, for a sample that ran across
    a sync)."""

    samples: int = 0
    histogram: dict[int, int] = Field(default_factory=dict)
    """Versions behind -> samples consumed."""
    max: int | None = None
    mean: float | None = None
    dropped: int = 0
    """Samples thrown away as too stale (over the trainer's max_staleness), not consumed."""

    def plus(self, lags: Iterable[int], dropped: int = 0) -> Staleness:
        """These figures with more consumed samples (`lags`) and dropped ones added."""
        hist = dict(self.histogram)
        for lag in lags:
            hist[lag] = hist.get(lag, 0) + 1
        n = sum(hist.values())
        return Staleness(
            samples=n,
            histogram=dict(sorted(hist.items())),
            max=max(hist) if hist else None,
            mean=round(sum(k * c for k, c in hist.items()) / n, 4) if n else None,
            dropped=self.dropped + dropped,
        )
