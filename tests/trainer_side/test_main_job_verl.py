"""The main job with verl 0.9.1's `global_profiler` block pasted unchanged into config/trainer.yaml
(the checked-in copy, tests/support/verl/), only its `tool: torch` and `steps: [1, 2]` edited, as a
verl user would: it profiles steps 1 and 2, warns of nothing, and runs verl's finish hook once,
after both steps are complete (docs/configuration.md#verls-blocks, docs/trainer.md#finish-hook)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from .helpers import REPO_ROOT
from .test_main_job import check_step, run_cli

VERL_BLOCK = REPO_ROOT / "tests" / "support" / "verl" / "ppo_trainer.global_profiler.yaml"
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def verl_trainer_config(tmp: Path) -> Path:
    """config/trainer.yaml with its global_profiler replaced by verl's block as written, but for
    the two lines a user edits."""
    ours = yaml.safe_load((REPO_ROOT / "config" / "trainer.yaml").read_text())
    del ours["global_profiler"]
    block = VERL_BLOCK.read_text()
    for old, new in (("\n  tool: null\n", "\n  tool: torch\n"), ("\n  steps: null\n", "\n  steps: [1, 2]\n")):
        assert block.count(old) == 1
        block = block.replace(old, new)
    path = tmp / "trainer.verl.yaml"
    path.write_text(block + "\n" + yaml.safe_dump(ours, sort_keys=False))
    return path


def test_main_job_with_verls_block_profiles_steps_1_and_2_and_runs_the_finish_hook(tmp_path):
    seen, env = tmp_path / "hook_manifests.json", tmp_path / "hook.env"
    hook = (
        f'cat "$VERL_PROFILE_SAVE_PATH/step_1/manifest.json" "$VERL_PROFILE_SAVE_PATH/step_2/manifest.json" >> {seen}; '
        f"env | grep ^VERL_PROFILE_ | sort >> {env}"
    )
    run = run_cli(
        tmp_path,
        "trainer.total_versions=3",
        f"global_profiler.finish_hook_cmd={json.dumps(hook)}",
        config=str(verl_trainer_config(tmp_path)),
    )
    assert run.returncode == 0, run.log
    assert sorted(p.name for p in run.profile.glob("step_*")) == ["step_1", "step_2"], run.log
    for k in (1, 2):
        check_step(run, k)
    ours = [line for line in run.stderr.splitlines() if line.startswith(("WARNING:trainer", "WARNING:serve_app"))]
    assert not ours, f"verl's block as written asks for nothing missing here: {ours}"
    # Once, after both steps were complete: the manifests it read are the final ones.
    decoder, text, manifests = json.JSONDecoder(), seen.read_text(), []
    while text.strip():
        m, end = decoder.raw_decode(text.strip())
        manifests.append(m)
        text = text.strip()[end:]
    assert [(m["step"], m["status"]) for m in manifests] == [(1, "complete"), (2, "complete")], manifests
    hook_env = dict(line.split("=", 1) for line in env.read_text().splitlines())
    assert {k: hook_env[k] for k in ("VERL_PROFILE_RANK", "VERL_PROFILE_ROLE", "VERL_PROFILE_TOOL")} == {
        "VERL_PROFILE_RANK": "0",
        "VERL_PROFILE_ROLE": "trainer",
        "VERL_PROFILE_TOOL": "torch",
    }
    assert Path(hook_env["VERL_PROFILE_SAVE_PATH"]) == run.profile
    assert run.stdout.count("[finish_hook] rank 0: running") == 1, run.log
