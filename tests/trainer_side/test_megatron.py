"""The Megatron backend's policy on megatron-core for real (CPU, gloo; docs/trainer.md#megatron):
one training step on one batch gives the same loss at tensor parallelism 2, pipeline parallelism 2
and 1, and as the FSDP backend's policy, and two data-parallel replicas train to the weights of
one; the gathered checkpoint has the Hugging Face Llama names and, loaded by the embedded engine
and by a served vLLM replica (moved in by the trainer's own transfer and through the object
store), gives megatron's own logits, for both layouts.

Not skipped when megatron-core is missing: CI installs the `megatron` extra, and a run without it
must fail here."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from trainer.policy import Policy

from .megatron_ranks import CLIP, LR, PROBE, SEED, STEPS, fixed_batch, run_layout

LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 1, 2), "pp2": (1, 2, 2), "dp2": (1, 1, 2)}
"""name: (tensor parallel, pipeline parallel, ranks); dp2 is two data-parallel replicas."""
LOSS_TOL = 1e-5
LOGITS_TOL = 1e-4
"""float32 on one machine: the layouts differ only in the order of the sums."""
ADAM_WEIGHTS_TOL = 1e-3
"""Weights after Adam's steps: where a gradient is near zero, Adam's division by its root mean
square turns the float order of the sums into a visible share of lr (TP2 and TP1 differ by 2e-4)."""
VLLM_LOGPROB_TOL = 2e-3
"""vLLM's CPU kernels (its own attention and matmuls) against megatron's, in float32."""
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory) -> dict[str, dict]:
    return {
        name: run_layout(tp, pp, model_dir, tmp_path_factory.mktemp(name), world)
        for name, (tp, pp, world) in LAYOUTS.items()
    }


def test_a_step_gives_the_same_loss_at_tp2_pp2_and_1(runs, model_dir):
    fsdp = Policy(str(model_dir), LR, CLIP, SEED)
    expected = [fsdp.train_step(fixed_batch()) for _ in range(STEPS)]
    for name, run in runs.items():
        if name == "dp2":
            continue  # each replica reports the loss of its half of the batch (the next test)
        for r in run["ranks"]:  # every rank of the replica reports its loss, the last stage's
            assert r["losses"] == pytest.approx(expected, abs=LOSS_TOL), (name, r, expected)


def test_two_data_parallel_replicas_train_to_the_weights_of_one(runs):
    """Each replica trains on its half of the batch and their gradients are averaged: after the
    same steps the weights, and the logits, are the single replica's."""
    logits = [load_file(str(runs[n]["logits"]))["logits"] for n in ("tp1", "dp2")]
    assert (logits[0] - logits[1]).abs().max().item() < LOGITS_TOL
    one, two = (load_file(str(runs[n]["checkpoint"] / "model.safetensors")) for n in ("tp1", "dp2"))
    assert set(one) == set(two)
    # A replica that kept its own half's gradient would be a whole step (lr = 0.01) off.
    assert max((one[k] - two[k]).abs().max().item() for k in one) < ADAM_WEIGHTS_TOL
    halves = [r["losses"] for r in runs["dp2"]["ranks"]]
    assert halves[0] != halves[1], "the replicas trained on different halves"


def test_each_rank_knows_its_megatron_coordinates(runs):
    coords = {
        name: [(r["parallel"]["tp"], r["parallel"]["pp"], r["parallel"]["dp"]) for r in run["ranks"]]
        for name, run in runs.items()
    }
    assert coords == {
        "tp1": [(0, 0, 0)],
        "tp2": [(0, 0, 0), (1, 0, 0)],
        "pp2": [(0, 0, 0), (0, 1, 0)],
        "dp2": [(0, 0, 0), (0, 0, 1)],
    }


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


@pytest.fixture(scope="module")
def vllm_app(ray_cluster, model_dir, tmp_path_factory):
    """A real vLLM replica (vllm-cpu, float32) serving the model the Megatron runs start from."""
    import vllm  # noqa: F401 - fail loudly (not skip) when vLLM is not installed
    from support.apps import deployed

    with deployed(
        ray_cluster,
        model_dir,
        tmp_path_factory.mktemp("megatron-vllm"),
        "megatronvllm",
        engine="vllm",
        num_replicas=1,
        replica_num_cpus=0.5,
        replica_env=VLLM_ENV,
        control_timeout_s=60.0,
        vllm={"dtype": "float32", "max_model_len": 256},
    ) as served:
        yield served


