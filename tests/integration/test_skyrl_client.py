"""SkyRL's own client against the app on the embedded engine (docs/frameworks/skyrl.md): skyrl
0.3.0's `RemoteInferenceClient`, from a Python 3.12 virtual environment of its own (its client
does not import on Python 3.11), passes world size, tokenize, detokenize, token-in token-out
generate, completion, chat, a pause(keep) and resume around a weight update with a request in
flight, and a prefix-cache reset. The client's calls run in tests/integration/skyrl/driver.py."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from integ_util import write_perturbed_weights
from transformers import AutoTokenizer

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent / "skyrl"
PYTHON_ENV = "SKYRL_PYTHON"
"""A Python 3.12 interpreter to build the client's environment with (default: pyenv's newest
3.12, else python3.12 on the PATH)."""


def _python312() -> str:
    # pyenv's own install before the PATH's: pyenv's shim for python3.12 is on the PATH even where
    # no 3.12 is selected, and fails.
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = sorted(glob.glob(f"{pyenv}/versions/3.12*/bin/python3.12"))
    if found := os.environ.get(PYTHON_ENV) or (candidates[-1] if candidates else shutil.which("python3.12")):
        return found
    pytest.fail(
        f"SkyRL 0.3.0's client needs Python 3.12 (it does not import on 3.11): none found on the PATH or under "
        f"{pyenv}/versions; install one (pyenv install 3.12) or set {PYTHON_ENV}"
    )


@pytest.fixture(scope="module")
def skyrl_python(tmp_path_factory) -> str:
    venv = tmp_path_factory.mktemp("skyrl") / "venv"
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    for cmd in (
        [_python312(), "-m", "venv", str(venv)],
        [*pip, "--no-deps", "-r", str(HERE / "requirements.txt")],
        [*pip, "-r", str(HERE / "requirements-deps.txt")],
    ):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return str(venv / "bin" / "python")


@pytest.fixture(scope="module")
def driven(skyrl_python, app, model_dir) -> dict:
    write_perturbed_weights(model_dir, app.weights_dir / "skyrl-v1.safetensors", seed=11)
    cmd = [skyrl_python, str(HERE / "driver.py"), app.base_url, "tiny-llama", "skyrl-v1.safetensors", "1"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_skyrl_world_size_tokenize_and_detokenize(driven, model_dir):
    assert driven["world_size"] == [2, 2], "two replicas, one engine worker each, seen as one server"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert driven["tokens"] == [tokenizer("One two three").input_ids]
    assert driven["text"] == [tokenizer.decode(driven["tokens"][0])]


def test_skyrl_generate_is_token_in_token_out_with_logprobs(driven):
    out = driven["generate"]
    assert len(out["response_ids"]) == 2 and all(len(ids) == 6 for ids in out["response_ids"])
    assert out["response_ids"][0] == out["response_ids"][1], "greedy: both prompts the same"
    assert out["stop_reasons"] == ["length", "length"]
    assert [len(lp) for lp in out["response_logprobs"]] == [6, 6]
    assert all(lp <= 0 for lps in out["response_logprobs"] for lp in lps)
    assert len(out["responses"]) == 2 and out["responses"][0]


def test_skyrl_completion_and_chat_pass_through(driven):
    assert driven["completion"]["choices"][0]["text"] and driven["completion"]["model"] == "tiny-llama"
    assert driven["chat"]["choices"][0]["message"]["role"] == "assistant"


def test_skyrl_pause_keep_holds_a_request_across_the_update_until_resume(driven):
    (pause,) = driven["pause"].values()
    assert pause["status"] == 200 and pause["body"]["status"] == "paused" and pause["body"]["mode"] == "keep"
    assert driven["update"]["status"] == 200 and driven["update"]["body"]["version"] == 1, driven["update"]
    assert driven["paused_after_update"]["is_paused"] is True, "the update's resume lifted the client's pause"
    assert driven["in_flight_during_pause"], (
        f"the request in flight finished during the pause ({driven['pause_attempts']})"
    )
    (resume,) = driven["resume"].values()
    assert resume["body"]["status"] == "resumed" and driven["paused_after_resume"]["is_paused"] is False
    assert len(driven["in_flight"]["response_ids"][0]) == 400 and driven["in_flight"]["stop_reasons"] == ["length"]


def test_skyrl_reset_prefix_cache_sends_its_option_as_a_body(driven):
    (reset,) = driven["reset"].values()
    assert reset["status"] == 200 and reset["body"]["success"] is True, reset
