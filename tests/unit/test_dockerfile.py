"""The Dockerfile, read (no Docker engine here, docs/operations.md#docker-gpu-vllm): the app runs
as a non-root user under an init process that reaps Ray's children, and the health check probes
readiness, not liveness."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"


def image_problems(dockerfile: str) -> list[str]:
    """What in the Dockerfile breaks the image's contract of docs/operations.md."""
    problems = []
    users = re.findall(r"^USER\s+(\S+)", dockerfile, re.M)
    if not users or users[-1] in {"root", "0"} or users[-1].startswith(("root:", "0:")):
        problems.append(f"the image runs as root (last USER: {users[-1] if users else 'none'})")
    entry = re.findall(r"^ENTRYPOINT\s+(.+)$", dockerfile, re.M)
    if not entry or "tini" not in entry[-1]:
        problems.append(f"PID 1 is not tini (ENTRYPOINT: {entry[-1] if entry else 'none'})")
    elif not re.search(r"apt-get install[^\n]*\btini\b", dockerfile):
        problems.append("the entrypoint names tini but nothing installs it")
    health = re.search(r"^HEALTHCHECK[^\n]*\\\n\s*CMD (.+)$", dockerfile, re.M)
    if health is None or "/ready" not in health.group(1):
        problems.append("the health check does not probe /ready")
    if not re.search(r"chown[^\n]*\brollout\b[^\n]*/data", dockerfile):
        problems.append("/data is not handed to the image's user")
    return problems


def test_the_image_runs_unprivileged_under_tini_and_probes_readiness():
    assert image_problems(DOCKERFILE.read_text()) == []


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: d.replace("USER rollout", "USER root"), "runs as root"),
        (lambda d: d.replace("USER rollout\n", ""), "runs as root"),
        (lambda d: re.sub(r"^ENTRYPOINT .*$", "ENTRYPOINT []", d, flags=re.M), "PID 1 is not tini"),
        (lambda d: d.replace("--no-install-recommends tini", "--no-install-recommends curl"), "nothing installs it"),
        (lambda d: d.replace("8000/ready", "8000/health"), "does not probe /ready"),
        (lambda d: d.replace("chown -R rollout:rollout /data", "true"), "not handed"),
    ],
)
def test_a_broken_image_is_found(edit, expected):
    problems = image_problems(edit(DOCKERFILE.read_text()))
    assert any(expected in p for p in problems), problems