def _served_prompt_logprobs(app) -> list[list[float | None]]:
    """vLLM's logprob of every PROBE token given the ones before it, through the app's
    /v1/completions (None for the first)."""
    rows = []
    for ids in PROBE:
        answer = httpx.post(
            f"{app.base_url}/v1/completions",
            json={"model": "tiny-llama", "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0},
            timeout=120.0,
        )
        assert answer.status_code == 200, answer.text
        (choice,) = answer.json()["choices"]
        assert choice["prompt_token_ids"] == ids, choice
        rows.append(
            [None if p is None else p[str(t)]["logprob"] for p, t in zip(choice["prompt_logprobs"], ids, strict=True)]
        )
    return rows


def _deviation(logits_path: Path, served: list[list[float | None]]) -> float:
    """The largest difference between served prompt logprobs and megatron's own forward's."""
    megatron = torch.log_softmax(load_file(str(logits_path))["logits"], -1)
    worst = 0.0
    for row, ids in enumerate(PROBE):
        assert served[row][0] is None
        for i in range(1, len(ids)):
            worst = max(worst, abs(served[row][i] - megatron[row, i - 1, ids[i]].item()))
    return worst


def test_megatrons_gathered_weights_reach_vllm_by_your_own_transfer_and_the_object_store(runs, vllm_app, model_dir):
    """The published checkpoints into a served vLLM replica by two of the trainer's transfer modes,
    each under ProfiledWeightSync: the TP2 gather by the trainer's own transfer (vLLM's in-place
    reload through the app's engine RPC, then vLLM's version set: ExternalPublisher), then the PP2
    gather through the Ray object store (InClusterPublisher), the initial weights published between
    them (both layouts train to the same weights). After each, the app serves the version and
    vLLM's prompt logprobs are megatron's own forward's; before each, they are not."""
    from ray import serve

    from profiling.config import GlobalProfilerConfig
    from profiling.schedule import StepSchedule
    from trainer.client import RolloutClient
    from trainer.in_cluster import InClusterWeights
    from trainer.profiled_sync import ExternalPublisher, InClusterPublisher, ProfiledWeightSync

    handle = serve.get_app_handle(vllm_app.name)

    async def rpc(method: str, args: list, kwargs: dict) -> None:
        reports = await handle.engine_rpc.remote(method, args, kwargs)
        assert all(r.ok for r in reports), reports

    async def move(version: int) -> None:  # the trainer's own transfer of the TP2 checkpoint
        await rpc("collective_rpc", ["reload_weights"], {"kwargs": {"weights_path": str(runs["tp2"]["checkpoint"])}})
        await rpc("update_weight_version", [version], {})

    async def publish(version: int, publisher, weights=None) -> str:
        async with RolloutClient(vllm_app.base_url, timeout_s=120.0) as client:
            sync = ProfiledWeightSync(
                StepSchedule.from_config(GlobalProfilerConfig()), client, save_path=None, publisher=publisher
            )
            async with sync:
                report = await sync.sync(version, weights)
            sync.shutdown()
            return report.cost.transfer

    def served_version() -> int:
        status = httpx.get(f"{vllm_app.base_url}/profile/status", timeout=30.0).json()
        (version,) = {status["weight_version"], *(r["weight_version"] for r in status["replicas"])}
        return version

    def weights_of(path: Path):
        state = load_file(str(path / "model.safetensors"))

        async def publish() -> dict[str, torch.Tensor]:
            return state

        return publish

    initial = _served_prompt_logprobs(vllm_app)
    tp2, pp2 = runs["tp2"], runs["pp2"]
    # The check can fail: the weights the replica starts with are not megatron's after its steps.
    assert (
        _deviation(tp2["logits"], initial) > VLLM_LOGPROB_TOL and _deviation(pp2["logits"], initial) > VLLM_LOGPROB_TOL
    )

    assert asyncio.run(publish(1, ExternalPublisher(move))) == "external" and served_version() == 1
    assert _deviation(tp2["logits"], _served_prompt_logprobs(vllm_app)) < VLLM_LOGPROB_TOL

    # Back to the initial weights through the object store (TP2 and PP2 trained to the same
    # weights, so only a change in between shows that the PP2 gather is what is served after it).
    in_cluster = InClusterPublisher(InClusterWeights(vllm_app.name))
    assert asyncio.run(publish(2, in_cluster, weights_of(model_dir))) == "object_store" and served_version() == 2
    assert _deviation(pp2["logits"], _served_prompt_logprobs(vllm_app)) > VLLM_LOGPROB_TOL

    assert (
        asyncio.run(publish(3, in_cluster, weights_of(pp2["checkpoint"]))) == "object_store" and served_version() == 3
    )
    assert _deviation(pp2["logits"], _served_prompt_logprobs(vllm_app)) < VLLM_LOGPROB_TOL
