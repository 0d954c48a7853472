"""The HTML reports: self-contained pages with the timeline picture, rendered by a real browser."""

from __future__ import annotations

import base64
import re

import numpy as np

from profiling.analysis.picture import STATE_COLORS
from profiling.analysis.report import write_reports
from profiling.step_stats import Staleness

from .browser import assert_report_rendered, screenshot
from .synth import Ev, Proc, forward, write_step
from .test_summary import stats, with_records

MS = 1_000_000


def write_steps(store) -> None:
    for k in (1, 2):
        procs = [
            Proc(
                "rollout",
                r,
                os_pid=20 + i,
                window=(i * MS, 40 * MS),
                weight_version=k - 1,
                events=[
                    e
                    for j in range(8)
                    for e in forward(j, k, k - 1, (2 + 4 * j + i) * MS, 2500.0, [("aten::mm", 900.0)])
                ]
                + [Ev(f"weight_update version={k}", 36 * MS, 1500.0, cat="user_annotation")],
            )
            for i, r in enumerate(("r0", "r1"))
        ]
        procs.append(
            Proc(
                "trainer",
                "0",
                os_pid=5,
                window=(0, 38 * MS),
                events=forward(0, k, k - 1, 3 * MS, 20_000.0, [("aten::addmm", 8000.0)]),
            )
        )
        write_step(store, k, procs, sync_at_ns=41 * MS, sync=(0.004, 0.012, 0.003))
        with_records(
            store,
            k,
            {
                "r0": stats(0.030, 0.004, 0.006, 12, 190, [0.021], k - 1),
                "r1": stats(0.020, 0.004, 0.016, 6, 96, [0.033], k - 1),
            },
            Staleness().plus([0, 1, 1]),
        )


def test_reports_are_self_contained(store):
    write_steps(store)
    result = write_reports(store)
    assert set(result.pages) == {1, 2} and result.index == store.root / "index.html"
    for k, page in result.pages.items():
        html = page.read_text()
        assert f"<h1>Step {k}</h1>" in html
        pngs = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
        assert len(pngs) == 2  # the timeline and the RL step breakdown
        assert all(base64.b64decode(png).startswith(b"\x89PNG") for png in pngs)
        # nothing loaded from anywhere: no external src/href, no scripts, no @import/url()
        assert (
            not re.search(r'(src|href)="(https?:)?//', html) and "<script" not in html and "url(" not in html
        )
        for text in ("rollout/r0", "trainer/rank_0", "aten::mm", "start spread", "stop step", "clock_sync"):
            assert text in html, text
        # the RL step breakdown: the replicas' states, imbalance, long tail, versions, staleness
        for text in (
            "RL step breakdown",
            "generating s",
            "held s",
            "1.200",
            "Slowest requests",
            "0.033",
            f"v{k - 1}: 18",
            "0: 1, 1: 2",
        ):
            assert text in html, text
    index = result.index.read_text()
    assert 'href="step_1/report.html"' in index and 'href="step_2/report.html"' in index


def test_report_renders_in_headless_chromium(store, tmp_path):
    write_steps(store)
    result = write_reports(store)
    pixels = screenshot(result.pages[1], tmp_path / "step1.png")
    assert_report_rendered(pixels)
    held_rgb = np.array([int(STATE_COLORS["held"][i : i + 2], 16) for i in (1, 3, 5)]) / 255
    held = (abs(pixels - held_rgb) < 0.03).all(axis=-1).sum()
    assert held > 50, f"the breakdown picture is not on screen ({held} pixels of its 'held' colour)"
    index = screenshot(result.index, tmp_path / "index.png", height=400)
    assert (index < 0.95).any(axis=-1).mean() > 0.005, "the index page rendered blank"
