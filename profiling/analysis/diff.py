"""What changed between two steps: phases (forward steps, weight updates, the sync's calls,
profiler overhead, replica skew), the RL step breakdown's figures, and ops by self time per
forward step, per role.

Ops are compared per forward step (self time summed over the role's processes, divided by the
role's forward steps) so that two steps with different numbers of engine steps compare fairly;
where a role has no forward steps the totals are compared.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, Field

from profiling.analysis.summary import ProcessSummary, StepSummary
from profiling.manifest import Role


class Delta(BaseModel):
    """One quantity in step a and in step b (milliseconds); `delta_ms` is b - a."""

    name: str
    role: Role | None = None
    a_ms: float | None
    b_ms: float | None
    delta_ms: float | None = None
    ratio: float | None = None
    """b / a (None when a is 0 or either is missing)."""

    @classmethod
    def of(cls, name: str, a: float | None, b: float | None, role: Role | None = None) -> Delta:
        delta: float | None = None
        ratio: float | None = None
        if a is not None and b is not None:
            delta = round(b - a, 4)
            ratio = round(b / a, 3) if a else None
        return cls(name=name, role=role, a_ms=a, b_ms=b, delta_ms=delta, ratio=ratio)


class Change(BaseModel):
    """One figure of the RL step breakdown in step a and in step b, in `unit`; `delta` is b - a."""

    name: str
    unit: str
    a: float | None
    b: float | None
    delta: float | None = None
    ratio: float | None = None
    """b / a (None when a is 0 or either is missing)."""

    @classmethod
    def of(cls, name: str, unit: str, a: float | None, b: float | None) -> Change:
        d = Delta.of(name, a, b)
        return cls(name=name, unit=unit, a=a, b=b, delta=d.delta_ms, ratio=d.ratio)


class StepDiff(BaseModel):
    """`python -m profiling diff DIR --step a --step b --json`."""

    a: int
    b: int
    phases: list[Delta] = Field(default_factory=list)
    breakdown: list[Change] = Field(default_factory=list)
    """The RL step breakdown, step a against step b."""
    ops: list[Delta] = Field(default_factory=list, description="By delta, most slowed-down first.")
    ops_basis: dict[str, str] = Field(
        default_factory=dict, description="Per role: 'per forward step' or 'total' (what ops compare)."
    )


def diff_steps(a: StepSummary, b: StepSummary, top: int | None = 20) -> StepDiff:
    """Compare step `b` against step `a`; `top` limits the op list (None: every op)."""
    out = StepDiff(a=a.step, b=b.step, phases=_phases(a, b), breakdown=_breakdown(a, b))
    for role in ("rollout", "trainer"):
        pa, pb = a.by_role(role), b.by_role(role)
        if not pa and not pb:
            continue
        steps_a, steps_b = _forward_steps(pa), _forward_steps(pb)
        per_step = bool(steps_a and steps_b)
        out.ops_basis[role] = "per forward step" if per_step else "total"
        ops_a = _op_totals(pa, steps_a if per_step else 1)
        ops_b = _op_totals(pb, steps_b if per_step else 1)
        for name in ops_a.keys() | ops_b.keys():
            out.ops.append(
                Delta.of(name, round(ops_a.get(name, 0.0), 4), round(ops_b.get(name, 0.0), 4), role)
            )
    out.ops.sort(key=lambda d: -(d.delta_ms or 0.0))
    if top is not None:
        out.ops = out.ops[:top]
    return out


def _forward_steps(processes: list[ProcessSummary]) -> int:
    return sum(p.forward_steps for p in processes)


def _op_totals(processes: list[ProcessSummary], divisor: int) -> dict[str, float]:
    totals: dict[str, float] = {}
    for p in processes:
        for op in p.ops:
            totals[op.name] = totals.get(op.name, 0.0) + op.self_ms / divisor
    return totals


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(sum(known) / len(known), 3) if known else None


def _max(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _phases(a: StepSummary, b: StepSummary) -> list[Delta]:
    rows: list[Delta] = []
    for role in ("rollout", "trainer"):
        pa, pb = a.by_role(role), b.by_role(role)
        if not pa and not pb:
            continue
        for name, pick in (
            ("forward step, mean", lambda ps: _mean([p.forward_mean_ms for p in ps])),
            ("forward step, slowest process mean", lambda ps: _max([p.forward_mean_ms for p in ps])),
            ("forward steps, total", lambda ps: round(sum(p.forward_ms for p in ps), 3)),
            ("weight updates, total", lambda ps: round(sum(p.weight_update_ms for p in ps), 3)),
            ("profiler finalize, slowest", lambda ps: _max([p.overhead.finalize_ms for p in ps])),
            ("trace export, slowest", lambda ps: _max([p.overhead.export_ms for p in ps])),
        ):
            rows.append(Delta.of(name, pick(pa), pick(pb), role))
    for name, field in (
        ("sync: stop", "stop_s"),
        ("sync: update_weights", "update_s"),
        ("sync: start", "start_s"),
    ):
        va = getattr(a.sync, field) if a.sync else None
        vb = getattr(b.sync, field) if b.sync else None
        rows.append(Delta.of(name, _ms(va), _ms(vb)))
    rows.append(Delta.of("replica start spread", a.skew.start_spread_ms, b.skew.start_spread_ms))
    rows.append(Delta.of("replica stop spread", a.skew.stop_spread_ms, b.skew.stop_spread_ms))
    return rows


def _breakdown(a: StepSummary, b: StepSummary) -> list[Change]:
    """Rollout states summed over the replicas, requests and tokens, the slowest request,
    imbalance, the trainer's time, and staleness."""

    def total(s: StepSummary, field: str) -> float | None:
        known = [v for r in s.breakdown.replicas if (v := getattr(r, field)) is not None]
        return round(sum(known), 6) if known else None

    def slowest(s: StepSummary) -> float | None:
        reqs = s.breakdown.slowest_requests
        return reqs[0].latency_s if reqs else None

    def trainer(s: StepSummary, field: str) -> float | None:
        known = [v for t in s.breakdown.trainer if (v := getattr(t, field)) is not None]
        return round(sum(known), 6) if known else None

    def stale(s: StepSummary, field: str) -> float | None:
        st = s.breakdown.staleness
        return None if st is None else getattr(st, field)

    rows: list[tuple[str, str, Callable[[StepSummary], float | None]]] = [
        *[
            (f"rollout {label}, all replicas", "s", lambda s, f=f"{field}_s": total(s, f))
            for label, field in (
                ("generating", "generating"),
                ("held", "held"),
                ("idle", "idle"),
                ("held for the sync", "sync_held"),
                ("finalizing", "finalizing"),
                ("exporting", "exporting"),
            )
        ],
        ("requests answered", "requests", lambda s: float(s.breakdown.requests)),
        ("output tokens", "tokens", lambda s: float(s.breakdown.output_tokens)),
        ("slowest request", "s", slowest),
        ("imbalance: generating", "max/mean", lambda s: s.breakdown.imbalance.generating_max_over_mean),
        ("imbalance: output tokens", "max/mean", lambda s: s.breakdown.imbalance.output_tokens_max_over_mean),
        ("trainer training", "s", lambda s: trainer(s, "training_s")),
        ("trainer sync", "s", lambda s: trainer(s, "sync_s")),
        ("trainer other", "s", lambda s: trainer(s, "other_s")),
        ("staleness, mean", "versions", lambda s: stale(s, "mean")),
        ("staleness, max", "versions", lambda s: stale(s, "max")),
        ("weight versions served", "versions", lambda s: float(len(s.breakdown.weight_versions_served))),
    ]
    return [Change.of(name, unit, pick(a), pick(b)) for name, unit, pick in rows]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)
