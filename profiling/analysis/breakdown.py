"""The RL step breakdown (docs/analysis.md#rl-step-breakdown): per replica, the time generating,
held, idle, finalizing and exporting and the requests and tokens served; per trainer rank, the
time training, in the sync and otherwise; across replicas, the imbalance, the slowest requests and
the weight versions served; and the staleness of the samples the trainer consumed.

Built from the manifest entries (`requests`, `staleness`, `finalize_s`, `export_s`, `sync`) and,
from the traces, the trainer's mini-batch time.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from profiling.manifest import ManifestEntry, ParallelRank
from profiling.step_stats import SLOWEST_KEPT, SlowRequest, Staleness


class ReplicaBreakdown(BaseModel):
    """One rollout replica over the step (seconds; None: the entry has no request accounting)."""

    replica_id: str
    window_s: float | None = None
    generating_s: float | None = None
    held_s: float | None = None
    idle_s: float | None = None
    sync_held_s: float | None = None
    """Admission held for the sync that ended the step, from the stop to the release (the
    finalize runs within it)."""
    finalizing_s: float | None = None
    """The profiler's stop on the model thread, after the window."""
    exporting_s: float | None = None
    """Writing the trace, in the background after the finalize."""
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    weight_versions: dict[int, int] = Field(default_factory=dict)
    slowest_s: float | None = None
    """The slowest request's latency."""


class TrainerBreakdown(BaseModel):
    """One trainer rank over the step (seconds)."""

    rank: int
    name: str
    """`trainer rank 0`, or with Megatron's coordinates `trainer tp1 pp0 (rank 1)`."""
    parallel: ParallelRank | None = None
    pipeline_wait_s: float | None = None
    """Megatron: within `training_s`, point-to-point sends and receives, where this rank's pipeline
    stage waited on its neighbour (None: no Megatron coordinates)."""
    window_s: float | None = None
    training_s: float = 0.0
    """The mini-batches (`forward_step` ranges): forward, backward and optimizer step."""
    sync_s: float = 0.0
    """The weight sync's control calls (stop, update_weights, start) that ended the step."""
    other_s: float | None = None
    """The rest of the window: waiting for samples, writing the weights."""
    finalizing_s: float | None = None
    exporting_s: float | None = None


class Imbalance(BaseModel):
    """How unevenly the replicas worked: the largest over the mean of each figure (1.0: even)."""

    replicas: int = 0
    generating_max_over_mean: float | None = None
    output_tokens_max_over_mean: float | None = None
    requests_max_over_mean: float | None = None
    busiest: str | None = None
    """The replica with the most time generating."""
    least_busy: str | None = None


class PipelineStage(BaseModel):
    """One pipeline stage over the step (its ranks' mean, seconds): the Megatron backend."""

    stage: int
    ranks: list[int]
    training_s: float
    """The mini-batches: forward, backward, optimizer, and the waits between."""
    compute_s: float
    """`training_s` less the bubble."""
    bubble_s: float
    """Time the stage waited on its neighbours' sends and receives: its pipeline bubble."""
    bubble_share: float | None = None
    """`bubble_s` over `training_s` (None: no training time)."""


class StepBreakdown(BaseModel):
    """`StepSummary.breakdown`."""

    replicas: list[ReplicaBreakdown] = Field(default_factory=list)
    trainer: list[TrainerBreakdown] = Field(default_factory=list)
    imbalance: Imbalance = Field(default_factory=Imbalance)
    requests: int = 0
    output_tokens: int = 0
    weight_versions_served: dict[int, int] = Field(default_factory=dict)
    """Weight version -> requests answered with it, over every replica."""
    slowest_requests: list[SlowRequest] = Field(default_factory=list)
    """The slowest requests over every replica, slowest first (with `replica_id`)."""
    staleness: Staleness | None = None
    """Of the samples the trainer ranks consumed (None: no trainer entry recorded it)."""
    pipeline: list[PipelineStage] = Field(default_factory=list)
    """Per pipeline stage, first to last (empty: no trainer rank has Megatron coordinates)."""


