"""Render an HTML page with Debian's headless chromium and check the screenshot."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

CHROMIUM_INSTALL = "apt-get update && apt-get install -y chromium"
FORWARD_BLUE = np.array([0x3B, 0x75, 0xAF]) / 255
"""The timeline picture's forward-step colour (profiling/analysis/picture.py)."""


def screenshot(page: Path, png: Path, width: int = 1280, height: int = 1400) -> np.ndarray:
    """`page` rendered by headless chromium into `png`; returns its pixels (RGB floats in [0, 1]).
    Fails (never skips) without chromium: the report must be checked in a real browser."""
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail(
            f"chromium is not installed; the report test renders the page with it. Install it: {CHROMIUM_INSTALL}"
        )
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        proc = subprocess.run(
            [
                exe,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                f"--screenshot={png}",
                page.resolve().as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 0 and png.is_file(), (
        f"chromium failed ({proc.returncode}): {proc.stderr[-2000:]}"
    )
    return imread(png)[..., :3]


def assert_report_rendered(pixels: np.ndarray) -> None:
    """Not blank, and the timeline picture is there (its forward-step bars are on screen)."""
    not_white = (pixels < 0.95).any(axis=-1).mean()
    assert not_white > 0.02, f"the screenshot is (almost) blank: {not_white:.1%} non-white pixels"
    blue = (np.abs(pixels - FORWARD_BLUE) < 0.03).all(axis=-1).sum()
    assert blue > 50, f"the timeline picture is not on screen ({blue} forward-step pixels)"
