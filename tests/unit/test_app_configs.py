"""Every shipped Serve config is a valid Ray Serve config whose app args our builder accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from serve_app.app import parse_args

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
