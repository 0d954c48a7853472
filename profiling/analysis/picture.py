"""The timeline picture of a step (PNG): one row per process, its profiling window, forward steps
and weight updates, and a row with the trainer's control calls, on one wall-clock axis."""

from __future__ import annotations

import io

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from profiling.analysis.summary import ProcessSummary, StepSummary

COLORS = {
    "window": "#e3e6ea",
    "forward": "#3b75af",
    "weight_update": "#ef8636",
    "stop": "#c53a32",
    "update_weights": "#8e6bbf",
    "start": "#519e3e",
}
MIN_VISIBLE = 0.002
"""Fraction of the axis below which a span is drawn at this width, so it stays visible."""


def timeline_png(summary: StepSummary, width_in: float = 12.0, dpi: int = 90) -> bytes:
    """The step's timeline as PNG bytes (matplotlib's Agg canvas: no display needed)."""
    rows: list[tuple[str, ProcessSummary | None]] = [("control calls", None)]
    rows += [(_row_name(p.key, p.weight_versions), p) for p in summary.processes]
    times = [c.start for c in summary.control] + [c.start + c.dur_s for c in summary.control]
    for proc in summary.processes:
        times += [t for t in (proc.started_at, proc.stopped_at) if t is not None]
        times += [ph.start for ph in proc.phases] + [ph.start + ph.dur_s for ph in proc.phases]
    t0 = min(times) if times else 0.0
    span = (max(times) - t0) if times else 1.0
    span = span or 1.0
    min_w = span * MIN_VISIBLE

    fig = Figure(figsize=(width_in, 1.2 + 0.45 * len(rows)), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for y, (_, p) in enumerate(rows):
        if p is None:
            for c in summary.control:
                kind = c.name.split()[0]
                ax.broken_barh(
                    [(c.start - t0, max(c.dur_s, min_w))], (y - 0.35, 0.7), color=COLORS.get(kind, "grey")
                )
            continue
        if p.started_at is not None and p.stopped_at is not None:
            ax.broken_barh(
                [(p.started_at - t0, p.stopped_at - p.started_at)], (y - 0.42, 0.84), color=COLORS["window"]
            )
        for kind in ("forward", "weight_update"):
            spans = [(ph.start - t0, max(ph.dur_s, min_w)) for ph in p.phases if ph.kind == kind]
            if spans:
                ax.broken_barh(spans, (y - 0.3, 0.6), color=COLORS[kind])
    ax.set_yticks(range(len(rows)), [name for name, _ in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(-span * 0.01, span * 1.01)
    ax.set_xlabel("seconds (wall clock) from the earliest time shown", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_title(f"step {summary.step}: phases per process", fontsize=10)
    legend = [
        Patch(color=COLORS["window"], label="profiling window"),
        Patch(color=COLORS["forward"], label="forward step"),
        Patch(color=COLORS["weight_update"], label="weight update"),
        Patch(color=COLORS["stop"], label="stop"),
        Patch(color=COLORS["update_weights"], label="update_weights"),
        Patch(color=COLORS["start"], label="start"),
    ]
    ax.legend(
        handles=legend,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18 - 0.4 / len(rows)),
        ncol=len(legend),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _row_name(key: str, versions: list[int]) -> str:
    label = key.replace("rollout/", "rollout ").replace("trainer/rank_", "trainer rank ")
    return label + (f" (v{','.join(map(str, versions))})" if versions else "")
