"""Draw docs/images/step_timeline.png: what step k means, for steps [1, 2, 5].

    python docs/figures/step_timeline.py [--out PATH]

One trainer and two rollout replicas over weight versions 0..5. At the sync publishing version k
the trainer calls stop (step k, if profiled), update_weights (version k), start (step k+1, if
profiled); the trace labelled step k holds the trainer's mini-batches producing version k and
the replicas' forward passes on weights k-1. The times are illustrative, not measured.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

STEPS = (1, 2, 5)
VERSIONS = 5
PERIOD = 12.0  # time between two weight syncs
STOP, UPDATE, START = 1.0, 2.0, 1.0  # duration of each control call (stretched to be readable)
MINI_BATCHES = 2  # trigger_parameter_sync_step
OUT = Path(__file__).resolve().parents[1] / "images" / "step_timeline.png"
VERSION_COLOURS = ["#c6dbef", "#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c"]
ROWS = {"trainer": 2.4, "replica r0": 1.0, "replica r1": 0.0}
CALL_COLOURS = {"stop": "#d62728", "update": "#7f7f7f", "start": "#2ca02c"}


def sync_plan(k: int) -> tuple[bool, bool]:
    """(stop step k?, start step k+1?) at the sync publishing version k (discrete windows)."""
    return k in STEPS, k + 1 in STEPS


def draw(out: Path) -> None:
    """Render the figure into `out` (PNG)."""
    fig, ax = plt.subplots(figsize=(13, 5.2), dpi=110)
    rollout_rows = [y for name, y in ROWS.items() if name != "trainer"]
    # Sync phases: when each call runs, and when replicas hold engine steps (pause).
    calls: list[tuple[str, float, float, int]] = []  # (call, begin, end, step or version)
    holds: list[tuple[float, float]] = []
    update_at: dict[int, float] = {0: 0.0}
    window_open: dict[int, float] = {1: 0.0} if 1 in STEPS else {}
    windows: list[tuple[int, float, float]] = []
    trainer_free: dict[int, float] = {1: 0.0}
    for k in range(1, VERSIONS + 1):
        t = k * PERIOD
        stop, start = sync_plan(k)
        hold_from = None
        if stop:
            calls.append(("stop", t, t + STOP, k))
            windows.append((k, window_open.pop(k), t))
            hold_from, t = t, t + STOP
        calls.append(("update", t, t + UPDATE, k))
        update_at[k] = t + UPDATE
        if start:
            hold_from = t + UPDATE if hold_from is None else hold_from  # update(resume=false) keeps the hold
        t += UPDATE
        if start:
            calls.append(("start", t, t + START, k + 1))
            window_open[k + 1] = t + START
            t += START
        if hold_from is not None:
            holds.append((hold_from, t))
        trainer_free[k + 1] = t
    end = (VERSIONS + 0.6) * PERIOD

    # Rollout: forward passes on weights v (colour), gaps while engine steps are held.
    for y in rollout_rows:
        for v in range(VERSIONS + 1):
            begin, finish = update_at[v], update_at.get(v + 1, end)
            ax.add_patch(Rectangle((begin, y - 0.25), finish - begin, 0.5, color=VERSION_COLOURS[v], lw=0))
            ax.text((begin + finish) / 2, y, f"weights v{v}", ha="center", va="center", fontsize=8)
        for begin, finish in holds:
            ax.add_patch(Rectangle((begin, y - 0.25), finish - begin, 0.5, fc="white", ec="#555", hatch="///", lw=0.5))
    # Trainer: the mini-batches producing version k, between syncs.
    for k in range(1, VERSIONS + 1):
        begin, finish = trainer_free[k] + 0.4, k * PERIOD - 0.4
        width = (finish - begin) / MINI_BATCHES
        for i in range(MINI_BATCHES):
            ax.add_patch(
                Rectangle((begin + i * width + 0.15, ROWS["trainer"] - 0.25), width - 0.3, 0.5, color="#fdae6b", lw=0)
            )
        ax.text(
            (begin + finish) / 2, ROWS["trainer"] + 0.02, f"mini-batches → v{k}", ha="center", va="center", fontsize=8
        )
        if k in STEPS:
            ax.add_patch(
                Rectangle(
                    (begin - 0.2, ROWS["trainer"] - 0.36), finish - begin + 0.4, 0.72, fill=False, ec="#d62728", lw=1.8
                )
            )
            ax.text(
                (begin + finish) / 2,
                ROWS["trainer"] + 0.5,
                f"trace step {k}",
                ha="center",
                color="#d62728",
                fontsize=9,
                weight="bold",
            )
    # Rollout trace windows: from the start of step k to its stop.
    for k, begin, finish in windows:
        for y in rollout_rows:
            ax.add_patch(Rectangle((begin, y - 0.36), finish - begin, 0.72, fill=False, ec="#d62728", lw=1.8))
        ax.text(
            (begin + finish) / 2,
            rollout_rows[0] + 0.5,
            f"trace step {k} (weights v{k - 1})",
            ha="center",
            color="#d62728",
            fontsize=9,
            weight="bold",
        )
    # The calls of each sync, on a row of their own, and the sync instants across every row.
    for call, begin, finish, n in calls:
        ax.add_patch(Rectangle((begin, -0.95), finish - begin, 0.35, color=CALL_COLOURS[call], lw=0))
        label = f"{call} {n}" if call != "update" else f"update v{n}"
        below = {"stop": 0.0, "update": 0.25, "start": 0.5}[call]  # staggered: the calls are short
        ax.text((begin + finish) / 2, -1.02 - below, label, ha="center", va="top", fontsize=7)
    for k in range(1, VERSIONS + 1):
        ax.axvline(k * PERIOD, color="#999", lw=0.8, ls=":", zorder=0)
        ax.text(k * PERIOD, 3.35, f"sync publishing v{k}", ha="center", fontsize=8, color="#555")
    ax.text(0, 3.35, "start 1 (training start)", ha="left", fontsize=8, color="#555")

    ax.set_xlim(-1, end)
    ax.set_ylim(-1.7, 3.6)
    ax.set_yticks([*ROWS.values(), -0.78], [*ROWS.keys(), "trainer's calls"])
    ax.set_xticks([])
    ax.set_xlabel("time →  (steps profiled: 1, 2, 5; discrete windows)")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.legend(
        handles=[
            Patch(fc="white", ec="#d62728", lw=1.8, label="trace window labelled step k"),
            Patch(fc="white", ec="#555", hatch="///", label="engine steps held (pause)"),
            *(Patch(color=c, label=name) for name, c in CALL_COLOURS.items()),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.08),
        ncol=5,
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, metadata={"Software": None})
    plt.close(fig)


def main() -> None:
    """Parse `--out` and draw."""
    parser = argparse.ArgumentParser(description="Draw the step-semantics timeline.")
    parser.add_argument("--out", type=Path, default=OUT, help="PNG to write (default: %(default)s)")
    draw(parser.parse_args().out)


if __name__ == "__main__":
    main()
