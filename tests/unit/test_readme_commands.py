"""README.md's two set-up commands are the ones CI and the docs rely on."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())[:2]


def test_readme_starts_with_the_main_job_and_the_test_command():
    main_job, tests = _readme_commands()
    assert main_job.endswith("python -m trainer --config config/trainer.yaml")
    assert tests.endswith("python -m pytest")


def test_ci_runs_the_readme_test_command_verbatim():
    _, tests = _readme_commands()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci, "the test command in .ci/run must be the README's, verbatim"
