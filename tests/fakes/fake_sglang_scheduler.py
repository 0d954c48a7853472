"""The engine side of the FAKE SGLang server (tests/fakes/fake_sglang_server.py): NOT SGLang.

It copies the behaviour of SGLang 0.5.x's scheduler that the SGLang engine adapter depends on,
from `sglang/srt/managers/scheduler.py` (run_batch: `forward_ct += 1`, then the profiler
predicate, then the forward), `scheduler_components/profiler_manager.py` (start/stop, num_steps
auto-stop, trace file naming, messages) and the weight-update path (`update_weights_from_disk`,
then `flush_cache`, whose failure is an assertion that kills the scheduler):

* one scheduler thread runs every batch and every control request between batches, as SGLang's
  scheduler event loop does; torch.profiler starts, records and stops on that thread;
* a batch is one decode step of every running request, inside a `run_batch` record_function
  range (SGLang opens that range around a batch launch in its pipeline-parallel loop);
* generation runs the real checkpoint at --model-path with transformers, on CPU, without a KV
  cache (each step re-reads the whole sequence);
* pause modes: `abort` ends every request, `retract` sets running requests aside (they keep
  their tokens and continue after /continue_generation), `in_place` freezes them where they are.

Not copied: batching across requests inside one forward, KV cache, radix cache, streaming,
tensor/pipeline parallelism (always TP-0), CUDA (GPU activity is recorded only where CUDA exists;
CUDA_PROFILER, MEM and RPD activities fail cleanly instead of crashing as they would on CPU).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

log = logging.getLogger("fake_sglang")

_IDLE_WAIT_S = 0.05
_NEEDS_DEVICE = {"CUDA_PROFILER", "MEM", "RPD", "XPU"}


@dataclass
class SamplingParams:
    """SGLang's SamplingParams keywords (`sglang/srt/sampling/sampling_params.py`): an unknown
    keyword is a TypeError, as in SGLang. The fake acts on max_new_tokens, temperature,
    ignore_eos, stop_token_ids and sampling_seed; it accepts and ignores the others."""

    max_new_tokens: int = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    custom_params: dict | None = None
    stream_interval: int | None = None
    logit_bias: dict | None = None
    sampling_seed: int | None = None

    def verify(self) -> None:
        """SGLang's checks and messages (ValueError: HTTP 400 on /generate)."""
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")


@dataclass
class Req:
    """One generation request inside the scheduler."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    done: Callable[[dict], None]
    """Called on the scheduler thread with the finished answer."""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    retractions: int = 0
    created: float = field(default_factory=time.time)
    generator: torch.Generator | None = None


@dataclass
class ProfileReq:
    """The fields of SGLang's ProfileReq that the scheduler reads."""

    output_dir: str | None = None
    start_step: int | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    profile_by_stage: bool = False
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_id: str | None = None
    merge_profiles: bool = False
    profile_prefix: str | None = None


