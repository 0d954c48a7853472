"""Every shipped Serve config is a valid Ray Serve config whose app args our builder accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from serve_app.app import build_app, parse_args

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "config").glob("serve*.yaml"))


def test_the_three_engine_configs_ship():
    assert {p.name for p in CONFIGS} >= {"serve.yaml", "serve.vllm.yaml", "serve.vllm-gpu.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_serve_config_validates(path):
    raw = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(raw)
    (app,) = raw["applications"]
    args = parse_args(app["args"])
    assert app["import_path"] == "serve_app.app:build_app"
    if path.name == "serve.yaml":
        assert args.engine == "transformers" and raw["http_options"]["host"] == "127.0.0.1"
    if path.name == "serve.vllm.yaml":
        assert args.engine == "vllm" and raw["http_options"]["host"] == "127.0.0.1"
        assert args.replica_env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_unknown_engine_is_named():
    with pytest.raises(ValueError, match=r"args\.engine"):
        parse_args({"engine": "tgi"})


def test_vllm_options_reject_unknown_keys():
    with pytest.raises(ValueError, match=r"args\.vllm\.with_stacks"):
        parse_args({"engine": "vllm", "vllm": {"with_stacks": True}})


@pytest.mark.parametrize(
    ("args", "keys"),
    [
        ({"engine": "vllm", "profiler": {"tool": "npu"}}, ["'args.profiler'", "tool 'npu'", "engine 'vllm'"]),
        ({"engine": "sglang", "profiler": {"with_memory": True}}, ["'args.profiler'", "with_memory"]),
        (
            {"engine": "sglang", "num_replicas": 2, "sglang": {"url": "http://127.0.0.1:9"}},
            ["'args.sglang'", "num_replicas"],
        ),
        ({"engine": "transformers", "vllm": {"dtype": "float32"}}, ["'args.vllm'", "engine: vllm"]),
        (
            {"engine": "vllm", "tiny_model": {"hidden_size": 64, "num_attention_heads": 4}},
            ["'args.tiny_model'", "head_dim"],
        ),
        (
            {"tiny_model": {"hidden_size": 100, "num_attention_heads": 3}},
            ["'args.tiny_model'", "multiple of num_attention_heads"],
        ),
        (
            {"engine": "vllm", "vllm": {"engine_args": {"weight_transfer_config": {"backend": "nccl"}}}},
            ["'args.vllm'", "needs a CUDA GPU", "replica_num_gpus is 0", "rollout_gloo"],
        ),
        (
            {"engine": "vllm", "vllm": {"engine_args": {"weight_transfer_config": {}}}},
            ["'args.vllm'", "needs a CUDA GPU"],  # vLLM's default backend is nccl
        ),
        (
            {"engine": "vllm", "vllm": {"engine_args": {"weight_transfer_config": "nccl"}}},
            ["args.vllm.engine_args", "weight_transfer_config must be {backend: <name>}"],
        ),
    ],
)
def test_each_cross_field_rule_is_refused_naming_its_keys(args, keys):
    """What `serve run` and `serve deploy` call: the builder refuses before any deployment exists."""
    with pytest.raises(ValueError) as err:
        build_app(args)
    for key in keys:
        assert key in str(err.value), str(err.value)


def test_the_engines_own_settings_and_a_recordable_profiler_are_accepted():
    assert (
        parse_args({"engine": "vllm", "profiler": {"tool": "nsys"}, "vllm": {"dtype": "float32"}}).vllm.dtype
        == "float32"
    )
    assert parse_args({"engine": "sglang", "num_replicas": 1, "sglang": {"url": "http://127.0.0.1:9"}}).sglang.url
    assert parse_args({"profiler": {"tool": "npu"}}).engine == "transformers"


def test_the_engines_own_weight_transfer_is_configured_on_vllm_alone():
    """Which routes a trainer may drive the engines' own group through (docs/engines.md#vllm-weight-transfer-routes)."""
    gloo = {"engine": "vllm", "vllm": {"engine_args": {"weight_transfer_config": {"backend": "rollout_gloo"}}}}
    assert parse_args(gloo).vllm.transfer_backend == "rollout_gloo"
    assert parse_args(gloo).engine_options.transfer_refusal("vllm") is None
    assert "not sglang's routes" in (parse_args(gloo).engine_options.transfer_refusal("sglang") or "")
    gpu = {**gloo, "replica_num_gpus": 1, "vllm": {"engine_args": {"weight_transfer_config": {"backend": "nccl"}}}}
    assert parse_args(gpu).vllm.transfer_backend == "nccl"
    assert "weight_transfer_config" in (parse_args({"engine": "vllm"}).engine_options.transfer_refusal("vllm") or "")
    assert "POST /weights/update" in (parse_args({}).engine_options.transfer_refusal("vllm") or "")
