"""Config models: unknown keys are errors that name the dotted key; steps are validated."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from profiling.config import GlobalProfilerConfig, ProfileOptions, check_safe_name, describe_validation_error


def error_of(fn) -> ValidationError:
    with pytest.raises(ValidationError) as ei:
        fn()
    return ei.value


# -- unknown keys ------------------------------------------------------------------------


def test_profile_options_unknown_key_named_with_prefix():
    err = error_of(lambda: ProfileOptions.model_validate({"recordshapes": True}))
    assert describe_validation_error(err, "profiler") == "unknown key 'profiler.recordshapes'"


def test_global_profiler_unknown_key_named_with_prefix():
    err = error_of(lambda: GlobalProfilerConfig.model_validate({"steps": [1], "step": [2]}))
    assert describe_validation_error(err, "global_profiler") == "unknown key 'global_profiler.step'"


def test_unknown_key_without_prefix():
    err = error_of(lambda: ProfileOptions.model_validate({"max_steps": 3}))
    assert describe_validation_error(err) == "unknown key 'max_steps'"


def test_nested_bad_value_named_by_dotted_path():
    err = error_of(lambda: ProfileOptions.model_validate({"activities": ["cpu", "tpu"]}))
    msg = describe_validation_error(err, "profiler")
    assert msg.startswith("'profiler.activities.1':"), msg


def test_several_problems_each_named():
    err = error_of(lambda: ProfileOptions.model_validate({"foo": 1, "max_forward_steps": 0}))
    msg = describe_validation_error(err, "p")
    assert "unknown key 'p.foo'" in msg
    assert "'p.max_forward_steps':" in msg
    assert msg.count(";") == 1


# -- field rules ---------------------------------------------------------------------------


def test_profile_options_defaults_are_bounded():
    o = ProfileOptions()
    assert o.tool == "torch" and o.activities == ["cpu"]
    assert o.max_forward_steps is not None and o.max_forward_steps >= 1
    assert o.max_duration_s is not None and o.max_duration_s > 0


@pytest.mark.parametrize(
    "data",
    [
        {"max_forward_steps": 0},
        {"max_duration_s": 0},
        {"max_duration_s": -1.0},
        {"activities": []},
        {"tool": "nsys-but-unknown"},
    ],
)
def test_profile_options_rejects_bad_values(data):
    with pytest.raises(ValidationError):
        ProfileOptions.model_validate(data)


def test_profile_options_allows_unbounded():
    o = ProfileOptions(max_forward_steps=None, max_duration_s=None)
    assert o.max_forward_steps is None and o.max_duration_s is None


@pytest.mark.parametrize("steps", [[0], [1, 0, 2], [-3]])
def test_steps_below_one_rejected(steps):
    err = error_of(lambda: GlobalProfilerConfig(steps=steps))
    msg = describe_validation_error(err, "global_profiler")
    assert "'global_profiler.steps." in msg and "greater than or equal to 1" in msg


def test_steps_sorted_and_deduplicated():
    assert GlobalProfilerConfig(steps=[5, 1, 2, 5, 1]).steps == [1, 2, 5]


def test_steps_none_means_off():
    assert GlobalProfilerConfig().steps is None


# -- merged --------------------------------------------------------------------------------


def test_merged_overrides_only_non_none_fields():
    base = ProfileOptions(max_forward_steps=50, record_shapes=True, max_duration_s=10.0)
    m = base.merged(max_forward_steps=7, record_shapes=None, max_duration_s=None, with_stack=True)
    assert m.max_forward_steps == 7
    assert m.with_stack is True
    assert m.record_shapes is True  # None override leaves the field alone
    assert m.max_duration_s == 10.0
    assert base.max_forward_steps == 50  # the original is untouched


def test_merged_with_no_overrides_is_equal():
    base = ProfileOptions(activities=["cpu"], with_memory=True)
    assert base.merged() == base


def test_merged_validates_values():
    with pytest.raises(ValidationError):
        ProfileOptions().merged(max_forward_steps=0)


def test_merged_rejects_unknown_key():
    err = error_of(lambda: ProfileOptions().merged(recordshapes=True))
    assert describe_validation_error(err, "profiler") == "unknown key 'profiler.recordshapes'"


# -- check_safe_name (replica ids, tags) ---------------------------------------------------------


@pytest.mark.parametrize("name", ["r0", "replica-1.a_b", "x" * 64, "..a", "a..", "..."])
def test_safe_name_accepts(name):
    assert check_safe_name(name) == name


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../x", "x" * 65, "a b", "é"])
def test_safe_name_rejects(name):
    with pytest.raises(ValueError):
        check_safe_name(name)


@pytest.mark.parametrize("name", ["r0\n", "x" * 64 + "\n"])
def test_safe_name_rejects_trailing_newline(name):
    with pytest.raises(ValueError):
        check_safe_name(name)


# -- weight transfer -----------------------------------------------------------------------
def test_nccl_needs_collective_transfer_and_gpus():
    from serve_app.config import AppArgs

    with pytest.raises(ValidationError, match="collective_backend is only read with weight_transfer: collective"):
        AppArgs(collective_backend="nccl", replica_num_gpus=1)
    with pytest.raises(ValidationError, match="replica_num_gpus is 0"):
        AppArgs(weight_transfer="collective", collective_backend="nccl")
    assert (
        AppArgs(weight_transfer="collective", collective_backend="nccl", replica_num_gpus=1).collective_backend
        == "nccl"
    )


def test_collective_transfer_is_refused_for_sglang_naming_the_alternatives():
    from serve_app.config import AppArgs

    with pytest.raises(ValidationError, match=r"not supported with engine sglang.*source external"):
        AppArgs(engine="sglang", weight_transfer="collective")
    assert AppArgs(engine="sglang").weight_transfer == "path"


def test_weight_sources_are_one_vocabulary_and_the_old_spelling_still_reads():
    """`weight_transfer: file` (configs and manifests written before the vocabularies were one)
    reads as path; a value outside the place's members is refused naming the allowed ones."""
    from profiling.manifest import SyncCost
    from profiling.weight_source import WeightSource
    from serve_app.api import UpdateWeightsRequest
    from serve_app.config import AppArgs
    from trainer.config import TrainerConfig

    assert AppArgs(weight_transfer="file").weight_transfer is WeightSource.PATH
    assert TrainerConfig.model_validate({"trainer": {"weight_transfer": "file"}}).trainer.weight_transfer == "path"
    assert SyncCost.model_validate({"transfer": "file"}).transfer is WeightSource.PATH
    assert SyncCost(transfer=WeightSource.OBJECT_STORE).model_dump(mode="json")["transfer"] == "object_store"
    assert UpdateWeightsRequest(version=1, path="v1.safetensors").source is WeightSource.PATH
    with pytest.raises(ValidationError, match=r"Input should be 'path' or 'collective'"):
        AppArgs(weight_transfer="object_store")
    with pytest.raises(ValidationError, match=r"'path', 'collective' or 'external'"):
        UpdateWeightsRequest(version=1, source="peer")


