"""verl 0.9.1's profiler blocks as written (docs/configuration.md#verls-blocks): the checked-in
copies under tests/support/verl/ load unchanged, what this project implements takes effect, what
it does not is named by one warning per key, unknown keys are still refused, and the finish hook
runs a real shell command."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from profiling.schedule import StepSchedule
from trainer.config import ConfigError, TrainerConfig, load_config
from trainer.finish_hook import run_finish_hook

VERL = Path(__file__).resolve().parents[1] / "support" / "verl"
GLOBAL_BLOCK = VERL / "ppo_trainer.global_profiler.yaml"
ACTOR_BLOCK = VERL / "actor.profiler.yaml"
# sha256 of each copy's body as it is in the verl==0.9.1 wheel (the line ranges its header names).
VERBATIM_SHA256 = {
    GLOBAL_BLOCK: "1b6053b7737af9444325ae8c76989b958b720f6daf484939c6b0b8086bd82eda",
    ACTOR_BLOCK: "83df112ef40d45139a05e1ebc2e9d34f511b1610d41fe99c86727deb15231ee2",
}


def verl_config(tmp_path: Path, *, actor: bool = False, **global_keys: Any) -> Path:
    """A trainer config file: verl's global_profiler block as written, with `global_keys`
    replaced (as a user edits `tool:` and `steps:` in it), and verl's actor profiler block."""
    text = GLOBAL_BLOCK.read_text()
    for key, value in global_keys.items():
        old = f"\n  {key}: null\n"  # global_profiler's own key, not a tool block's
        assert text.count(old) == 1
        text = text.replace(old, f"\n  {key}: {json.dumps(value)}\n")
    if actor:
        text += "\n" + ACTOR_BLOCK.read_text()
    path = tmp_path / "trainer.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("copy", sorted(VERBATIM_SHA256), ids=lambda p: p.name)
def test_the_checked_in_copies_are_verls_unchanged(copy):
    header, sep, body = copy.read_text().partition("do not edit below this line.\n")
    assert sep and "verl==0.9.1" in header and "Apache License, Version 2.0" in header
    assert hashlib.sha256(body.encode()).hexdigest() == VERBATIM_SHA256[copy]


def test_verls_block_as_written_loads_and_profiles_nothing(tmp_path):
    cfg = load_config(verl_config(tmp_path))
    g = cfg.global_profiler
    assert g.tool is None and g.steps is None and not g.profiles
    assert g.target == "verl.utils.profiler.ProfilerConfig"
    assert g.global_tool_config.nsys is not None and g.global_tool_config.nsys.worker_nsight_options
    assert cfg.notes() == [] and cfg.finish_hook() is None


def test_verls_block_with_a_tool_and_steps_profiles_them_without_a_warning(tmp_path):
    cfg = load_config(verl_config(tmp_path, tool="torch", steps=[1, 2]))
    assert cfg.global_profiler.profiles
    assert StepSchedule.from_config(cfg.global_profiler).windows == [(1,), (2,)]
    assert cfg.notes() == [], "verl's defaults ask for nothing this project lacks"
    again = TrainerConfig.model_validate_json(cfg.model_dump_json(exclude_unset=True))  # how ranks get it
    assert again.global_profiler == cfg.global_profiler


def test_steps_without_a_tool_is_off_and_says_how_to_turn_it_on():
    cfg = load_config(None, ["global_profiler.steps=[1, 2]"])
    assert not cfg.global_profiler.profiles
    assert StepSchedule.from_config(cfg.global_profiler).windows == []
    (note,) = cfg.notes()
    assert "global_profiler.tool is null: nothing is profiled" in note
    assert "set global_profiler.tool: torch" in note


def test_verls_actor_block_resolves_its_references_and_its_enable_is_verls(tmp_path):
    path = verl_config(tmp_path, tool="torch", steps=[1, 2], actor=True)
    cfg = load_config(path)
    p = cfg.profiler
    assert p.tool == "torch" and p.save_path == "outputs/profile", "${oc.select:global_profiler.*} read"
    assert p.tool_config.nsys is not None and p.tool_config.nsys.discrete is False
    assert p.finish_hook_ranks == [] and p.tool_config.torch is not None
    assert p.selected(1) == [], "verl's actor block says enable: False: the trainer ranks do not record"
    assert cfg.notes() == []
    enabled = load_config(path, ["profiler.enable=true", "trainer.world_size=2", "trainer.mini_batch_size=4"])
    assert enabled.profiler.selected(2) == [0], "verl's ranks: [] is rank 0"
    # A reference to a key the config does not set gives its default (OmegaConf's oc.select).
    alone = load_config(None, ["profiler.tool=${oc.select:global_profiler.tool,null}"])
    assert alone.profiler.tool == "torch" and alone.global_profiler.tool is None


