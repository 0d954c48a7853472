"""Config for the profiler tools: tool npu/nsys accepted, `profiler.npu` validated strictly."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from profiling.config import GlobalProfilerConfig, NpuOptions, ProfileOptions, describe_validation_error


def error_of(fn) -> ValidationError:
    with pytest.raises(ValidationError) as ei:
        fn()
    return ei.value


@pytest.mark.parametrize("tool", ["torch", "npu", "nsys"])
def test_tools_accepted(tool):
    assert ProfileOptions(tool=tool).tool == tool
    assert GlobalProfilerConfig(tool=tool, steps=[1]).tool == tool
    assert ProfileOptions().merged(tool=tool).tool == tool


@pytest.mark.parametrize("tool", ["Torch", "npu2", "nsight", "torch_memory", ""])
def test_other_tools_rejected(tool):
    err = error_of(lambda: ProfileOptions.model_validate({"tool": tool}))
    assert describe_validation_error(err, "profiler").startswith("'profiler.tool':")


def test_npu_defaults():
    npu = ProfileOptions().npu
    assert npu == NpuOptions()
    assert npu.contents == [] and npu.level == "level0" and npu.analysis is True
    assert npu.aic_metrics is None and npu.export_type == "text" and npu.data_simplification is True


def test_npu_verl_keys_accepted():
    o = ProfileOptions.model_validate(
        {
            "tool": "npu",
            "npu": {
                "contents": ["npu", "cpu", "memory", "shapes", "module", "stack", "npu"],
                "level": "level2",
                "analysis": False,
                "aic_metrics": "MemoryAccess",
                "export_type": "db",
            },
        }
    )
    assert o.npu.contents == ["npu", "cpu", "memory", "shapes", "module", "stack"]  # deduplicated
    assert (o.npu.level, o.npu.analysis) == ("level2", False)
    assert (o.npu.aic_metrics, o.npu.export_type) == ("MemoryAccess", "db")


def test_verl_discrete_key_is_refused_with_the_reason():
    """verl's `discrete` would do nothing here: a key that does nothing is an error, not ignored."""
    err = error_of(lambda: ProfileOptions.model_validate({"tool": "npu", "npu": {"discrete": True}}))
    msg = describe_validation_error(err, "profiler")
    assert msg.startswith("'profiler.npu': discrete") and "remove the key" in msg, msg


@pytest.mark.parametrize("key", ["levle", "profile_token_start", "roles", "with_stack"])
def test_unknown_npu_key_named(key):
    err = error_of(lambda: ProfileOptions.model_validate({"tool": "npu", "npu": {key: 1}}))
    assert describe_validation_error(err, "profiler") == f"unknown key 'profiler.npu.{key}'"


@pytest.mark.parametrize(
    ("npu", "path"),
    [
        ({"contents": ["npu", "gpu"]}, "profiler.npu.contents.1"),
        ({"level": "level3"}, "profiler.npu.level"),
        ({"level": "Level1"}, "profiler.npu.level"),
        ({"aic_metrics": "pipe"}, "profiler.npu.aic_metrics"),
        ({"export_type": "json"}, "profiler.npu.export_type"),
        ({"analysis": "maybe"}, "profiler.npu.analysis"),
    ],
)
def test_bad_npu_values_named(npu, path):
    err = error_of(lambda: ProfileOptions.model_validate({"tool": "npu", "npu": npu}))
    assert describe_validation_error(err, "profiler").startswith(f"'{path}':")


def test_merged_keeps_and_validates_npu():
    base = ProfileOptions(tool="npu", npu={"level": "level1", "contents": ["npu"]})
    assert base.merged(with_stack=True).npu == base.npu
    assert base.merged(npu={"level": "level2"}).npu.level == "level2"
    err = error_of(lambda: base.merged(npu={"lvl": 2}))
    assert describe_validation_error(err, "profiler") == "unknown key 'profiler.npu.lvl'"


def test_options_round_trip_through_json():
    o = ProfileOptions(tool="npu", npu={"contents": ["stack"], "aic_metrics": "L2Cache"})
    assert ProfileOptions.model_validate_json(o.model_dump_json()) == o