def test_the_main_job_publishes_through_the_object_store_only_of_the_app_it_starts():
    """trainer.weight_transfer object_store: the publishing rank joins the local app's cluster; with
    rollout.url (an app elsewhere) the config is refused, naming both keys and the ways out."""
    from trainer.config import TrainerConfig

    cfg = TrainerConfig.model_validate({"trainer": {"weight_transfer": "object_store"}})
    assert cfg.trainer.weight_transfer == "object_store"
    with pytest.raises(ValidationError, match=r"object_store needs the trainer in the app's Ray cluster.*rollout\.url"):
        TrainerConfig.model_validate(
            {"trainer": {"weight_transfer": "object_store"}, "rollout": {"url": "http://127.0.0.1:8000"}}
        )
    with pytest.raises(ValidationError, match=r"'path', 'object_store' or 'collective'"):
        TrainerConfig.model_validate({"trainer": {"weight_transfer": "external"}})


def test_an_object_store_publisher_outside_the_apps_cluster_is_refused_naming_the_way_out():
    """run_training called with object_store but without the app's cluster (a caller of its own):
    the publisher is refused before any training, naming the fix."""
    from trainer.config import TrainerConfig
    from trainer.loop import _publisher

    cfg = TrainerConfig.model_validate({"trainer": {"weight_transfer": "object_store"}})
    with pytest.raises(ValueError, match=r"not in the app's Ray cluster; run the main job with rollout\.url unset"):
        _publisher(cfg, object(), None)


# -- retention -----------------------------------------------------------------------------
@pytest.mark.parametrize("max_exporting_steps", [1, 4])
def test_keep_steps_must_leave_room_for_the_export_backlog_and_the_started_step(max_exporting_steps):
    from serve_app.config import AppArgs

    least = max_exporting_steps + 1
    with pytest.raises(ValidationError) as refused:
        AppArgs(keep_steps=least - 1, max_exporting_steps=max_exporting_steps)
    message = str(refused.value)
    assert f"keep_steps={least - 1} leaves no room for the steps still being written at a start" in message
    assert f"max_exporting_steps={max_exporting_steps} stopped steps may still be exporting" in message
    assert f"keep_steps must be at least {least}: raise keep_steps to {least} or more" in message
    assert "lower max_exporting_steps, or set keep_steps: null" in message
    assert AppArgs(keep_steps=least, max_exporting_steps=max_exporting_steps).keep_steps == least
    assert AppArgs(max_exporting_steps=max_exporting_steps).keep_steps is None


# -- the app's own schedule ---------------------------------------------------------------------
def test_app_global_profiler_takes_verls_keys_and_refuses_an_empty_schedule():
    from serve_app.config import AppArgs

    args = AppArgs(global_profiler={"steps": [5, 1, 2, 2], "profile_continuous_steps": True})
    assert args.global_profiler is not None and args.global_profiler.steps == [1, 2, 5]
    assert AppArgs().global_profiler is None
    with pytest.raises(ValidationError, match=r"global_profiler\.steps"):
        AppArgs(global_profiler={"steps": []})
    # verl's save_path is accepted, and said to have no effect: the app's own save_path rules.
    args = AppArgs(global_profiler={"steps": [1], "save_path": "/tmp/x"})
    assert [n for n in args.notes() if "args.global_profiler.save_path is '/tmp/x'" in n and "no effect" in n]
