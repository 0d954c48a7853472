"""The FAKE SGLang server of the integration tests (tests/fakes/fake_sglang_server.py: NOT SGLang,
which needs CUDA), as replicas with engine sglang launch it, and what the tests read from it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx
import psutil
import torch

FAKE_SERVER = Path(__file__).resolve().parents[1] / "fakes" / "fake_sglang_server.py"


def fake_sglang_options(**overrides: Any) -> dict[str, Any]:
    """The app's `sglang` options launching the fake server, strict about the adapter's fields."""
    return {
        "server_command": [sys.executable, str(FAKE_SERVER)],
        "server_args": ["--fake-strict-fields"],  # a misspelt field in the adapter's bodies fails
        "startup_timeout_s": 180,
        "request_timeout_s": 90,
        **overrides,
    }


def fake_servers(model_dir: Path) -> dict[int, str]:
    """pid -> URL of each fake SGLang server serving `model_dir` (a test session's model)."""
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if str(FAKE_SERVER) in cmd and str(model_dir) in cmd:
            found[proc.info["pid"]] = f"http://{cmd[cmd.index('--host') + 1]}:{cmd[cmd.index('--port') + 1]}"
    return found


def served_weights(url: str, names: list[str], sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    """The fake's weights, read with SGLang's /get_weights_by_name (flattened)."""
    out = {}
    for name in names:
        answer = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": sizes[name]}, timeout=60)
        assert answer.status_code == 200, answer.text
        out[name] = torch.tensor(answer.json())
    return out
