"""The engine side of the FAKE SGLang server (tests/fakes/fake_sglang_server.py): NOT SGLang.

It copies the behaviour of SGLang 0.5.x's scheduler that the SGLang engine adapter depends on,
from `sglang/srt/managers/scheduler.py` (run_batch: `forward_ct += 1`, then the profiler
predicate, then the forward; `flush_cache`), `scheduler_components/profiler_manager.py`
(start/stop, num_steps auto-stop, trace file naming, messages) and the weight-update path
(`scheduler_components/weight_updater.py`: load, record the version, then flush the cache, a
refused flush failing the call after the weights changed):

* one scheduler thread runs every batch and every control request between batches, as SGLang's
  scheduler event loop does; torch.profiler starts, records and stops on that thread;
* a batch is one forward, inside the range SGLang's model runner opens around every forward
  (`step_span_name`: `step[EXTEND bs=<n> toks=<t>]` for the requests not yet prefilled (new, or
  retracted), else `step[DECODE bs=<n>]` for every running request; `ModelRunner.forward` in
  `sglang/srt/model_executor/model_runner.py`, `build_step_span_name` in
  `sglang/srt/utils/profile_utils.py`); tests/unit/engines/sglang/test_package.py checks the names
  against the installed SGLang;
* generation runs the real checkpoint at --model-path with transformers, on CPU, without a KV
  cache (each step re-reads the whole sequence); the radix cache is kept as bookkeeping only
  (`cached_weights`: which loaded weights computed the KV it would hold; a forward while it holds
  another load's KV is a `stale_cache_forwards`, one that SGLang would let reuse it), emptied by a
  flush alone, which SGLang refuses while a request is in the running batch (no pause, or an
  `in_place` one) and, unpaused, while one waits;
* pause modes: `abort` ends every request, `retract` sets running requests aside (they keep
  their tokens and continue after /continue_generation), `in_place` freezes them where they are;
* `/abort_request` (scheduler.py's `abort_request`): a request off the running batch (waiting, or
  set aside by a retract pause) ends at once, echoed with {"type": "abort", "message": "Abort in
  waiting queue"} and its tokens so far (the tokenizer manager's `_handle_abort_req`); a running
  one is marked `to_finish` and ends after one more forward, keeping its token, with
  FINISH_ABORT's {"type": "abort", "message": "Aborted", "status_code": null, "err_type": null};
  rids match by prefix, as SGLang's do;
* sampling (`sglang/srt/sampling/sampling_params.py`, `penaltylib/`, `schedule_batch.py`'s
  `update_finish_state`): penalties, min_new_tokens masking EOS and stop tokens, temperature,
  top-k/top-p/min-p, a per-request generator for `sampling_seed`; finishing on a stop string
  (`matched`: the string), else a stop token or EOS (none with ignore_eos, which in SGLang also
  ignores stop_token_ids), else the length; logprobs with `top_logprobs_num` and prompt logprobs
  from `logprob_start_len`;
* weight versions (`sglang/srt/utils/weight_versions.py`): each chunk's `weight_version`, and on
  the finished one the `weight_versions` spans over the output;
* SGLang's own distributed update (`scheduler_components/weight_updater.py`): a weight-update
  session (`begin_weight_update`/`end_weight_update`) outside which `update_weights_from_distributed`
  is refused; inside, the broadcast is received from the trainer's group
  (tests/fakes/fake_sglang_weight_group.py), loaded, the version recorded, then the cache flushed,
  a refused flush (requests still running) failing the call, as from disk.

Not copied: batching across requests inside one forward, KV and radix cache (bookkeeping only), the stream's
hold-back of a possible stop-string prefix, stop_regex, grammars, logit_bias, n > 1 and beams,
tensor/pipeline parallelism (always TP-0), SGLang's `scheduler.*` stage ranges, CUDA (GPU activity is
recorded only where CUDA exists; CUDA_PROFILER, MEM and RPD activities fail cleanly instead of crashing as
they would on CPU).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from fakes.fake_sglang_weight_group import WeightGroups

log = logging.getLogger("fake_sglang")

_IDLE_WAIT_S = 0.05
_NEEDS_DEVICE = {"CUDA_PROFILER", "MEM", "RPD", "XPU"}


FLUSH_REFUSED_AFTER_UPDATE = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. "
    "Retract or finish them, then call /flush_cache."
)
"""SGLang's message (`flush_cache_after_weight_update`) when a weight update's flush is refused."""

ABORT_ECHO = "fake_abort_echo"
"""Fake-only key of an output that is SGLang's abort echo (`_handle_abort_req`): the HTTP side
drops it before sending, and shapes that chunk as SGLang does."""

_SAMPLING_EPS = 1e-6
TOP_K_ALL = 1 << 30


@dataclass
class SamplingParams:
    """SGLang's SamplingParams keywords (`sglang/srt/sampling/sampling_params.py`, 0.5.23): an
    unknown keyword is a TypeError, as in SGLang. The fake acts on max_new_tokens, stop,
    stop_token_ids, temperature, top_p, top_k, min_p, the three penalties, min_new_tokens,
    ignore_eos and sampling_seed; it accepts and ignores the others (grammars, n, beams, ...)."""

    max_new_tokens: int = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    beam_width: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None
    logit_bias: dict | None = None
    sampling_seed: int | None = None
    custom_params: dict | None = None
    watermark: dict | None = None

    def __post_init__(self) -> None:
        """SGLang's special cases: near-zero temperature is greedy (top_k 1), -1 is no top-k."""
        if 0 <= self.temperature < _SAMPLING_EPS:
            self.temperature = 1.0
            self.top_k = 1
        if self.top_k == -1:
            self.top_k = TOP_K_ALL

    @property
    def stop_strs(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def verify(self) -> None:
        """SGLang's checks and messages (ValueError: HTTP 400 on /generate)."""
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be a non-negative finite number, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k < 1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {self.repetition_penalty}.")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], got {self.min_new_tokens}."
            )