def test_torch_contents_switch_on_what_they_name():
    cfg = load_config(
        None,
        [
            "global_profiler.tool=torch",
            "global_profiler.steps=[1]",
            "global_profiler.global_tool_config.torch.contents=[shapes]",
            "profiler.tool_config.torch.contents=[cuda, stack, memory]",
        ],
    )
    o = cfg.window_options()
    assert o.activities == ["cpu", "cuda"] and o.record_shapes and o.with_stack and o.with_memory
    plain = load_config(None, ["global_profiler.tool=torch", "profiler.tool_config.torch.contents=[]"])
    assert plain.window_options() == plain.profiler.window_options(), "empty contents: our keys decide"


def test_npu_block_applies_to_profiler_npu():
    cfg = load_config(
        None,
        [
            "global_profiler.tool=npu",
            "global_profiler.global_tool_config.npu.level=level1",
            "profiler.tool_config.npu.contents=[memory]",
            "profiler.tool_config.npu.analysis=false",
        ],
    )
    npu = cfg.window_options().npu
    assert npu.level == "level1" and npu.contents == ["memory"] and npu.analysis is False


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (
            ["global_profiler.global_tool_config.torch.discrete=true"],
            "global_profiler.global_tool_config.torch.discrete",
        ),
        (["profiler.tool_config.torch.schedule.active=2"], "profiler.tool_config.torch.schedule.active"),
        (["profiler.tool_config.torch.profile_token_start=4"], "profiler.tool_config.torch.profile_token_start"),
        (["global_profiler.relocate_results=true"], "global_profiler.relocate_results"),
        (["profiler.save_path=/elsewhere"], "profiler.save_path"),
        (
            [
                "global_profiler.tool=nsys",
                "global_profiler.global_tool_config.nsys.worker_nsight_options={trace: cuda}",
            ],
            "global_profiler.global_tool_config.nsys.worker_nsight_options",
        ),
    ],
)
def test_a_verl_key_not_implemented_here_is_accepted_with_one_warning_naming_it(overrides, key):
    base = ["global_profiler.tool=torch", "global_profiler.steps=[1]"]
    cfg = load_config(None, [*base, *overrides])
    notes = cfg.notes()
    assert len(notes) == 1 and notes[0].startswith(key + " "), notes
    assert "no effect" in notes[0] or "not applied" in notes[0]


