"""The verl plugin's rules that need no verl (docs/frameworks/verl.md): verl's generate call as the
app's request and the answer back as verl's fields, the settings block, the verl settings refused
by name, and the schedule the app is given from verl's `global_profiler`. The plugin under verl's
own classes is tests/integration/test_verl_plugin.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from serve_app.api import ScheduleSpec
from serve_app.generate_api import (
    GenerateChoice,
    GenerateLogProbs,
    GenerateLogProbsContent,
    GenerateResponse,
    VersionSpan,
)
from trainer.verl_plugin.settings import SETTINGS_KEY, PluginConfigError, read_settings
from trainer.verl_plugin.token_io import (
    RolloutLimits,
    UnsupportedRequest,
    aborted_fields,
    generate_request,
    token_output_fields,
)
from trainer.verl_plugin.verl_config import check_backend, refusals, schedule_of

LIMITS = RolloutLimits(prompt_length=8, response_length=4, max_model_len=None, repetition_penalty=1.1, ignore_eos=True)
AGENT_LOOP = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


def test_verls_sampling_parameters_become_the_apps_request():
    req = generate_request("r1", [1, 2, 3], AGENT_LOOP, LIMITS)
    sp = req.sampling_params
    assert req.request_id == "r1" and req.token_ids == [1, 2, 3]
    # verl's default length: response_length, within prompt_length + response_length of the prompt.
    assert sp.max_tokens == 4 and sp.logprobs == 0 and sp.top_k == -1
    # verl's config fills what the call leaves out, and only that.
    assert sp.repetition_penalty == 1.0 and sp.ignore_eos is True
    assert generate_request("r", [1], {"logprobs": False}, LIMITS).sampling_params.logprobs is None
    assert generate_request("r", [1], {}, LIMITS).sampling_params.repetition_penalty == 1.1


def test_the_length_limit_takes_sglangs_name_and_is_clamped_to_the_context_left():
    assert generate_request("r", [1], {"max_new_tokens": 2}, LIMITS).sampling_params.max_tokens == 2
    # 12 tokens of context (8 + 4): a 10-token prompt leaves 2, whatever the call asks.
    assert generate_request("r", list(range(10)), {"max_tokens": 50}, LIMITS).sampling_params.max_tokens == 2
    with pytest.raises(UnsupportedRequest, match="no room to generate"):
        generate_request("r", list(range(12)), {}, LIMITS)


def test_full_determinism_seeds_each_request():
    seeded = RolloutLimits(prompt_length=8, response_length=4, max_model_len=64, seed=43)
    assert generate_request("r", [1], {}, seeded).sampling_params.seed == 43
    assert generate_request("r", [1], {"seed": 7}, seeded).sampling_params.seed == 7


def test_a_sampling_parameter_the_app_does_not_take_is_refused_by_name():
    with pytest.raises(UnsupportedRequest, match=r"sampling_params\.guided_json"):
        generate_request("r", [1], {"guided_json": {}}, LIMITS)


def _answer(
    tokens: list[int], spans: list[tuple[str, int, int]], finish: str, logprobs: bool = True
) -> GenerateResponse:
    content = [GenerateLogProbsContent(token_id=t, logprob=-0.5 * (i + 1)) for i, t in enumerate(tokens)]
    choice = GenerateChoice(
        index=0,
        finish_reason=finish,
        token_ids=tokens,
        logprobs=GenerateLogProbs(content=content) if logprobs else None,
        weight_versions=[VersionSpan(version=v, start=s, end=e) for v, s, e in spans],
    )
    return GenerateResponse(request_id="r", choices=[choice])


def test_the_answer_gives_verl_its_tokens_logprobs_and_versions():
    fields = token_output_fields(
        _answer([5, 6, 7], [("default", 0, 1), ("3", 1, 3)], "length"), logprobs=True, served_version=0
    )
    assert fields["token_ids"] == [5, 6, 7] and fields["log_probs"] == [-0.5, -1.0, -1.5]
    assert fields["stop_reason"] == "completed"
    assert fields["extra_fields"] == {"global_steps": 3, "min_global_steps": 0, "max_global_steps": 3}
    assert (
        token_output_fields(_answer([5], [("2", 0, 1)], "stop"), logprobs=False, served_version=2)["log_probs"] is None
    )


def test_an_aborted_answer_is_verls_aborted_and_keeps_its_tokens():
    fields = token_output_fields(_answer([5, 6], [("4", 0, 2)], "abort"), logprobs=True, served_version=4)
    assert fields["stop_reason"] == "aborted" and fields["token_ids"] == [5, 6]
    # Without a token there is no span: the version verl is told is the one served.
    empty = token_output_fields(_answer([], [], "abort"), logprobs=True, served_version=4)
    assert empty["extra_fields"]["global_steps"] == 4 and empty["token_ids"] == []
    assert aborted_fields(4) == {
        "token_ids": [],
        "log_probs": None,
        "stop_reason": "aborted",
        "extra_fields": {"global_steps": 4},
    }


def test_the_settings_block_is_validated_naming_its_keys():
    ok = read_settings({"rollout_profiler": {"url": "http://127.0.0.1:8002", "weights_dir": "/w"}})
    assert ok.transfer == "path" and ok.control_url is None
    with pytest.raises(PluginConfigError, match=f"{SETTINGS_KEY} is missing"):
        read_settings({"nccl": {}})
    with pytest.raises(PluginConfigError, match="transfer path needs weights_dir"):
        read_settings({"rollout_profiler": {"url": "http://127.0.0.1:8002"}})
    with pytest.raises(PluginConfigError, match=f"unknown key '{SETTINGS_KEY}.urls'"):
        read_settings({"rollout_profiler": {"urls": "x", "url": "http://h", "transfer": "object_store"}})
    with pytest.raises(PluginConfigError, match=r"\.url'"):
        read_settings({"rollout_profiler": {"url": "127.0.0.1:8002", "transfer": "object_store"}})


def _rollout(**changes: Any) -> SimpleNamespace:
    """verl's RolloutConfig, as attributes, with verl's defaults for what the rules read."""
    profiler = SimpleNamespace(enable=True, all_ranks=False, ranks=[], tool_config={"torch": {}, "npu": {}})
    fields: dict[str, Any] = {
        "mode": "async",
        "disaggregation": SimpleNamespace(enabled=False),
        "enable_rollout_routing_replay": False,
        "mtp": SimpleNamespace(enable=False, enable_rollout=False),
        "profiler": profiler,
        "tensor_model_parallel_size": 1,
        "data_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "checkpoint_engine": SimpleNamespace(backend="rollout_profiler"),
    }
    fields.update(changes)
    return SimpleNamespace(**fields)


MODEL = SimpleNamespace(lora_rank=0, lora={})


def test_verls_defaults_are_honoured():
    assert refusals(_rollout(), MODEL) == []


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"mode": "sync"}, "actor_rollout_ref.rollout.mode"),
        ({"disaggregation": SimpleNamespace(enabled=True)}, "actor_rollout_ref.rollout.disaggregation.enabled"),
        ({"enable_rollout_routing_replay": True}, "actor_rollout_ref.rollout.enable_rollout_routing_replay"),
        ({"mtp": SimpleNamespace(enable=True, enable_rollout=True)}, "actor_rollout_ref.rollout.mtp.enable_rollout"),
        (
            {"profiler": SimpleNamespace(tool_config={"npu": {"profile_token_end": 9}})},
            "actor_rollout_ref.rollout.profiler.tool_config.npu.profile_token_end",
        ),
    ],
)
def test_a_setting_the_plugin_cannot_honour_is_refused_by_name(changes, named):
    said = refusals(_rollout(**changes), MODEL)
    assert len(said) == 1 and named in said[0], said


def test_unmerged_lora_is_refused_and_merged_lora_is_taken():
    assert "lora.merge" in refusals(_rollout(), SimpleNamespace(lora_rank=8, lora={}))[0]
    assert refusals(_rollout(), SimpleNamespace(lora_rank=8, lora={"merge": True})) == []


def test_the_checkpoint_engine_must_be_the_one_for_verls_trainer():
    check_backend(_rollout(), hybrid=False)
    check_backend(_rollout(checkpoint_engine=SimpleNamespace(backend="naive")), hybrid=True)
    with pytest.raises(PluginConfigError, match="backend=rollout_profiler"):
        check_backend(_rollout(checkpoint_engine=SimpleNamespace(backend="nccl")), hybrid=False)
    with pytest.raises(PluginConfigError, match="backend=naive"):
        check_backend(_rollout(), hybrid=True)


GLOBAL = {"tool": "torch", "steps": [5, 1, 2], "save_path": "out", "profile_continuous_steps": False}


def test_the_app_is_given_verls_steps_when_verl_would_profile_the_replica():
    assert schedule_of(GLOBAL, _rollout(), 0) == ScheduleSpec(steps=[1, 2, 5])
    assert schedule_of({**GLOBAL, "profile_continuous_steps": True}, _rollout(), 0) == ScheduleSpec(
        steps=[1, 2, 5], profile_continuous_steps=True
    )


def test_no_schedule_where_verl_profiles_no_rollout():
    assert schedule_of({**GLOBAL, "tool": None}, _rollout(), 0) is None  # verl's tool: null is off
    assert schedule_of({**GLOBAL, "steps": None}, _rollout(), 0) is None
    assert schedule_of(GLOBAL, _rollout(profiler=SimpleNamespace(enable=False, ranks=[], all_ranks=False)), 0) is None
    # verl's rank rule: no ranks profiles replica 0; rank r is replica r // tp.
    assert schedule_of(GLOBAL, _rollout(), 1) is None
    two = SimpleNamespace(enable=True, all_ranks=False, ranks=[2, 3])
    assert schedule_of(GLOBAL, _rollout(profiler=two, tensor_model_parallel_size=2), 1) is not None
    assert schedule_of(GLOBAL, _rollout(profiler=two, tensor_model_parallel_size=2), 0) is None
    every = SimpleNamespace(enable=True, all_ranks=True, ranks=[])
    assert schedule_of(GLOBAL, _rollout(profiler=every), 3) is not None


def test_a_global_profiler_block_verl_would_refuse_is_refused_by_name():
    with pytest.raises(PluginConfigError, match=r"global_profiler\.steps"):
        schedule_of({**GLOBAL, "steps": [0]}, _rollout(), 0)
