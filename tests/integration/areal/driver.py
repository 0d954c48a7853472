"""AReaL 1.0.4's own `RemoteSGLangEngine` driving the app as it drives an SGLang server, through
AReaL's training loop's rollout calls (areal/trainer/rl_trainer.py, areal/engine/fsdp_engine.py's
disk-mode weight update). Started by tests/integration/test_areal_client.py with the project's
interpreter and AReaL, installed `--no-deps`, first on PYTHONPATH; imports nothing of the project.
Prints one JSON object: what AReaL saw.

    python driver.py ADDR MODEL_DIR WEIGHTS_DIR WORK_DIR PROMPTS_JSON [--versions N] [--group G]

ADDR is what AReaL is given as a server address: host:port, or host:port/<route prefix>.

For each version v = 0 .. N-1 (AReaL's global step v):

1. rollout: `rollout_batch` over the prompts with `group_size` G (AReaL's GRPO group: G
   concurrent `agenerate` calls per prompt, each one `POST /generate`);
2. a long request is submitted and left running (the sync starts once the app runs it), as
   AReaL's asynchronous rollout leaves some in flight when a step ends;
3. the sync that publishes version v+1, as AReaL's trainer makes it: `pause()` (AReaL's own
   dispatcher), then the actor's disk update (`pause_generation` -> `update_weights_from_disk`,
   which waits for the trainer's `name_resolve` key -> the trainer writes an HF checkpoint under
   the app's weights_dir and publishes the key -> `continue_generation`), then `set_version(v+1)`
   and `resume()`;
4. the long request is collected: AReaL re-sends whatever an abort cut short after the resume.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from datetime import datetime
from typing import Any

import requests
import torch
from areal.api import InferenceEngine, ModelRequest, RolloutWorkflow, WeightUpdateMeta
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, NameResolveConfig
from areal.api.io_struct import HttpGenerationResult, HttpRequest
from areal.engine.sglang_remote import RemoteSGLangEngine, SGLangBackend
from areal.utils import name_resolve, names
from areal.utils.hf_utils import load_hf_tokenizer
from transformers import AutoModelForCausalLM

EXPERIMENT, TRIAL = "areal-app", "trial0"
LONG_TOKENS = 400
"""The request left in flight across a sync: long enough to be running still when the sync starts
(within the tiny model's 512 positions)."""


class RecordingBackend(SGLangBackend):
    """AReaL's own SGLang backend, unchanged, that also keeps what each `/generate` carried and
    the answer's fields that AReaL does not surface (the server's finish reason and weight
    version per HTTP answer): an observer, not a replacement. AReaL builds a request, posts it
    and parses its answer in one asyncio task, which pairs the two."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.answers: list[dict[str, Any]] = []
        self._in_flight: dict[asyncio.Task[Any] | None, dict[str, Any]] = {}

    def build_generation_request(self, req: ModelRequest, with_lora: bool, version: int) -> HttpRequest:
        http_req = super().build_generation_request(req, with_lora, version)
        body = {k: v for k, v in http_req.payload.items() if k != "input_ids"}
        record = {"rid": req.rid, "prompt_len": len(req.input_ids), "body": body}
        self._in_flight[asyncio.current_task()] = record
        self.sent.append(record)
        return http_req

    def parse_generation_response(self, response: dict[str, Any]) -> HttpGenerationResult:
        meta = response["meta_info"]
        self.answers.append(
            {
                **self._in_flight.pop(asyncio.current_task(), {}),
                "finish_reason": meta["finish_reason"],
                "weight_version": meta.get("weight_version"),
                "completion_tokens": meta.get("completion_tokens"),
                "output_ids": response.get("output_ids"),
                "n_logprobs": len(meta.get("output_token_logprobs") or []),
            }
        )
        return super().parse_generation_response(response)


class Samples(RolloutWorkflow):
    """A minimal GRPO episode (AReaL's RLVRWorkflow without the chat template and the reward):
    one `agenerate` per call, the result as AReaL's trajectory tensors; every response is also
    kept for the report."""

    def __init__(self, gconfig: GenerationHyperparameters, tokenizer: Any, seen: list[dict[str, Any]]):
        self.gconfig = gconfig
        self.tokenizer = tokenizer
        self.seen = seen

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, torch.Tensor]:
        req = ModelRequest(
            rid=uuid.uuid4().hex,
            input_ids=list(data["input_ids"]),
            gconfig=self.gconfig.new(n_samples=1),
            tokenizer=self.tokenizer,
        )
        resp = await engine.agenerate(req)
        self.seen.append(
            {
                "rid": req.rid,
                "prompt": data["input_ids"],
                "input_tokens": resp.input_tokens,
                "output_tokens": resp.output_tokens,
                "output_logprobs": resp.output_logprobs,
                "output_versions": resp.output_versions,
                "stop_reason": resp.stop_reason,
            }
        )
        seq = resp.input_tokens + resp.output_tokens
        res = {
            "input_ids": torch.tensor(seq, dtype=torch.int32),
            "loss_mask": torch.tensor([0] * resp.input_len + [1] * resp.output_len, dtype=torch.int32),
            "logprobs": torch.tensor([0.0] * resp.input_len + resp.output_logprobs, dtype=torch.float32),
            "versions": torch.tensor([-1] * resp.input_len + resp.output_versions, dtype=torch.int32),
            "attention_mask": torch.ones(len(seq), dtype=torch.bool),
            "rewards": torch.tensor(0.0, dtype=torch.float32),
        }
        return {k: v.unsqueeze(0) for k, v in res.items()}


def wait_running(backend: RecordingBackend, since: int, addr: str, timeout: float = 60.0) -> None:
    """Until AReaL has sent its long request (one for LONG_TOKENS after its `since`-th request)
    and the app runs it (its own status route, not AReaL's): AReaL's dispatcher starts a submitted
    task in its own thread, and a `pause()` before it starts would keep it from starting at all."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["body"]["sampling_params"]["max_new_tokens"] == LONG_TOKENS for r in backend.sent[since:]):
            replicas = requests.get(f"http://{addr}/profile/status", timeout=10).json()["replicas"]
            if sum(r.get("requests_in_flight") or 0 for r in replicas):
                return
        time.sleep(0.01)
    raise TimeoutError(f"AReaL's long request was not running on the app within {timeout:g}s")


def save_checkpoint(model_dir: str, path: str, tokenizer: Any, seed: int) -> None:
    """What AReaL's actor does before it publishes the key (`_save_model_to_hf`): an HF
    directory (config + safetensors + tokenizer), here the served model with seeded noise."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def drive(args: argparse.Namespace) -> dict[str, Any]:
    """AReaL's rollout side of `args.versions` training steps against the app; what it saw."""
    # Disk-mode sync rendezvous: the trainer's key in AReaL's NFS name_resolve, here a private dir.
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=f"{args.work_dir}/name_resolve"))
    tokenizer = load_hf_tokenizer(args.model_dir)
    prompts: list[list[int]] = json.loads(args.prompts)
    config = InferenceEngineConfig(
        backend="sglang:d1",
        experiment_name=EXPERIMENT,
        trial_name=TRIAL,
        fileroot=args.weights_dir,  # AReaL's checkpoints land under <fileroot>/checkpoints/...
        tokenizer_path=args.model_dir,
        # AReaL's staleness control admits (offpolicyness + version + 1) * consumer_batch_size
        # episodes in all: each version takes one group per prompt and the long request.
        consumer_batch_size=len(prompts) + 1,
        max_concurrent_rollouts=len(prompts) + 1,
        max_head_offpolicyness=0,
        setup_timeout=60.0,
        request_timeout=120.0,
        request_retries=1,  # fail on the first refusal: a retried 4xx would only hide it
    )
    engine = RemoteSGLangEngine(config)
    backend = RecordingBackend()
    engine._engine.backend = backend  # observe AReaL's own backend (see RecordingBackend)
    engine.initialize(addr=[args.addr])
    # rl_trainer's GRPO sampling: AReaL's defaults (temperature 1, top_p 1, top_k 1e8), stop on
    # pad/eos as RLVRWorkflow adds them; max_new_tokens small for CPU.
    gconfig = GenerationHyperparameters(max_new_tokens=args.max_new_tokens).new_with_stop_and_pad_token_ids(tokenizer)
    long_gconfig = GenerationHyperparameters(max_new_tokens=LONG_TOKENS, greedy=True, ignore_eos=True)
    meta = WeightUpdateMeta.from_disk(EXPERIMENT, TRIAL, args.weights_dir)
    got: dict[str, Any] = {"steps": [], "stop_token_ids": gconfig.stop_token_ids}
    t0 = time.monotonic()
    try:
        for step in range(args.versions):
            seen: list[dict[str, Any]] = []
            first_answer = len(backend.answers)
            batch = engine.rollout_batch(
                [{"input_ids": p} for p in prompts],
                workflow=Samples(gconfig, tokenizer, seen),
                group_size=args.group,
            )
            rolled = time.monotonic()
            long_seen: list[dict[str, Any]] = []
            sent_before = len(backend.sent)
            engine.submit({"input_ids": prompts[0]}, workflow=Samples(long_gconfig, tokenizer, long_seen))
            wait_running(backend, sent_before, args.addr)

            # rl_trainer: rollout.pause() -> actor.update_weights(meta.with_version(step + 1)) -> set_version
            engine.pause()
            versioned = meta.with_version(step + 1)
            engine.pause_generation()  # fsdp_engine._update_weights_from_disk, rank 0
            in_flight_at_pause = not long_seen
            fut = engine.update_weights_from_disk(versioned)
            save_checkpoint(args.model_dir, str(versioned.path), tokenizer, seed=100 + step)
            name_resolve.add(
                names.update_weights_from_disk(EXPERIMENT, TRIAL, engine.get_version()),
                str(datetime.now().timestamp()),
                keepalive_ttl=120,
            )
            fut.result(timeout=180)
            engine.continue_generation()
            engine.set_version(step + 1)
            engine.resume()
            synced = time.monotonic()
            engine.wait(count=1, timeout=180)
            got["steps"].append(
                {
                    "version": step,
                    "batch": len(batch),
                    "batch_shapes": [list(t["input_ids"].shape) for t in batch],
                    "samples": seen,
                    "long": long_seen,
                    "long_in_flight_at_pause": in_flight_at_pause,
                    "answers": backend.answers[first_answer:],
                    "path": str(versioned.path),
                    "rollout_s": round(rolled - t0, 2),
                    "sync_s": round(synced - rolled, 2),
                }
            )
            t0 = time.monotonic()
        got["final_version"] = engine.get_version()
    finally:
        engine.destroy()
    return got


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("addr")
    parser.add_argument("model_dir")
    parser.add_argument("weights_dir")
    parser.add_argument("work_dir")
    parser.add_argument("prompts", help="JSON list of token-id prompts")
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    print(json.dumps(drive(parser.parse_args())))
