"""Shared fixtures: a trace store, session specs, a private local Ray cluster (never a stale one)
and a real Serve app (support/apps.py deploys it; tests deploy their own with it too)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.apps import ServeApp, deployed

from profiling.config import ProfileOptions
from profiling.session import SessionSpec
from profiling.store import TraceStore

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # single machine: bind 127.0.0.1
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def store(tmp_path: Path) -> TraceStore:
    """A trace store under the test's temporary directory (no background merges: a test that
    wants them builds its own `TraceStore(..., merge_on_complete=True)`)."""
    return TraceStore(tmp_path / "profile")


@pytest.fixture(scope="session")
def spec() -> Callable[..., SessionSpec]:
    """Builds a SessionSpec: `spec(step=1, steps=None, tag=None, late_start=False, **options)`.

    `steps` defaults to `[step]`; `options` are ProfileOptions fields (their defaults otherwise).
    Session-scoped (it holds no state) so module-scoped fixtures can use it too."""

    def make(
        step: int = 1,
        steps: list[int] | None = None,
        tag: str | None = None,
        late_start: bool = False,
        **options: object,
    ) -> SessionSpec:
        return SessionSpec(
            step=step,
            steps=[step] if steps is None else steps,
            options=ProfileOptions(**options),
            tag=tag,
            late_start=late_start,
        )

    return make


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[int]:
    """A fresh local Ray + Serve on a free loopback port (yielded), shut down at the end."""
    from trainer.local_app import local_cluster

    with local_cluster() as port:
        yield port


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The tiny model, built once per run in a private cache; replicas load it by path."""
    from serve_app.tiny_model import ensure_tiny_model

    return ensure_tiny_model(cache_dir=tmp_path_factory.mktemp("model-cache"))


@pytest.fixture(scope="module")
def app(ray_cluster, model_dir, tmp_path_factory) -> Iterator[ServeApp]:
    """A 2-replica app on the embedded engine, shared by one test module."""
    with deployed(ray_cluster, model_dir, tmp_path_factory.mktemp("app"), "rollout") as served:
        yield served


_REPORT_SECTIONS = pytest.StashKey[dict[str, list[str]]]()


@pytest.fixture
def report_section(request) -> Callable[[str], Callable[..., None]]:
    """`say = report_section(title)`: lines said go into a section of pytest's terminal summary,
    shown on every run (not only on failure, as captured output is), e.g. measured figures."""

    def open_section(title: str) -> Callable[..., None]:
        lines = request.config.stash.setdefault(_REPORT_SECTIONS, {}).setdefault(title, [])

        def say(*parts: object) -> None:
            lines.extend(" ".join(map(str, parts)).strip("\n").splitlines())

        return say

    return open_section


def pytest_terminal_summary(terminalreporter, config) -> None:
    for title, lines in config.stash.get(_REPORT_SECTIONS, {}).items():
        terminalreporter.section(title)
        for line in lines:
            terminalreporter.write_line(line)

