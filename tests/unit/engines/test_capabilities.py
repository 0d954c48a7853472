"""Engines declare capabilities (docs/engines.md#capabilities): a minimal engine defined here, with
only `generate` and `load_path`, runs behind the real controller (serve_app/engines/controller.py,
built through the registry as a replica builds it), and everything it lacks is refused by name:
at config time, before a control call fans out, and in the controller itself."""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest
from pydantic import ValidationError
from support.engines import replica_sessions

from serve_app.config import AppArgs
from serve_app.control.capabilities import require
from serve_app.engines import create_engine
from serve_app.engines.adapter import EngineAdapter, capability_gaps
from serve_app.engines.controller import EngineController
from serve_app.engines.generation import GenerateDelta, GenerateRequest, SamplingSpec
from serve_app.engines.options import Capability, CapabilityMissing, EngineOptions
from serve_app.engines.registry import ENGINE_OPTIONS
from serve_app.errors import Refused
from serve_app.weights.checkpoint import StateDict, read_state_dict
from tools import engine_doc


class MinimalOptions(EngineOptions):
    """A test engine's options: it generates and loads weights from a path, nothing else."""

    engine = "minimal"
    implementation = f"{__name__}:MinimalEngine"
    capabilities = frozenset({Capability.GENERATE, Capability.LOAD_PATH})


class MinimalEngine(EngineAdapter):
    """Generates `max_tokens` copies of the prompt's last token; its 'model' is the state dict it
    loaded last (its tensor count is all it uses)."""

    def open(self, args: AppArgs, model_dir: Path) -> None:
        self.tensors = len(read_state_dict(model_dir / "model.safetensors"))

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        for i in range(request.sampling.max_tokens):
            last = i == request.sampling.max_tokens - 1
            yield GenerateDelta(
                token_ids=[request.prompt_token_ids[-1]],
                weight_version=self.host.weight_version,
                finish_reason="length" if last else None,
            )

    async def read_weights(self, path: Path) -> StateDict:
        return read_state_dict(path)

    async def load_weights(self, weights: StateDict, version: int) -> None:
        self.tensors = len(weights)

    def healthy(self) -> bool:
        return True

    async def close(self) -> None:
        pass


class ProfilesWithoutProfiler(MinimalOptions):
    """Declares `profile` for an engine that implements no `profiler`: the engine refuses to build."""

    engine = "minimal-claims-profile"
    capabilities = MinimalOptions.capabilities | {Capability.PROFILE}


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    for options in (MinimalOptions, ProfilesWithoutProfiler):
        monkeypatch.setitem(ENGINE_OPTIONS, options.engine, options)


def build(args: AppArgs, store, exporter, tmp_path: Path) -> EngineController:
    """The engine `args` names, built through the registry as a replica builds it."""
    return create_engine(
        args,
        replica_sessions(store, exporter, "min0"),
        "min0",
        trace_root=tmp_path / "traces",
    )


async def test_a_minimal_engine_generates_and_loads_weights_behind_the_real_policy(
    model_dir, store, exporter, tmp_path
):
    args = AppArgs(engine="minimal", model_path=str(model_dir))
    engine = build(args, store, exporter, tmp_path)
    assert isinstance(engine.adapter, MinimalEngine)
    await engine.opened()
    request = GenerateRequest(prompt_token_ids=[5, 7], sampling=SamplingSpec(max_tokens=3))
    deltas = [d async for d in engine.generate(request)]
    assert [d.token_ids for d in deltas] == [[7], [7], [7]] and {d.weight_version for d in deltas} == {0}

    load_s = await engine.update_weights(1, str(model_dir / "model.safetensors"), resume=True)
    assert load_s >= 0 and engine.weight_version == 1 and engine.adapter.tensors > 0
    assert {d.weight_version async for d in engine.generate(request)} == {1}
    status = engine.status()
    assert status.weight_version == 1 and not status.paused and status.requests_in_flight == 0

    # What it lacks is refused by the engine's controller, naming the capability (a caller that
    # reaches the replica's handle directly, past the app's controller).
    with pytest.raises(CapabilityMissing, match=r"engine minimal.*'pause'"):
        await engine.stop_profile(None, pause=True)
    with pytest.raises(CapabilityMissing, match=r"engine minimal.*'pause'"):
        await engine.update_weights(2, str(model_dir / "model.safetensors"), resume=False)
    with pytest.raises(CapabilityMissing, match=r"engine minimal.*'engine_rpc'"):
        await engine.engine_rpc("collective_rpc")
    await engine.shutdown()