def step_span_name(mode: str, batch_size: int, extend_tokens: int) -> str:
    """The name of SGLang's range around one forward (`build_step_span_name` without detailed
    annotations): `step[<MODE> bs=<n>]`, with ` toks=<t>` for an EXTEND batch."""
    toks = f" toks={extend_tokens}" if mode == "EXTEND" else ""
    return f"step[{mode} bs={batch_size}{toks}]"


def trace_file_name(profile_prefix: str | None, profile_id: str, tp_rank: int = 0) -> str:
    """The file SGLang's profiler manager exports one recording of one rank to (`_stop_profile`,
    no DP/PP/EP, not by stage): `[{profile_prefix}-]{profile_id}-TP-{tp_rank}.trace.json.gz`."""
    prefix = f"{profile_prefix}-" if profile_prefix else ""
    return f"{prefix}{profile_id}-TP-{tp_rank}.trace.json.gz"


@dataclass
class Req:
    """One generation request inside the scheduler."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    emit: Callable[[dict], None]
    """Called on the scheduler thread with the output so far (after each step of a streamed
    request, and once finished): cumulative `output_ids` and `meta_info`, as SGLang's tokenizer
    manager keeps them; the HTTP side slices them for incremental streaming."""
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    version_events: list[tuple[str, int]] = field(default_factory=list)
    """(old version, output tokens then) at each weight-version change while in flight."""
    retractions: int = 0
    to_finish: dict | None = None
    """SGLang's `to_finish`: the finish reason of its next forward (an abort of a running request)."""
    prefilled: bool = False
    """Its sequence so far has been through a forward (a retraction clears it: SGLang drops the
    KV cache and prefills the request again)."""
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
        self.output_dir = Path(req.output_dir or os.getenv("SGLANG_TORCH_PROFILER_DIR") or "/tmp").expanduser()
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
        log.info(
            "Profiling starts. Traces will be saved to: %s (with profile id: %s)", self.output_dir, self.profile_id
        )
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
        path = self.output_dir / trace_file_name(self.prefix, self.profile_id)
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
        self.forwards: list[tuple[str, bool]] = []
        """Fake-only, for tests: (weight version, recorded by the profiler) of every forward."""
        self.weights_loaded = 0
        """Fake-only: how many times weights were copied in (0: the checkpoint at --model-path)."""
        self.cached_weights: set[int] = set()
        """Fake-only: the loads (`weights_loaded`) whose KV the radix cache would hold."""
        self.stale_cache_forwards = 0
        """Fake-only, for tests: forwards run while the radix cache held KV of weights no longer
        served, which SGLang would let a request with that prefix reuse."""
        self.profiler = ProfilerManager()
        self.weight_groups = WeightGroups()
        self._weight_session: dict[str, bool] | None = None
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

    def control_soon(self, fn: Callable[[], Any]) -> None:
        """Run `fn` on the scheduler thread between batches, without waiting for it."""
        with self._cond:
            self._controls.append((fn, Future()))
            self._cond.notify()

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
                req.prefilled = False
            self._retracted.extend([*self._running, *self._waiting])
            self._running.clear()
            self._waiting.clear()

    def resume(self) -> None:
        self._paused = None
        self._waiting.extendleft(reversed(self._retracted))
        self._retracted.clear()

    def abort_all(self) -> None:
        for req in [*self._running, *self._waiting, *self._retracted]:
            self._finish(
                req, {"type": "abort", "message": "Abort in waiting queue", "status_code": None, "err_type": None}
            )
        self._running.clear()
        self._waiting.clear()
        self._retracted.clear()

    def abort_request(self, rid: str, abort_all: bool) -> None:
        """SGLang's scheduler `abort_request`: requests whose rid starts with `rid` (every one with
        `abort_all`) end; see the module docstring for how."""

        def named(req: Req) -> bool:
            return abort_all or req.rid.startswith(rid)

        for req in [r for r in [*self._waiting, *self._retracted] if named(r)]:
            self._finish(req, {"type": "abort", "message": "Abort in waiting queue"}, echo=True)
        self._waiting = deque(r for r in self._waiting if not named(r))
        self._retracted = [r for r in self._retracted if not named(r)]
        for req in self._running:
            if named(req):
                req.to_finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}

    def abort(self, rid: str) -> None:
        """Drop one request whose client went away (SGLang's abort on disconnect)."""
        self._running = [r for r in self._running if r.rid != rid]
        self._retracted = [r for r in self._retracted if r.rid != rid]
        self._waiting = deque(r for r in self._waiting if r.rid != rid)

    def live_requests(self) -> int:
        """Requests running, waiting or retracted (a test's view of freed slots)."""
        return len(self._running) + len(self._waiting) + len(self._retracted)

    def set_weight_version(self, new: str) -> None:
        """SGLang's `record_weight_version_change`: every request in flight that has output
        remembers where the old version's tokens end."""
        if new == self.weight_version:
            return
        for req in [*self._running, *self._waiting, *self._retracted]:
            if req.output_ids:
                req.version_events.append((self.weight_version, len(req.output_ids)))
        self.weight_version = new

    def update_weights_from_disk(
        self, model_path: str, flush_cache: bool, weight_version: str | None
    ) -> tuple[bool, str]:
        """SGLang's path: load (rolling back on failure), record the version, then flush the
        cache; a refused flush fails the call with the new weights loaded."""
        success, message = self._load_weights(model_path)
        if success and weight_version is not None:
            self.set_weight_version(weight_version)
        if success and flush_cache and not self.flush_cache():
            success, message = False, FLUSH_REFUSED_AFTER_UPDATE
        if not success:
            log.error(message)
        return success, message

    def flush_cache(self) -> bool:
        """SGLang's `Scheduler.flush_cache`: empty the radix cache, only when fully idle."""
        if not self._can_flush():
            log.warning(
                "Cache not flushed because there are pending requests. #queue-req: %d, #running-req: %d",
                len(self._waiting),
                len(self._running),
            )
            return False
        self.cached_weights.clear()
        log.info("Cache flushed successfully!")
        return True

    def _can_flush(self) -> bool:
        # SGLang's `is_fully_idle(ignore_waiting=self._engine_paused)`: nothing in the running
        # batch, and unpaused nothing waiting. Retracted requests released their KV and wait in
        # the queue (their prefixes stay in the radix cache).
        return not self._running and (self._paused is not None or not self._waiting)

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
        if error := self._copy_in(state.items()):
            return False, f"Failed to update weights: {error}.\nRolling back to original weights."
        log.info("Update weights end.")
        return True, "Succeeded to update model weights."

    def _copy_in(self, named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
        """Copy `named` tensors into the model, checked first (the model's `load_weights`); the
        error, as SGLang's message words it, if one does not fit."""
        named = list(named)
        params = self.model.state_dict()
        for name, tensor in named:
            if name not in params:
                return f"KeyError({name!r})"
            if tuple(tensor.shape) != tuple(params[name].shape):
                return (
                    f"Attempted to load weight ({tuple(tensor.shape)}) into parameter "
                    f"({tuple(params[name].shape)}) for {name}"
                )
        with torch.no_grad():
            for name, tensor in named:
                params[name].copy_(tensor.to(params[name].dtype))
        self.weights_loaded += 1
        return None

    # -- weights by SGLang's own distributed update (scheduler_components/weight_updater.py) -----
    def begin_weight_update(self) -> tuple[bool, str]:
        """Open a weight-update session (`update_weights_from_distributed` runs only inside one)."""
        if self._weight_session is not None:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self._weight_session = {"loaded_weights": False}
        return True, "Success"

    def end_weight_update(self) -> tuple[bool, str]:
        if self._weight_session is None:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self._weight_session = None
        return True, "Success"

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        load_format: str | None,
        weight_version: str | None,
        flush_cache: bool,
    ) -> tuple[bool, str]:
        """Receive one broadcast from the group and load it, then record the version and flush
        the cache (whose refusal, with requests still running, fails the call in 0.5.23)."""
        if self._weight_session is None:
            return False, (
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            )
        try:
            weights = self.weight_groups.receive(names, dtypes, shapes, group_name, load_format)
        except Exception as e:  # noqa: BLE001 - SGLang answers any receive failure
            message = f"Failed to receive weights: {e}"
            log.error(message)
            return False, message
        if error := self._copy_in(weights):
            message = (
                f"Failed to update parameter online: {error}. The full weights of the ModelRunner are "
                "partially updated. Please discard the whole weights."
            )
            log.error(message)
            return False, message
        self._weight_session["loaded_weights"] = True
        if weight_version is not None:
            self.set_weight_version(weight_version)
        if flush_cache and not self.flush_cache():
            return False, FLUSH_REFUSED_AFTER_UPDATE
        return True, "Succeeded to update parameter online."

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._stopped or self._controls or (self._paused is None and (self._waiting or self._running))
                ):
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
        """One forward: SGLang prefills new requests in a batch of their own before decoding."""
        self.forward_ct += 1
        self.profiler.predicate(self.forward_ct)
        batch = [r for r in self._running if not r.prefilled]
        mode = "EXTEND" if batch else "DECODE"
        batch = batch or list(self._running)
        extend_tokens = sum(len(r.input_ids) + len(r.output_ids) for r in batch)
        self.forwards.append((self.weight_version, self.profiler.in_progress))
        if self.cached_weights - {self.weights_loaded}:
            self.stale_cache_forwards += 1
        self.cached_weights.add(self.weights_loaded)
        with torch.profiler.record_function(step_span_name(mode, len(batch), extend_tokens)), torch.no_grad():
            for req in batch:
                req.prefilled = True
                self._decode_one(req)

    def _decode_one(self, req: Req) -> None:
        if req.params.max_new_tokens == 0:
            self._running.remove(req)
            self._finish(req, {"type": "length", "length": 0})
            return
        ids = torch.tensor([req.input_ids + req.output_ids])
        all_logits = self.model(ids).logits[0].float()
        if req.return_logprob and req.input_logprobs is None:
            self._input_logprobs(req, all_logits)
        logits = all_logits[-1]
        logprobs = torch.log_softmax(logits, dim=-1)
        token = self._sample(req, logits)
        req.output_ids.append(token)
        if req.return_logprob:
            req.logprobs.append(float(logprobs[token]))
            if req.top_logprobs_num > 0:
                req.top_logprobs.append(_topk(logprobs, req.top_logprobs_num))
        reason = req.to_finish or self._finish_reason(req, token)
        if reason is not None:
            self._running.remove(req)
            self._finish(req, reason)
        elif req.stream:
            req.emit(self._output(req, None))

    def _input_logprobs(self, req: Req, logits: torch.Tensor) -> None:
        """SGLang's prompt logprobs from `logprob_start_len`: null for the first position, then
        each prompt token's logprob given the tokens before it (and the top ones)."""
        start = max(req.logprob_start_len, 0) if req.logprob_start_len >= 0 else len(req.input_ids)
        logprobs = torch.log_softmax(logits, dim=-1)
        req.input_logprobs, req.input_top_logprobs = [], []
        for i in range(start, len(req.input_ids)):
            if i == start:
                req.input_logprobs.append(None)
                req.input_top_logprobs.append(None)
                continue
            req.input_logprobs.append(float(logprobs[i - 1, req.input_ids[i]]))
            req.input_top_logprobs.append(
                _topk(logprobs[i - 1], req.top_logprobs_num) if req.top_logprobs_num else None
            )

    def _sample(self, req: Req, logits: torch.Tensor) -> int:
        """Penalties, the min_new_tokens mask, temperature, top-k, top-p and min-p, then one
        draw from the request's own generator (SGLang's sampler, in plain torch)."""
        p = req.params
        logits = logits.clone()
        seen = torch.tensor(req.input_ids + req.output_ids)
        if p.repetition_penalty != 1.0:
            scores = logits[seen]
            logits[seen] = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
        if req.output_ids and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(torch.tensor(req.output_ids), minlength=logits.numel()).float()
            logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if len(req.output_ids) < p.min_new_tokens:  # SGLang's min_new_tokens penalizer
            logits[sorted(self._stop_ids(p, with_eos=True))] = float("-inf")
        if p.top_k == 1:
            return int(logits.argmax())
        probs = torch.softmax(logits / p.temperature, dim=-1)
        if p.top_k < probs.numel():
            kth = torch.topk(probs, p.top_k).values[-1]
            probs[probs < kth] = 0.0
        if p.top_p < 1.0:
            ordered, order = torch.sort(probs, descending=True)
            cut = torch.cumsum(ordered, 0) - ordered > p.top_p * ordered.sum()
            probs[order[cut]] = 0.0
        if p.min_p > 0.0:
            probs[probs < p.min_p * probs.max()] = 0.0
        return int(torch.multinomial(probs, 1, generator=req.generator))

    def _stop_ids(self, params: SamplingParams, *, with_eos: bool) -> set[int]:
        return set(params.stop_token_ids or []) | ({self.eos} if with_eos and self.eos is not None else set())

    def _finish_reason(self, req: Req, token: int) -> dict | None:
        """SGLang's `update_finish_state` order: stop string, then stop token or EOS (none with
        ignore_eos, which in SGLang also ignores stop_token_ids), then length."""
        stops = req.params.stop_strs
        if stops:
            text = self.tokenizer.decode(req.output_ids)
            for stop in stops:
                if stop in text:
                    return {"type": "stop", "matched": stop}
        if not req.params.ignore_eos and token in self._stop_ids(req.params, with_eos=True):
            return {"type": "stop", "matched": token}
        if len(req.output_ids) >= req.params.max_new_tokens:
            return {"type": "length", "length": req.params.max_new_tokens}
        return None

    def _output(self, req: Req, finish_reason: dict | None) -> dict:
        """The request's output so far, shaped as SGLang's tokenizer manager's (cumulative)."""
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": finish_reason,
            "prompt_tokens": len(req.input_ids),
            "weight_version": self.weight_version,
            "num_retractions": req.retractions,
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "e2e_latency": time.time() - req.created,
        }
        if finish_reason is not None:
            spans = _weight_version_spans(req.version_events, self.weight_version, len(req.output_ids))
            meta["weight_versions"] = spans
            meta["weight_version"] = spans[-1]["version"]
        if req.return_logprob:
            prompt = req.input_logprobs or []
            prompt_ids = req.input_ids[len(req.input_ids) - len(prompt) :]
            meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(prompt, prompt_ids, strict=True)]
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logprobs, req.output_ids, strict=True)]
            if req.top_logprobs_num > 0:
                meta["input_top_logprobs"] = [
                    None if top is None else [[lp, t, None] for lp, t in top] for top in req.input_top_logprobs or []
                ]
                meta["output_top_logprobs"] = [[[lp, t, None] for lp, t in top] for top in req.top_logprobs]
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens)
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}

    def _finish(self, req: Req, finish_reason: dict, echo: bool = False) -> None:
        """Send the request's last output; `echo`: the tokenizer manager's abort echo for a request
        off the running batch, whose incremental stream chunk repeats the last token."""
        out = self._output(req, finish_reason)
        if echo:
            out[ABORT_ECHO] = True
        req.emit(out)

    def new_request(
        self,
        input_ids: list[int],
        params: SamplingParams,
        emit: Callable[[dict], None],
        *,
        rid: str | None = None,
        stream: bool = False,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
    ) -> Req:
        """SGLang's request checks (ValueError: HTTP 400), then a request ready to submit."""
        if len(input_ids) >= self.context_len:
            raise ValueError(
                f"The input ({len(input_ids)} tokens) is longer than "
                f"the model's context length ({self.context_len} tokens)."
            )
        bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"fake SGLang server: token ids {bad[:5]} are outside the vocabulary of {self.vocab_size}")
        params.verify()
        if return_logprob and logprob_start_len >= len(input_ids):
            raise ValueError(
                f"logprob_start_len ({logprob_start_len}) is not smaller than the input ({len(input_ids)} tokens)"
            )
        generator = None
        if params.sampling_seed is not None:
            generator = torch.Generator().manual_seed(params.sampling_seed)
        return Req(
            rid or uuid.uuid4().hex,
            list(input_ids),
            params,
            emit,
            stream=stream,
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
            logprob_start_len=logprob_start_len,
            generator=generator,
        )


def _topk(logprobs: torch.Tensor, k: int) -> list[tuple[float, int]]:
    values, ids = torch.topk(logprobs, k)
    return [(float(v), int(i)) for v, i in zip(values, ids, strict=True)]


def _weight_version_spans(events: list[tuple[str, int]], current: str, num_output_tokens: int) -> list[dict]:
    """SGLang's `compute_weight_version_spans` (sglang/srt/utils/weight_versions.py), as the
    tokenizer manager puts them in `meta_info.weight_versions`."""
    spans: list[dict] = []
    for version, end in [*events, (current, num_output_tokens)]:
        end = min(end, num_output_tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans
