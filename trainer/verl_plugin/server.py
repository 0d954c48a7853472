"""The rollout server verl's agent loops call (docs/frameworks/verl.md#generation): a Ray actor
that answers verl's server calls from the app.

verl's load balancer hands `(server_id, handle)` to an agent loop, which awaits
`handle.generate.remote(...)`; verl's replica fans its calls (abort, resume, the KV-cache calls,
profiling) out to its servers by name. This actor takes each with verl's meaning:

* `generate`: the app's `/inference/v1/generate` (token_io.py maps the call and the answer);
* `abort_all_requests` closes the gate (new requests are parked, or refused with `reject_request`,
  as verl's vLLM server does) and ends this server's requests in flight at the app, each answering
  `aborted` with the tokens so far; `resume_generation` opens the gate;
* the KV-cache and sleep calls free nothing: the app's engines keep their memory, and every
  weight switch empties their prefix caches on its own (`clear_kv_cache` empties them at once);
* `start_profile` / `stop_profile` do nothing: the app's own schedule, given verl's
  `global_profiler` (replica.py), stops and starts each step inside the weight update, before
  generation resumes (docs/design.md#who-drives).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from verl.workers.rollout.replica import TokenOutput

from profiling.verl_traces.clocks import TrainerClock, append_trainer_clock
from trainer.client import RolloutError
from trainer.verl_plugin.settings import PluginSettings
from trainer.verl_plugin.token_io import RolloutLimits, aborted_fields, generate_request, token_output_fields

log = logging.getLogger(__name__)

SERVER_NAME = "rollout_profiler_server_{replica_rank}"
"""The Ray actor name of replica `replica_rank`'s server (verl names its own `vllm_server_<rank>_<node>`)."""
ABORT_ROUNDS_S = 0.05
"""Between two aborts of what is still in flight: a request sent just before the gate closed may
reach the app after the first abort."""


class AppRolloutServer:
    """One verl rollout server backed by the app (a Ray actor, created by replica.py)."""

    def __init__(
        self,
        settings: PluginSettings,
        limits: RolloutLimits,
        *,
        max_in_flight: int,
        trace_dir: str | None,
    ):
        """`limits`: verl's rollout lengths and sampling defaults. `max_in_flight`: requests sent
        to the app at once (verl's `max_num_seqs`). `trace_dir`: verl's `global_profiler.save_path`,
        where the trainer ranks' clock records go (None: not recorded)."""
        self._settings = settings
        self._limits = limits
        self._generation = settings.client(generation=True, max_connections=max_in_flight)
        self._control = settings.client()
        self._open = asyncio.Event()
        self._open.set()
        self._rejecting = False
        self._in_flight: set[str] = set()
        self._drained = asyncio.Event()
        self._drained.set()
        self._version = 0
        """The newest weight version an answer carried: reported for an answer without tokens."""
        self._clocks = Path(trace_dir) if trace_dir is not None else None

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        priority: int = 0,
        **unsupported: Any,
    ) -> TokenOutput:
        """Generate for one prompt with verl's sampling parameters; verl's `TokenOutput`."""
        _refuse_inputs(image_data, video_data, audio_data, mm_processor_kwargs, priority, unsupported)
        request = generate_request(request_id, prompt_ids, sampling_params, self._limits)
        while not self._open.is_set():
            if self._rejecting:
                return TokenOutput(**aborted_fields(self._version))
            await self._open.wait()
        self._in_flight.add(request_id)
        self._drained.clear()
        try:
            answer = await self._generation.generate_tokens(request)
        except RolloutError as e:
            raise RuntimeError(f"the app refused verl's generate call: {e}") from None
        finally:
            self._in_flight.discard(request_id)
            if not self._in_flight:
                self._drained.set()
        fields = token_output_fields(
            answer, logprobs=request.sampling_params.logprobs is not None, served_version=self._version
        )
        self._version = max(self._version, fields["extra_fields"]["global_steps"])
        return TokenOutput(**fields)

    async def abort_all_requests(self, reject_request: bool = False, reset_prefix_cache: bool = True) -> dict[str, Any]:
        """Close the gate (requests that arrive are parked until `resume_generation`, or answered
        `aborted` with `reject_request`) and end this server's requests in flight at the app; answers
        once none is in flight (or after the settings' timeout_s, saying how many are left)."""
        self._rejecting = reject_request
        self._open.clear()
        aborted: set[str] = set()
        deadline = time.monotonic() + self._settings.timeout_s
        while self._in_flight and time.monotonic() < deadline:
            ids = sorted(self._in_flight)
            aborted.update(ids)
            await self._control.abort_requests(ids)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), ABORT_ROUNDS_S)
        if self._in_flight:
            log.warning(
                "%d request(s) still in flight %.0f s after the abort: %s",
                len(self._in_flight),
                self._settings.timeout_s,
                sorted(self._in_flight)[:5],
            )
        return {"aborted_count": len(aborted), "request_ids": sorted(aborted)}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        """End one request in flight at the app (it answers `aborted` with its tokens so far)."""
        if request_id not in self._in_flight:
            return {"aborted": False, "request_id": request_id, "error": f"Request {request_id} not found"}
        answer = await self._control.abort_requests([request_id])
        return {"aborted": answer.aborted > 0, "request_id": request_id}

    async def resume_generation(self) -> None:
        """Open the gate: parked requests go on to the app."""
        self._rejecting = False
        self._open.set()

    async def wait_for_requests_to_drain(self) -> None:
        await self._drained.wait()

    async def clear_kv_cache(self) -> None:
        """Empty the app's prefix caches (verl's meaning: no cached prefix survives)."""
        await self._control.reset_prefix_cache()

    async def release_kv_cache(self) -> None:
        """Nothing to free: the app's engines keep their memory across a weight update."""

    async def resume_kv_cache(self) -> None:
        """Nothing to restore (release_kv_cache freed nothing); the update emptied the prefix caches."""

    async def sleep(self) -> None:
        """Nothing to free: the app runs on resources of its own, not on the trainer's."""

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Nothing to restore (sleep freed nothing)."""

    async def start_profile(self, **kwargs: Any) -> None:
        """Nothing: the app's schedule started the step inside the weight update (module docstring)."""

    async def stop_profile(self) -> None:
        """Nothing: the app's schedule stops the step inside the next weight update."""

    async def record_trainer_clock(self, clock: TrainerClock) -> None:
        """Keep a trainer rank's clock against the app's, measured at a publish (checkpoint_engine.py),
        beside verl's trainer traces, where `python -m profiling verl` finds it."""
        if self._clocks is not None:
            await asyncio.to_thread(append_trainer_clock, self._clocks, clock)


def _refuse_inputs(
    image_data: Any,
    video_data: Any,
    audio_data: Any,
    mm_processor_kwargs: dict[str, Any] | None,
    priority: int,
    unsupported: dict[str, Any],
) -> None:
    given = {
        "image_data": image_data,
        "video_data": video_data,
        "audio_data": audio_data,
        "mm_processor_kwargs": mm_processor_kwargs,
    }
    if named := [k for k, v in given.items() if v] + [k for k, v in unsupported.items() if v is not None]:
        raise ValueError(
            f"the app serves text models token in, token out; verl's generate call gave {', '.join(named)}, "
            "which it cannot take (docs/frameworks/verl.md#generation)"
        )
    if priority:
        raise ValueError(
            f"verl's generate call asked for priority {priority}: the app's engines schedule first come, first "
            "served; leave priority at 0"
        )