class ProfilerManager:
    """SGLang's SchedulerProfilerManager (non-V2 path), for one TP rank, rank 0."""

    def __init__(self) -> None:
        self.torch_profiler: torch.profiler.profile | None = None
        self.in_progress = False
        self.output_dir = Path("/tmp")
        self.activities: list[str] = []
        self.with_stack: bool | None = None
        self.record_shapes: bool | None = None
        self.profile_id = ""
        self.prefix = ""
        self.start_ct: int | None = None
        self.target_ct: int | None = None

    def handle(self, req: ProfileReq, start: bool, forward_ct: int) -> tuple[bool, str]:
        """SGLang's `_profile`: a start with start_step only arms; one without starts now."""
        if not start:
            return self.stop()
        if req.profile_by_stage:
            return False, "fake SGLang server: profile_by_stage is not implemented"
        armed = self._init(req, forward_ct)
        if req.start_step or not armed[0]:
            return armed
        return self.start()

    def _init(self, req: ProfileReq, forward_ct: int) -> tuple[bool, str]:
        if self.in_progress:
            return False, "Profiling is already in progress. Call /stop_profile first."
        self.output_dir = Path(req.output_dir or os.getenv("SGLANG_TORCH_PROFILER_DIR", "/tmp")).expanduser()
        self.activities = req.activities if req.activities is not None else ["CPU", "GPU"]
        self.with_stack, self.record_shapes = req.with_stack, req.record_shapes
        self.profile_id = req.profile_id or str(time.time())
        self.prefix = req.profile_prefix or ""
        self.start_ct = max(req.start_step, forward_ct + 1) if req.start_step else None
        if req.num_steps:
            base = self.start_ct if self.start_ct else forward_ct + 1
            self.target_ct = base + req.num_steps
        else:
            self.target_ct = None
        return True, "Succeeded"

    def start(self) -> tuple[bool, str]:
        needs_device = sorted(_NEEDS_DEVICE.intersection(self.activities))
        if needs_device:
            return False, f"fake SGLang server: activities {needs_device} need a GPU, which this fake does not drive"
        activity_map = {"CPU": torch.profiler.ProfilerActivity.CPU}
        if torch.cuda.is_available():
            activity_map["GPU"] = torch.profiler.ProfilerActivity.CUDA
        torch_activities = [activity_map[a] for a in self.activities if a in activity_map]
        log.info("Profiling starts. Traces will be saved to: %s (with profile id: %s)", self.output_dir, self.profile_id)
        if torch_activities:  # as in SGLang, no known activity: nothing starts, yet "Succeeded"
            self.torch_profiler = torch.profiler.profile(
                activities=torch_activities,
                with_stack=self.with_stack if self.with_stack is not None else True,
                record_shapes=self.record_shapes if self.record_shapes is not None else False,
            )
            try:
                self.torch_profiler.start()
            except RuntimeError as e:
                self.torch_profiler = None
                return False, str(e)
            self.in_progress = True
        return True, "Succeeded"

    def stop(self) -> tuple[bool, str]:
        if not self.in_progress:
            return False, "Profiling is not in progress. Call /start_profile first."
        self.output_dir.mkdir(parents=True, exist_ok=True)
        assert self.torch_profiler is not None
        self.torch_profiler.stop()
        prefix = f"{self.prefix}-" if self.prefix else ""
        path = self.output_dir / f"{prefix}{self.profile_id}-TP-0.trace.json.gz"
        self.torch_profiler.export_chrome_trace(str(path))
        log.info("Profiling done. Traces are saved to: %s", self.output_dir)
        self.torch_profiler = None
        self.in_progress = False
        self.start_ct = None
        return True, "Succeeded."

    def predicate(self, forward_ct: int) -> None:
        """Before each batch: stop once the target step count is reached, start when armed."""
        if self.target_ct and self.target_ct <= forward_ct and self.in_progress:
            self.stop()
            self.target_ct = None
        if self.start_ct and self.start_ct == forward_ct:
            self.start()