def test_a_tools_block_is_read_only_with_that_tool_as_in_verl():
    cfg = load_config(
        None,
        [
            "global_profiler.tool=torch",
            "global_profiler.steps=[1]",
            "global_profiler.global_tool_config.nsys.discrete=true",
            "profiler.tool_config.npu.contents=[memory]",
        ],
    )
    assert cfg.notes() == [] and cfg.window_options().npu.contents == []


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("global_profiler.bogus=1", "unknown key 'global_profiler.bogus'"),
        (
            "global_profiler.global_tool_config.torch.bogus=1",
            "unknown key 'global_profiler.global_tool_config.torch.bogus'",
        ),
        ("global_profiler.global_tool_config.bogus={}", "unknown key 'global_profiler.global_tool_config.bogus'"),
        ("profiler.tool_config.torch.contents=[gpu]", "'profiler.tool_config.torch.contents.0'"),
        ("profiler.discrete=true", "unknown key 'profiler.discrete'"),
    ],
)
def test_keys_verl_does_not_have_are_still_refused(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.").replace("[", r"\[")):
        load_config(None, [override])


@pytest.mark.parametrize("tool", ["torch_memory", "precision_debugger"])
def test_verls_tools_that_are_not_here_are_refused_naming_the_alternative(tool):
    with pytest.raises(
        ConfigError, match=rf"tool '{tool}' is one of verl's but not implemented here.*set tool to torch"
    ):
        load_config(None, [f"global_profiler.tool={tool}"])


def test_an_interpolation_the_loader_does_not_resolve_is_refused_naming_the_key():
    with pytest.raises(
        ConfigError, match=r"'global_profiler\.save_path': '\$\{now:%H\}' is an OmegaConf interpolation"
    ):
        load_config(None, ["global_profiler.save_path=${now:%H}"])


# -- the finish hook -----------------------------------------------------------------------------


def hook_config(tmp_path: Path, *overrides: str) -> TrainerConfig:
    return load_config(
        None,
        [
            "global_profiler.tool=torch",
            "global_profiler.steps=[1, 2]",
            f"global_profiler.save_path={tmp_path / 'profile'}",
            f"global_profiler.finish_hook_cmd=env | grep ^VERL_ | sort > {tmp_path}/hook_$VERL_PROFILE_RANK.env",
            *overrides,
        ],
    )


def read_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def test_the_hook_runs_once_for_the_profiled_rank_with_verls_environment(tmp_path):
    import os

    hook = hook_config(tmp_path).finish_hook()
    assert hook is not None and hook.ranks == [0], "unset selection: the profiled ranks"
    lines: list[str] = []
    assert run_finish_hook(hook, lines.append) == []
    assert sorted(p.name for p in tmp_path.glob("hook_*")) == ["hook_0.env"]
    assert read_env(tmp_path / "hook_0.env") == {
        "VERL_PROFILE_PID": str(os.getpid()),
        "VERL_PROFILE_RANK": "0",
        "VERL_PROFILE_ROLE": "trainer",
        "VERL_PROFILE_SAVE_PATH": str(tmp_path / "profile"),
        "VERL_PROFILE_TOOL": "torch",
    }
    assert any("rank 0: running" in line for line in lines)


def test_the_hook_ranks_follow_verls_selection(tmp_path):
    two = ["trainer.world_size=2", "trainer.mini_batch_size=4"]
    assert hook_config(tmp_path, *two, "global_profiler.finish_hook_all_ranks=true").finish_hook().ranks == [0, 1]  # type: ignore[union-attr]
    assert hook_config(tmp_path, *two, "global_profiler.finish_hook_ranks=[1]").finish_hook().ranks == [1]  # type: ignore[union-attr]
    assert hook_config(tmp_path, *two, "profiler.ranks=[1]").finish_hook().ranks == [1]  # type: ignore[union-attr]
    assert hook_config(tmp_path, *two, "profiler.finish_hook_ranks=[0, 1]").finish_hook().ranks == [0, 1]  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=r"global_profiler\.finish_hook_ranks \[3\] names rank\(s\) \[3\]"):
        hook_config(tmp_path, *two, "global_profiler.finish_hook_ranks=[3]")
    nsys = hook_config(tmp_path, "global_profiler.tool=nsys").finish_hook()
    assert nsys is not None and run_finish_hook(nsys, lambda _: None) == []
    assert read_env(tmp_path / "hook_0.env")["VERL_PROFILE_RAY_NSIGHT_DIR"] == "/tmp/ray/session_latest/logs/nsight"


def test_no_hook_without_profiling(tmp_path):
    assert hook_config(tmp_path, "global_profiler.tool=null").finish_hook() is None


def test_a_failing_hook_is_logged_and_does_not_raise(tmp_path, caplog):
    cfg = hook_config(tmp_path, "global_profiler.finish_hook_cmd=echo uploading; exit 3")
    hook = cfg.finish_hook()
    assert hook is not None
    lines: list[str] = []
    with caplog.at_level(logging.ERROR, logger="trainer.finish_hook"):
        assert run_finish_hook(hook, lines.append) == [0]
    assert "[finish_hook] rank 0: uploading" in lines
    (record,) = caplog.records
    assert "finish_hook_cmd exited with status 3 for rank 0" in record.getMessage()


# -- the app's global_profiler ---------------------------------------------------------------------


def verl_app_block(**keys: Any) -> dict[str, Any]:
    block: dict[str, Any] = yaml.safe_load(GLOBAL_BLOCK.read_text())["global_profiler"]
    return {**block, **keys}


def test_the_app_takes_verls_block_as_written():
    from serve_app.config import AppArgs

    args = AppArgs(global_profiler=verl_app_block())
    assert args.global_profiler is not None and not args.global_profiler.drives
    assert args.notes() == [
        "args.global_profiler.steps is null: the app profiles no step itself; list the steps or remove the block"
    ]
    args = AppArgs(global_profiler=verl_app_block(tool="torch", steps=[1, 2]), save_path="outputs/profile")
    assert args.global_profiler is not None and args.global_profiler.drives and args.notes() == []


def test_the_apps_block_with_steps_and_tool_null_is_off_with_a_warning():
    from serve_app.config import AppArgs

    args = AppArgs(global_profiler=verl_app_block(steps=[1, 2]))
    assert args.global_profiler is not None and not args.global_profiler.drives
    (note,) = args.notes()
    assert "args.global_profiler.tool is null: the app profiles no step" in note
    assert AppArgs(global_profiler={"steps": [1, 2]}).global_profiler.drives, "tool left out: the app's profiler.tool"  # type: ignore[union-attr]


def test_the_apps_block_must_name_the_apps_tool_and_names_what_it_does_not_run():
    from pydantic import ValidationError

    from serve_app.config import AppArgs

    with pytest.raises(ValidationError, match=r"global_profiler\.tool is 'nsys' but profiler\.tool is 'torch'"):
        AppArgs(global_profiler=verl_app_block(tool="nsys", steps=[1]))
    args = AppArgs(
        global_profiler=verl_app_block(
            tool="torch",
            steps=[1],
            save_path=None,
            finish_hook_cmd="true",
            global_tool_config={"torch": {"contents": ["cuda"]}},
        )
    )
    notes = args.notes()
    assert [n.split(" ")[0] for n in notes] == [
        "args.global_profiler.finish_hook_cmd",
        "args.global_profiler.global_tool_config.torch",
    ], notes
