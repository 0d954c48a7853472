"""Fixtures of the trainer-side tests (the session fixtures `ray_cluster` and `model_dir` come
from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def _deployer(ray_cluster: int, model_dir: Path, base: Path) -> Iterator[Callable[..., object]]:
    from ray import serve

    from conftest import deploy

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
    """Deploy an app under /<name> on the shared cluster (conftest.deploy); deleted after the test."""
    with _deployer(ray_cluster, model_dir, tmp_path) as deploy:
        yield deploy


@pytest.fixture(scope="module")
def module_deployed(ray_cluster, model_dir, tmp_path_factory) -> Iterator[Callable[..., object]]:
    """Like `deployed`, for module-scoped fixtures; deleted after the module."""
    with _deployer(ray_cluster, model_dir, tmp_path_factory.mktemp("apps")) as deploy:
        yield deploy