class Scheduler:
    """The scheduler thread: batches, control requests between batches, weights, profiler."""

    def __init__(self, model_path: Path, step_delay_s: float = 0.0):
        """`step_delay_s`: a pause after each batch (a fake-only knob), so that a test can catch
        a long request in flight on a fast machine."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)  # replicas and servers share a small CPU
        self.model_path = model_path
        self.step_delay_s = step_delay_s
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.context_len = int(self.model.config.max_position_embeddings)
        self.vocab_size = int(self.model.config.vocab_size)
        self.eos = self.tokenizer.eos_token_id
        self.weight_version = "default"
        self.forward_ct = 0
        self.profiler = ProfilerManager()
        self._cond = threading.Condition()
        self._controls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._waiting: deque[Req] = deque()
        self._running: list[Req] = []
        self._retracted: list[Req] = []
        self._paused: str | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="fake-sglang-scheduler", daemon=True)
        self._thread.start()

    # -- called from the HTTP event loop -------------------------------------------------------
    def submit(self, req: Req) -> None:
        with self._cond:
            self._waiting.append(req)
            self._cond.notify()

    async def control(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the scheduler thread between batches; its result."""
        fut: Future = Future()
        with self._cond:
            self._controls.append((fn, fut))
            self._cond.notify()
        return await asyncio.wrap_future(fut)

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # -- control requests (scheduler thread) ---------------------------------------------------
    def pause(self, mode: str) -> None:
        if mode == "abort":
            self.abort_all()
            return
        self._paused = mode
        if mode == "retract":
            for req in [*self._running, *self._waiting]:
                req.retractions += 1
            self._retracted.extend([*self._running, *self._waiting])
            self._running.clear()
            self._waiting.clear()

    def resume(self) -> None:
        self._paused = None
        self._waiting.extendleft(reversed(self._retracted))
        self._retracted.clear()

    def abort_all(self) -> None:
        for req in [*self._running, *self._waiting, *self._retracted]:
            self._finish(req, {"type": "abort", "message": "Abort in waiting queue"})
        self._running.clear()
        self._waiting.clear()
        self._retracted.clear()

    def update_weights_from_disk(self, model_path: str, flush_cache: bool) -> tuple[bool, str]:
        """SGLang's path: load (rolling back on failure), then flush the cache, whose failure is
        an AssertionError that ends the scheduler process."""
        success, message = self._load_weights(model_path)
        if success and flush_cache and not self._can_flush():
            log.error(
                "AssertionError: Cache flush failed after updating weights (%d running requests in "
                "pause mode %r); the scheduler exits",
                len(self._running) + len(self._waiting),
                self._paused,
            )
            os._exit(1)
        if not success:
            log.error(message)
        return success, message

    def _can_flush(self) -> bool:
        # SGLang's flush_cache refuses while requests run or wait; retracted requests have
        # released their KV cache and do not count.
        return not self._running and not self._waiting

    def _load_weights(self, model_path: str) -> tuple[bool, str]:
        path = Path(model_path)
        if not path.exists():
            return False, f"Failed to get weights iterator: {model_path} (repository not found)."
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            return False, f"Failed to get weights iterator: Cannot find any model weights with `{model_path}`."
        try:
            state: dict[str, torch.Tensor] = {}
            for f in files:
                state.update(load_file(str(f)))
        except Exception as e:  # noqa: BLE001 - SGLang reports any loader failure in the message
            return False, f"Failed to get weights iterator: {e}."
        params = self.model.state_dict()
        for name, tensor in state.items():
            if name not in params:
                return False, f"Failed to update weights: KeyError({name!r}).\nRolling back to original weights."
            if tuple(tensor.shape) != tuple(params[name].shape):
                return False, (
                    f"Failed to update weights: Attempted to load weight ({tuple(tensor.shape)}) into parameter "
                    f"({tuple(params[name].shape)}) for {name}.\nRolling back to original weights."
                )
        with torch.no_grad():
            for name, tensor in state.items():
                params[name].copy_(tensor.to(params[name].dtype))
        log.info("Update weights end.")
        return True, "Succeeded to update model weights."

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopped or self._controls or (self._paused is None and (self._waiting or self._running))):
                    self._cond.wait(_IDLE_WAIT_S)
                if self._stopped:
                    return
                controls = list(self._controls)
                self._controls.clear()
                if self._paused is None:
                    self._running.extend(self._waiting)
                    self._waiting.clear()
            for fn, fut in controls:
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the HTTP route
                    fut.set_exception(e)
            if self._paused is None and self._running:
                self._run_batch()
                if self.step_delay_s:
                    time.sleep(self.step_delay_s)

    def _run_batch(self) -> None:
        self.forward_ct += 1
        self.profiler.predicate(self.forward_ct)
        with torch.profiler.record_function("run_batch"), torch.no_grad():
            for req in list(self._running):
                self._decode_one(req)

    def _decode_one(self, req: Req) -> None:
        if req.params.max_new_tokens == 0:
            self._running.remove(req)
            self._finish(req, {"type": "length", "length": 0})
            return
        ids = torch.tensor([req.input_ids + req.output_ids])
        logits = self.model(ids).logits[0, -1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        if req.params.temperature == 0.0:
            token = int(logits.argmax())
        else:
            probs = torch.softmax(logits / req.params.temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=req.generator))
        req.output_ids.append(token)
        req.logprobs.append(float(logprobs[token]))
        stop_ids = set(req.params.stop_token_ids or []) | ({self.eos} if not req.params.ignore_eos else set())
        if token in stop_ids:
            self._running.remove(req)
            self._finish(req, {"type": "stop", "matched": token})
        elif len(req.output_ids) >= req.params.max_new_tokens:
            self._running.remove(req)
            self._finish(req, {"type": "length", "length": len(req.output_ids)})

    def _finish(self, req: Req, finish_reason: dict) -> None:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": finish_reason,
            "prompt_tokens": len(req.input_ids),
            "weight_version": self.weight_version,
            "total_retractions": req.retractions,
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "e2e_latency": time.time() - req.created,
        }
        if req.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logprobs, req.output_ids, strict=True)]
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens)
        req.done({"text": text, "output_ids": list(req.output_ids), "meta_info": meta})

    def new_request(self, input_ids: list[int], params: SamplingParams, return_logprob: bool, rid: str | None,
                    done: Callable[[dict], None]) -> Req:
        """SGLang's request checks (ValueError: HTTP 400), then a request ready to submit."""
        if len(input_ids) >= self.context_len:
            raise ValueError(
                f"The input ({len(input_ids)} tokens) is longer than the model's context length ({self.context_len} tokens)."
            )
        bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"fake SGLang server: token ids {bad[:5]} are outside the vocabulary of {self.vocab_size}")
        params.verify()
        if 0 <= params.temperature < 1e-6:  # SGLang: greedy
            params = dataclasses.replace(params, temperature=0.0)
        generator = None
        if params.sampling_seed is not None:
            generator = torch.Generator().manual_seed(params.sampling_seed)
        return Req(rid or uuid.uuid4().hex, list(input_ids), params, return_logprob, done, generator=generator)
