"""The Megatron backend's policy on megatron-core for real (CPU, gloo; docs/trainer.md#megatron):
one training step on one batch gives the same loss at tensor parallelism 2, pipeline parallelism 2
and 1, and as the FSDP backend's policy; the gathered checkpoint has the Hugging Face Llama names
and, loaded by the embedded engine and by vLLM, gives megatron's own logits, for both layouts.

Not skipped when megatron-core is missing: CI installs the `megatron` extra, and a run without it
must fail here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from trainer.policy import Policy

from .megatron_ranks import CLIP, LR, PROBE, SEED, STEPS, fixed_batch, run_layout

LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
LOSS_TOL = 1e-5
LOGITS_TOL = 1e-4
"""float32 on one machine: the layouts differ only in the order of the sums."""
VLLM_LOGPROB_TOL = 2e-3
"""vLLM's CPU kernels (its own attention and matmuls) against megatron's, in float32."""


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory) -> dict[str, dict]:
    return {name: run_layout(tp, pp, model_dir, tmp_path_factory.mktemp(name)) for name, (tp, pp) in LAYOUTS.items()}


def test_a_step_gives_the_same_loss_at_tp2_pp2_and_1(runs, model_dir):
    fsdp = Policy(str(model_dir), LR, CLIP, SEED)
    expected = [fsdp.train_step(fixed_batch()) for _ in range(STEPS)]
    for name, run in runs.items():
        for r in run["ranks"]:  # every rank of the replica reports its loss, the last stage's
            assert r["losses"] == pytest.approx(expected, abs=LOSS_TOL), (name, r, expected)


def test_each_rank_knows_its_megatron_coordinates(runs):
    coords = {name: [(r["parallel"]["tp"], r["parallel"]["pp"]) for r in run["ranks"]] for name, run in runs.items()}
    assert coords == {"tp1": [(0, 0)], "tp2": [(0, 0), (1, 0)], "pp2": [(0, 0), (0, 1)]}


def _embedded_engine_logits(model_dir: Path, checkpoint: Path) -> torch.Tensor:
    """The embedded engine's load (serve_app/engines/transformers/engine.py): the served model's
    architecture, then the published state dict, strictly."""
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    model.load_state_dict(load_file(str(checkpoint / "model.safetensors")), strict=True)
    with torch.no_grad():
        return model(input_ids=torch.tensor(PROBE)).logits


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_the_published_checkpoint_gives_megatrons_logits_in_the_embedded_engine(runs, model_dir, layout):
    run = runs[layout]
    megatron = load_file(str(run["logits"]))["logits"]
    hf = _embedded_engine_logits(model_dir, run["checkpoint"])
    assert megatron.shape == hf.shape == (len(PROBE), len(PROBE[0]), 512)
    assert (megatron - hf).abs().max().item() < LOGITS_TOL
    untrained = Policy(str(model_dir), LR, CLIP, SEED).full_state_dict()
    published = load_file(str(run["checkpoint"] / "model.safetensors"))
    assert set(published) == set(untrained), "the published names are the served model's"
    assert any((published[k] - untrained[k]).abs().max() > 1e-3 for k in published), "the steps changed the weights"


def test_a_wrongly_regrouped_checkpoint_fails_the_parity_check(runs, model_dir, tmp_path):
    """The check above can fail: gate and up projections swapped, as a gather that ignored
    megatron's [gate; up] shards would publish them."""
    import shutil

    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    shutil.copytree(runs["tp2"]["checkpoint"], bad)
    state = load_file(str(bad / "model.safetensors"))
    for k in [k for k in state if k.endswith("gate_proj.weight")]:
        up = k.replace("gate_proj", "up_proj")
        state[k], state[up] = state[up], state[k]
    save_file(state, str(bad / "model.safetensors"))
    megatron = load_file(str(runs["tp2"]["logits"]))["logits"]
    assert (megatron - _embedded_engine_logits(model_dir, bad)).abs().max().item() > LOGITS_TOL


@pytest.mark.timeout(600)
def test_the_published_checkpoint_gives_megatrons_logprobs_in_vllm(runs, tmp_path):
    out = tmp_path / "vllm.json"
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "HF_HUB_OFFLINE": "1",
    }
    script = Path(__file__).with_name("megatron_ranks.py")
    layouts = ["tp2", "pp2"]
    proc = subprocess.run(
        [sys.executable, str(script), str(out), *(str(runs[n]["checkpoint"]) for n in layouts)],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    served = json.loads(out.read_text())
    for name, logprobs in zip(layouts, served, strict=True):
        megatron = torch.log_softmax(load_file(str(runs[name]["logits"]))["logits"], -1)
        for row, ids in enumerate(PROBE):
            assert logprobs[row][0] is None
            for i in range(1, len(ids)):
                expected = megatron[row, i - 1, ids[i]].item()
                assert abs(logprobs[row][i] - expected) < VLLM_LOGPROB_TOL, (name, row, i, logprobs[row][i], expected)