def test_asking_the_minimal_engine_to_profile_is_refused_at_config_time_naming_the_capability():
    with pytest.raises(ValidationError) as refused:
        AppArgs(engine="minimal", profiler={"activities": ["cpu"]})
    message = str(refused.value)
    assert "profiling" in message and "engine minimal" in message and "'profile'" in message, message
    with pytest.raises(
        ValidationError, match=r"weight_transfer: collective is not supported with engine minimal.*'receive_collective'"
    ):
        AppArgs(engine="minimal", weight_transfer="collective")
    assert AppArgs(engine="minimal").engine_options == MinimalOptions()


@pytest.mark.parametrize(
    ("capability", "what"),
    [(Capability.PROFILE, ""), (Capability.PAUSE, "pause: true"), (Capability.ADOPT_EXTERNAL, "source external")],
)
def test_a_control_call_the_engine_cannot_serve_is_a_422_naming_it(capability, what):
    """What the controller runs before any replica is asked (serve_app/control/capabilities.py)."""
    with pytest.raises(Refused) as refused:
        require(AppArgs(engine="minimal"), capability, what)
    assert refused.value.status == 422
    assert f"{capability.value!r}" in str(refused.value) and "engine minimal" in str(refused.value)
    require(AppArgs(engine="minimal"), Capability.LOAD_PATH)  # declared: no refusal


def test_an_engine_whose_hooks_disagree_with_its_capabilities_refuses_to_build(model_dir, store, exporter, tmp_path):
    with pytest.raises(TypeError, match="declares 'profile' but does not implement profiler"):
        build(AppArgs(engine="minimal-claims-profile", model_path=str(model_dir)), store, exporter, tmp_path)
    assert capability_gaps(MinimalEngine, frozenset({Capability.GENERATE})) == [
        "implements load_weights, read_weights but does not declare 'load_path'",
    ]


@pytest.mark.parametrize("name", ["transformers", "vllm", "sglang"])
def test_each_shipped_engine_implements_exactly_the_protocols_of_its_capabilities(name):
    options = ENGINE_OPTIONS[name]
    module, _, cls = options.implementation.partition(":")
    assert capability_gaps(getattr(importlib.import_module(module), cls), options.capabilities) == []


def check_table(doc: Path) -> subprocess.CompletedProcess[str]:
    """`--check` of the table generator, in a process of its own (this module registers engines)."""
    command = [sys.executable, "-m", "tools.engine_doc", "--check", "--doc", str(doc)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_the_capability_table_in_the_docs_is_generated_from_the_options_classes(tmp_path):
    current = check_table(engine_doc.PAGE.doc)
    assert current.returncode == 0, f"{current.stderr} (docs/engines.md's capability table is stale)"
    stale = tmp_path / "engines.md"
    stale.write_text(f"# Engines\n\n{engine_doc.PAGE.begin}\n| old |\n{engine_doc.PAGE.end}\n")
    refused = check_table(stale)
    assert refused.returncode == 1 and engine_doc.PAGE.regenerate in refused.stderr


def test_the_registry_reads_without_any_engines_own_packages():
    """A config is read where no engine is installed (the builder of `serve run`)."""
    code = "import sys, serve_app.engines.registry; print(sorted(m for m in ('vllm', 'sglang') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
