"""The pictures of a step (PNG). The timeline: one row per process, its profiling window, forward
steps and weight updates, and a row with the trainer's control calls, on one wall-clock axis. The
breakdown: one stacked bar per replica and per trainer rank, split by where its time went."""

from __future__ import annotations

import io

from matplotlib.axes import Axes
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
    return _png_with_legend(fig, ax, legend, below=0.18 + 0.4 / len(rows))


def _png_with_legend(fig: Figure, ax: Axes, legend: list[Patch], below: float) -> bytes:
    """The figure as PNG bytes, with `legend` in one row `below` (axes fractions) the plot."""
    ax.legend(
        handles=legend, loc="upper center", bbox_to_anchor=(0.5, -below), ncol=len(legend), fontsize=8, frameon=False
    )
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _row_name(key: str, versions: list[int]) -> str:
    label = key.replace("rollout/", "rollout ").replace("trainer/rank_", "trainer rank ")
    return label + (f" (v{','.join(map(str, versions))})" if versions else "")


STATE_COLORS = {
    "generating": "#3b75af",
    "held": "#d1495b",
    "held for the sync": "#eba0aa",
    "idle": "#d9d9d9",
    "finalizing": "#8e6bbf",
    "exporting": "#b9a7d6",
    "training": "#519e3e",
    "sync": "#ef8636",
    "other": "#eeeeee",
}
"""Colours of the breakdown picture's states (generating is the timeline's forward-step blue)."""


def breakdown_png(summary: StepSummary, width_in: float = 12.0, dpi: int = 90) -> bytes | None:
    """The RL step breakdown as PNG bytes: one stacked bar per replica (generating, held, idle,
    finalizing, exporting) and one per trainer rank (training, sync, other, finalizing,
    exporting), in seconds. None when no process has anything to draw."""
    b = summary.breakdown
    rows: list[tuple[str, list[tuple[str, float | None]]]] = [
        (
            f"rollout {r.replica_id}",
            [
                ("generating", r.generating_s),
                ("held", r.held_s),
                ("idle", r.idle_s),
                ("held for the sync", _beyond(r.sync_held_s, r.finalizing_s)),
                ("finalizing", r.finalizing_s),
                ("exporting", r.exporting_s),
            ],
        )
        for r in b.replicas
    ]
    rows += [
        (
            f"trainer rank {t.rank}",
            [
                ("training", t.training_s),
                ("sync", t.sync_s),
                ("other", t.other_s),
                ("finalizing", t.finalizing_s),
                ("exporting", t.exporting_s),
            ],
        )
        for t in b.trainer
    ]
    if not any(v for _, parts in rows for _, v in parts):
        return None
    fig = Figure(figsize=(width_in, 1.4 + 0.45 * len(rows)), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for y, (_, parts) in enumerate(rows):
        left = 0.0
        for state, seconds in parts:
            if seconds:
                ax.barh(y, seconds, left=left, height=0.6, color=STATE_COLORS[state], edgecolor="white", linewidth=0.5)
                left += seconds
    ax.set_yticks(range(len(rows)), [name for name, _ in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("seconds (finalizing and exporting follow the window; exporting runs in the background)", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    ax.set_title(f"step {summary.step}: where each process's time went", fontsize=10)
    legend = [Patch(color=c, label=s) for s, c in STATE_COLORS.items()]
    return _png_with_legend(fig, ax, legend, below=0.2 + 0.4 / len(rows))


def _beyond(held: float | None, finalizing: float | None) -> float | None:
    """The sync's hold less the finalize that ran within it (drawn beside it, not twice)."""
    return None if held is None else max(0.0, held - (finalizing or 0.0))
