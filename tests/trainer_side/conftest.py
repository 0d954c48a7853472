"""Fixtures of the trainer-side tests (the session fixtures `ray_cluster` and `model_dir` come
from tests/conftest.py), and the quick start's main job, run once per session."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from . import quickstart
from .helpers import RAY_STARTUP_TIMEOUT, REPO_ROOT


@contextmanager
def _deployer(ray_cluster: int, model_dir: Path, base: Path) -> Iterator[Callable[..., object]]:
    from ray import serve
    from support.apps import deploy

    apps = []

    def _deploy(name: str, **app_args):
        app = deploy(ray_cluster, model_dir, base / name, name, **app_args)
        apps.append(app)
        return app

    try:
        yield _deploy
    finally:
        for app in apps:
            serve.delete(app.name)


@pytest.fixture
def deployed(ray_cluster, model_dir, tmp_path) -> Iterator[Callable[..., object]]:
    """Deploy an app under /<name> on the shared cluster (support/apps.py's deploy); deleted after the test."""
    with _deployer(ray_cluster, model_dir, tmp_path) as deploy:
        yield deploy


@pytest.fixture(scope="module")
def module_deployed(ray_cluster, model_dir, tmp_path_factory) -> Iterator[Callable[..., object]]:
    """Like `deployed`, for module-scoped fixtures; deleted after the module."""
    with _deployer(ray_cluster, model_dir, tmp_path_factory.mktemp("apps")) as deploy:
        yield deploy


@pytest.fixture(scope="session")
def quickstart_lock() -> Iterator[None]:
    """One quick-start run at a time on this machine (the repo's outputs/, port 8000)."""
    with quickstart.exclusive():
        yield


@pytest.fixture(scope="session")
def quickstart_main_job(quickstart_lock) -> Iterator[quickstart.BlockRun]:
    """docs/quickstart.md's main-job block (README.md's first command), run as written from the
    repo root, once per session: test_quickstart.py and test_main_job.py both check this run.
    Whatever the repo's outputs/profile and outputs/weights held is set aside meanwhile and put
    back at the end of the session."""
    outputs = REPO_ROOT / "outputs"
    with quickstart.set_aside(outputs / "profile", outputs / "weights"):
        run = quickstart.run(quickstart.block("main-job"), quickstart.MAIN_JOB_TIMEOUT_S)
        if run.returncode != 0 and RAY_STARTUP_TIMEOUT in run.stderr:
            # An environment failure before the job did anything: clear its leftovers, run again.
            for leftover in (outputs / "profile", outputs / "weights"):
                shutil.rmtree(leftover, ignore_errors=True)
            run = quickstart.run(quickstart.block("main-job"), quickstart.MAIN_JOB_TIMEOUT_S)
        yield run