def step_breakdown(
    entries: list[ManifestEntry], forward_ms: dict[str, float], pipeline_wait_ms: dict[str, float] | None = None
) -> StepBreakdown:
    """The breakdown of one step from its manifest `entries`; `forward_ms`: entry key -> time in
    its `forward_step` ranges, `pipeline_wait_ms`: in point-to-point waits within them (from the
    summary of its traces)."""
    out = StepBreakdown()
    slowest: list[SlowRequest] = []
    staleness: Staleness | None = None
    for e in entries:
        finalizing, exporting = _r(e.finalize_s), _r(e.export_s)
        if e.role == "rollout":
            row = ReplicaBreakdown(
                replica_id=e.replica_id or "?",
                sync_held_s=_r(e.sync_held_s),
                finalizing_s=finalizing,
                exporting_s=exporting,
            )
            if (r := e.requests) is not None:
                row = row.model_copy(
                    update={
                        "window_s": r.window_s,
                        "generating_s": r.generating_s,
                        "held_s": r.held_s,
                        "idle_s": r.idle_s,
                        "requests": r.requests,
                        "failed": r.failed,
                        "prompt_tokens": r.prompt_tokens,
                        "output_tokens": r.output_tokens,
                        "weight_versions": r.weight_versions,
                        "slowest_s": r.slowest[0].latency_s if r.slowest else None,
                    }
                )
                slowest += [s.model_copy(update={"replica_id": row.replica_id}) for s in r.slowest]
                for v, n in r.weight_versions.items():
                    out.weight_versions_served[v] = out.weight_versions_served.get(v, 0) + n
            out.replicas.append(row)
        else:
            window = None if e.started_at is None or e.stopped_at is None else e.stopped_at - e.started_at
            training = forward_ms.get(e.key, 0.0) / 1000
            sync = e.sync.total_s if e.sync else 0.0
            wait = (pipeline_wait_ms or {}).get(e.key, 0.0) / 1000 if e.parallel is not None else None
            out.trainer.append(
                TrainerBreakdown(
                    rank=e.rank or 0,
                    name=e.trainer_name,
                    parallel=e.parallel,
                    pipeline_wait_s=None if wait is None else round(wait, 6),
                    window_s=_r(window),
                    training_s=round(training, 6),
                    sync_s=round(sync, 6),
                    other_s=None if window is None else round(max(0.0, window - training - sync), 6),
                    finalizing_s=finalizing,
                    exporting_s=exporting,
                )
            )
            if e.staleness is not None:
                staleness = _combine(staleness, e.staleness)
    out.requests = sum(r.requests for r in out.replicas)
    out.output_tokens = sum(r.output_tokens for r in out.replicas)
    out.weight_versions_served = dict(sorted(out.weight_versions_served.items()))
    out.slowest_requests = sorted(slowest, key=lambda s: -s.latency_s)[:SLOWEST_KEPT]
    out.imbalance = _imbalance([r for r in out.replicas if r.generating_s is not None])
    out.staleness = staleness
    out.pipeline = _stages(out.trainer)
    return out


def _stages(trainer: list[TrainerBreakdown]) -> list[PipelineStage]:
    """Each pipeline stage's mean over its ranks that recorded."""
    by_stage: dict[int, list[TrainerBreakdown]] = {}
    for t in trainer:
        if t.parallel is not None:
            by_stage.setdefault(t.parallel.pp, []).append(t)
    stages = []
    for stage, rows in sorted(by_stage.items()):
        training = sum(t.training_s for t in rows) / len(rows)
        bubble = sum(t.pipeline_wait_s or 0.0 for t in rows) / len(rows)
        stages.append(
            PipelineStage(
                stage=stage,
                ranks=[t.rank for t in rows],
                training_s=round(training, 6),
                compute_s=round(training - bubble, 6),
                bubble_s=round(bubble, 6),
                bubble_share=round(bubble / training, 4) if training > 0 else None,
            )
        )
    return stages


def _imbalance(replicas: list[ReplicaBreakdown]) -> Imbalance:
    out = Imbalance(replicas=len(replicas))
    if not replicas:
        return out
    out.generating_max_over_mean = _max_over_mean([r.generating_s or 0.0 for r in replicas])
    out.output_tokens_max_over_mean = _max_over_mean([float(r.output_tokens) for r in replicas])
    out.requests_max_over_mean = _max_over_mean([float(r.requests) for r in replicas])
    ranked = sorted(replicas, key=lambda r: r.generating_s or 0.0)
    out.busiest, out.least_busy = ranked[-1].replica_id, ranked[0].replica_id
    return out


def _max_over_mean(values: list[float]) -> float | None:
    mean = sum(values) / len(values)
    return round(max(values) / mean, 3) if mean > 0 else None


def _combine(a: Staleness | None, b: Staleness) -> Staleness:
    """Two ranks' staleness figures as one."""
    lags = [lag for lag, n in b.histogram.items() for _ in range(n)]
    return (a or Staleness()).plus(lags, b.dropped)


def _r(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)
