"""The engine contract: `RolloutEngine` owns the whole control policy; each engine fills hooks.

The public methods own the state and its guards (docs/design.md#exact-attribution):

* every profiling-session call runs on the engine's one control thread (`ControlThread`);
  `stop(pause)`, `update_weights` and `start` are serialised by one lock, so an update never
  overlaps the finalize of the stop before it, and a start never overlaps either;
* the admission hold: a stop with `pause`, or an update with `resume: false`, admits no new
  engine step until the next start or resuming update, or until `hold_timeout_s` passes; the
  deadline does not run while weights are read, received or loaded, and restarts when that ends;
* a stop is acknowledged as soon as no further engine step can enter the window, then the
  profiler finalizes on the control thread and the export runs in the background;
* a weight update reads its file before taking the lock (overlapping a finalize), then loads
  it between engine steps, and serves the old version if the load fails.

Engines (`transformers/`, `vllm/`, `sglang/`: one package each) supply only the hooks:
`_open`, `_stream`, `_profiler`, `_pause`, `_resume`, `_read_weights`, `_load_weights`,
`_healthy`, `_close`, and optionally `_opened`, `_pass_counts`, where forward passes run in
this process `_engine_step`, and for the other weight sources (docs/design.md#weight-transfer)
`transfer_ranks`, `_receive_weights`, `_staged_weights`, `_drop_staged`, `_weights_snapshot`,
`_reported_version`, `_adopted` and `_engine_rpc`. Every source's load shares one policy (`_switch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel

from profiling.backends.base import ProfilerBackend
from profiling.manifest import ManifestEntry
from profiling.session import BackendFactory, ProfileSession, SessionSpec, SessionState, StopOutcome
from serve_app.config import AppArgs
from serve_app.engines.admission_hold import AdmissionHold
from serve_app.engines.control_thread import ControlThread
from serve_app.engines.generation import GenerateDelta, GenerateRequest
from serve_app.engines.options import Capability
from serve_app.engines.registry import ENGINE_OPTIONS
from serve_app.engines.request_stats import RequestAccounting
from serve_app.engines.tokenizer import HfTokenizerMixin
from serve_app.weights.checkpoint import StateDict, check_checkpoint
from serve_app.weights.collective_schema import CollectiveTransfer

log = logging.getLogger(__name__)
T = TypeVar("T")
W = TypeVar("W")

SessionFactory = Callable[[BackendFactory], ProfileSession]
"""Makes the replica's profiling session around the engine's profiler hook."""


class AdoptRefused(ValueError):
    """Source external on an engine that keeps no weight version of its own (nothing to compare)."""


class AdoptConflict(ValueError):
    """Source external naming a version other than the one the engine reports."""


class _Adopted:
    """What `_switch` gets for a source-external update: the weights are in the engine already."""


_ADOPTED = _Adopted()

# After a stop is acknowledged, how long the control thread waits for the event loop to take the
# answer, and then for the answer to be sent, before the finalize runs: an in-process profiler's
# finalize holds the GIL for its whole duration.
_ACK_WAIT_S = 0.5
_ACK_GRACE_S = 0.02


class PassCounts(BaseModel):
    """An engine's forward passes by weight version: all it ran, and those recorded in a window."""

    run: dict[int, int] = {}
    recorded: dict[int, int] = {}


class EngineStatus(BaseModel):
    state: SessionState
    active_step: int | None
    weight_version: int
    paused: bool
    forward_steps: int
    """Forward passes recorded in the active window."""
    forward_steps_by_version: dict[int, int]
    """All forward passes this engine ran, by weight version (recorded or not); vLLM's as of
    its last weight load."""
    requests_in_flight: int
    """Generation requests (one per choice) in the engine now."""


def check_fits(context_length: int | None, prompt_tokens: int, max_tokens: int) -> None:
    """ValueError (a 422 for the caller) when a prompt leaves no room for max_tokens in the
    engine's context (`context_length` None: unknown, not checked)."""
    if context_length is not None and prompt_tokens + max_tokens > context_length:
        raise ValueError(
            f"the prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}: together over the "
            f"model's context of {context_length} tokens; shorten the prompt or lower max_tokens"
        )


def room_left(context_length: int | None, prompt_tokens: int) -> int:
    """max_tokens for a request that gives none: the rest of the engine's context."""
    if context_length is None:
        raise ValueError("the model's context length is unknown: give max_tokens")
    if prompt_tokens >= context_length:
        raise ValueError(
            f"the prompt has {prompt_tokens} tokens: no room left in the model's context of "
            f"{context_length} tokens; shorten the prompt"
        )
    return context_length - prompt_tokens


CAPABILITY_HOOKS: dict[Capability, tuple[str, ...]] = {
    Capability.GENERATE: ("_open", "_stream", "_healthy", "_close"),
    Capability.PROFILE: ("_profiler",),
    Capability.PAUSE: ("_pause", "_resume"),
    Capability.LOAD_PATH: ("_read_weights", "_load_weights"),
    Capability.RECEIVE_COLLECTIVE: ("_receive_weights", "_staged_weights", "_load_weights", "_weights_snapshot"),
    # Optional, with a do-nothing default: _drop_staged, _adopted, _opened, _pass_counts, _engine_step.
    Capability.ADOPT_EXTERNAL: ("_reported_version",),
    Capability.ENGINE_RPC: ("_engine_rpc",),
}
"""The hooks each capability needs an engine to fill (docs/engines.md#one-engine-contract)."""


def capability_gaps(engine: type[RolloutEngine[Any]], declared: frozenset[Capability]) -> list[str]:
    """Where `engine`'s hooks and its `declared` capabilities disagree: a declared capability
    with a hook left to the base, or a hook filled for a capability not declared (it would
    never be called). Empty: they agree."""
    own = {
        hook
        for hook in set().union(*CAPABILITY_HOOKS.values())
        if getattr(engine, hook) is not getattr(RolloutEngine, hook)
    }
    needed = set().union(*(CAPABILITY_HOOKS[c] for c in declared))
    gaps = [
        f"declares {c.value!r} but does not fill {h}" for c in declared for h in CAPABILITY_HOOKS[c] if h not in own
    ]
    gaps += [f"fills {h} but declares no capability that uses it" for h in sorted(own - needed)]
    return gaps


class RolloutEngine(HfTokenizerMixin, ABC, Generic[W]):
    """One engine inside one replica. `W` is what `_read_weights` hands to `_load_weights`."""

    steps_on_control_thread: ClassVar[bool] = False
    """Whether this engine's forward passes run on the control thread (`_engine_step`). Then a
    stop closes the window between two of them even without `pause`; otherwise only a paused
    engine has closed the window when the session acknowledges the stop."""

    def __init__(self, *, args: AppArgs, model_dir: Path, session_factory: SessionFactory, trace_dir: Path):
        """`trace_dir`: this replica's directory for files an engine's own profiler writes."""
        self.model_name = args.model_name
        self.model_dir = model_dir
        self.trace_dir = trace_dir
        self.weight_version = 0
        self.context_length: int | None = _max_positions(model_dir)
        """Longest prompt + completion the engine takes, in tokens (None: unknown); `_open` may
        narrow it (vLLM's max_model_len)."""
        self._options = ENGINE_OPTIONS[args.engine]
        if gaps := capability_gaps(type(self), self._options.capabilities):
            raise TypeError(f"engine {args.engine} ({type(self).__name__}): {'; '.join(gaps)}")
        self._engine_name = args.engine
        self._built_profiler = args.profiler
        self._load_tokenizer(model_dir)
        self._open(args, model_dir)
        self._session = session_factory(self._profiler)
        self._thread = ControlThread(
            self._engine_step if self.steps_on_control_thread else None, self._session.check_deadline
        )
        self._control = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._admission = AdmissionHold(
            timeout_s=args.hold_timeout_s,
            control=self._control,
            pause=self._pause_counted,
            resume=self._resume_counted,
            require_pause=lambda: self._options.require(Capability.PAUSE),
            annotate=self._session.annotate,
        )
        # Requests and generating/held/idle time per profiling window, for the step's entry.
        self._requests = RequestAccounting()

    # -- hooks ---------------------------------------------------------------------------------
    @abstractmethod
    def _open(self, args: AppArgs, model_dir: Path) -> None:
        """Build or reach the engine serving `model_dir` (in the replica's constructor)."""

    @abstractmethod
    def _stream(self, request: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        """Generate one sequence for a prompt whose token ids are in the model's vocabulary
        (serve_app/engines/generation.py): deltas until one with `finish_reason`. Honour every
        field of `request.sampling` (a field the engine cannot honour is refused before the
        request reaches it: `EngineOptions.unsupported_sampling`). Closing the iterator early
        (the caller went away) aborts the sequence and frees its slot. ValueError: the request
        itself is unusable (a 422 for the caller)."""

    def _profiler(self, spec: SessionSpec) -> ProfilerBackend:
        """The profiler that records this engine for `spec` (started and stopped by the session
        on the control thread; the loop of `_loop` is the replica's event loop).
        `Capability.PROFILE`."""
        raise self._options.missing(Capability.PROFILE)

    async def _pause(self) -> None:
        """Admit no new engine step; requests in flight wait (they are not aborted).
        `Capability.PAUSE`."""
        raise self._options.missing(Capability.PAUSE)

    async def _resume(self) -> None:
        """Admit engine steps again. `Capability.PAUSE`."""
        raise self._options.missing(Capability.PAUSE)

    async def _read_weights(self, path: Path) -> W:
        """Prepare `path` (a safetensors file or directory) for loading; runs before the control
        lock is taken, so it may overlap the finalize of the stop before it. `Capability.LOAD_PATH`."""
        raise self._options.missing(Capability.LOAD_PATH)

    async def _load_weights(self, weights: W, version: int) -> None:
        """Load `weights` as `version` while no engine step runs (an engine without
        `Capability.PAUSE` is not paused first: its load must fall between its own steps); reset
        prefix caches. `Capability.LOAD_PATH` or `Capability.RECEIVE_COLLECTIVE`."""
        raise self._options.missing(Capability.LOAD_PATH)

    @abstractmethod
    def _healthy(self) -> bool: ...

    @abstractmethod
    async def _close(self) -> None:
        """Release the engine (the control thread is already stopped)."""

    def _engine_step(self) -> bool:
        """One engine step on the control thread (with `steps_on_control_thread`); False when
        there was nothing to do."""
        return False

    def _pass_counts(self) -> PassCounts | None:
        """The forward passes run and recorded, by weight version (None: the engine does not
        count them). Read right after a weight load, for the version it replaced."""
        return None

    @property
    def transfer_ranks(self) -> int:
        """Members this engine puts in a collective weight transfer's group: one per process that
        holds a copy of the weights (vLLM: each worker)."""
        return 1

    async def _receive_weights(
        self, transfer: CollectiveTransfer, first_rank: int, world_size: int, timeout_s: float
    ) -> None:
        """Join the sync's group (serve_app/weights/collective.py) as ranks `first_rank` ..
        `first_rank + transfer_ranks - 1` of `world_size` and stage every tensor it delivers,
        without touching the served weights (each group operation fails after `timeout_s`)."""
        raise self._options.missing(Capability.RECEIVE_COLLECTIVE)

    async def _staged_weights(self) -> W:
        """The weights `_receive_weights` staged, as `_load_weights` takes them."""
        raise self._options.missing(Capability.RECEIVE_COLLECTIVE)

    async def _drop_staged(self) -> None:
        """Forget staged weights (a transfer that failed somewhere, or after they loaded)."""

    async def _weights_snapshot(self) -> StateDict:
        """The served weights as a CPU state dict: what a replica that starts after a collective
        transfer loads from a peer (no file holds them)."""
        raise self._options.missing(Capability.RECEIVE_COLLECTIVE)

    async def _reported_version(self) -> int | None:
        """The weight version the engine itself reports (vLLM: its weight version), for a transfer
        the trainer made on its own (source external); None: the engine keeps none of its own."""
        return None

    async def _adopted(self, version: int) -> None:
        """The engine holds `version` already (source external): let it take the version on (its
        forward-step labels, pass counts, prefix cache), while no engine step runs."""

    async def _engine_rpc(self, method: str, *args: object, **kwargs: object) -> object:
        """Call the engine's own API (vLLM: a method of its AsyncLLM, such as collective_rpc), for a
        trainer that moves weights itself through the app's handle."""
        raise self._options.missing(Capability.ENGINE_RPC)

    async def _opened(self) -> None:
        """Finish opening on the replica's event loop (after `_open`, before any request)."""

    async def opened(self) -> None:
        """Await once after construction, on the replica's event loop, before serving."""
        await self._opened()

    # -- generation --------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """The sequence's deltas (`_stream`), counted in the profiling window's request stats."""
        self.check_prompt(request.prompt_token_ids)
        entered = self._requests.entered()
        tokens = 0
        versions: set[int] = set()
        finished = False
        try:
            # aclosing: a consumer that stops early closes the engine's stream now (an abort),
            # not whenever the generator is collected.
            async with contextlib.aclosing(self._stream(request)) as stream:
                async for delta in stream:
                    tokens += len(delta.token_ids)
                    if delta.weight_versions is not None:
                        versions = {s.version for s in delta.weight_versions}
                    elif delta.weight_version is not None and delta.token_ids:
                        versions.add(delta.weight_version)
                    finished = finished or delta.finish_reason is not None
                    yield delta
        finally:
            self._requests.finished(entered, len(request.prompt_token_ids), tokens if finished else None, versions)

    # -- profiling and weights ------------------------------------------------------------------
    async def start_profile(self, spec: SessionSpec) -> bool:
        """Start recording `spec`; always ends an admission hold. False: that step was already
        recording. ValueError: this engine cannot record with `spec.options`."""
        async with self._control:
            try:
                self._options.check_profiler(spec.options, self._built_profiler)
                started = await self._on_thread(lambda: self._session.start(spec, self.weight_version))
                if started:
                    self._requests.open()
                return started
            finally:
                await self._admission.release()

    async def stop_profile(self, step: int | None, pause: bool) -> StopOutcome:
        """Stop recording `step` (None: only apply `pause`); answers once no further engine step
        can enter the window, before the profiler's finalize."""
        loop = asyncio.get_running_loop()
        await self._control.acquire()
        try:
            if pause:
                if step is not None and step == self.active_step:
                    self._admission.begun_by_stop(step)
                await self._admission.hold()
        except BaseException:
            self._control.release()
            raise
        acked: asyncio.Future[StopOutcome] = loop.create_future()
        delivered = threading.Event()

        def resolve(outcome: StopOutcome) -> None:
            if not acked.done():
                acked.set_result(outcome)
            delivered.set()

        def ack(outcome: StopOutcome) -> None:  # on the control thread, before the finalize
            loop.call_soon_threadsafe(resolve, outcome)
            delivered.wait(_ACK_WAIT_S)
            time.sleep(_ACK_GRACE_S)

        closes_at_ack = pause or self.steps_on_control_thread
        # The control lock is held, so no start or stop changes the active step meanwhile.
        requests = self._requests.close() if step is not None and step == self.active_step else None

        def closed(outcome: StopOutcome) -> None:  # before the export is handed off: it applies this
            if outcome.stopped and requests is not None and step is not None:
                self._session.annotate(step, requests=requests)
            if closes_at_ack:
                ack(outcome)

        def stop() -> StopOutcome:
            if step is None:
                return StopOutcome(step=None, stopped=False)
            return self._session.stop(step, closed)

        done = asyncio.ensure_future(self._on_thread(stop))
        done.add_done_callback(lambda _: self._control.release())
        await asyncio.wait([acked, done], return_when=asyncio.FIRST_COMPLETED)
        return acked.result() if acked.done() else done.result()

    async def update_weights(self, version: int, path: str | None, resume: bool) -> float:
        """Load `path` as `version` between engine steps; returns seconds spent. Afterwards
        admission is open if `resume`, else held until the next start (or the hold timeout)."""
        t0 = time.perf_counter()
        if path is None or version == self.weight_version:
            await self._switch(version, None, resume)
            return time.perf_counter() - t0
        async with self._admission.covering_load():
            # Names, dtypes and shapes from the headers, before any tensor is read or the engine paused.
            await asyncio.to_thread(check_checkpoint, Path(path), self.model_dir)
            weights = await self._read_weights(Path(path))
            await self._switch(version, weights, resume)
        return time.perf_counter() - t0

    async def receive_weights(
        self, transfer: CollectiveTransfer, first_rank: int, world_size: int, timeout_s: float
    ) -> float:
        """Receive a collective transfer (serve_app/weights/collective.py) and stage it, without touching
        the served weights; returns seconds spent. Runs outside the control lock, like reading a
        path, so generation goes on meanwhile. A failure leaves nothing staged."""
        t0 = time.perf_counter()
        try:
            async with self._admission.covering_load():
                await self._receive_weights(transfer, first_rank, world_size, timeout_s)
        except BaseException:
            await self._drop_staged()
            raise
        return time.perf_counter() - t0

    async def load_staged(self, version: int, resume: bool) -> float:
        """Load what `receive_weights` staged as `version`, as `update_weights` loads a path (the
        same pause, hold and resume), then forget it; returns seconds spent."""
        t0 = time.perf_counter()
        try:
            async with self._admission.covering_load():
                weights = await self._staged_weights() if version != self.weight_version else None
                await self._switch(version, weights, resume)
        finally:
            await self._drop_staged()
        return time.perf_counter() - t0

    async def drop_staged(self) -> None:
        """Forget staged weights (the transfer failed on another member): the old version serves on."""
        await self._drop_staged()

    async def adopt_weights(self, version: int, resume: bool) -> None:
        """Record `version` as served without loading anything: the trainer moved the weights
        itself (source external). Only when the engine itself reports `version`; the admission
        hold is applied as by `update_weights`. ValueError naming the reported version and the fix."""
        reported = await self._reported_version()
        if reported is None:
            raise AdoptRefused(
                f"engine {self._engine_name} keeps no weight version of its own, so it cannot confirm that the "
                f"trainer moved version {version} into it: publish through source path or collective"
            )
        if reported != version:
            raise AdoptConflict(
                f"the engine reports weight version {reported}, not {version}: finish the transfer of version "
                f"{version} into the engine (and set its weight version) before publishing it"
            )
        async with self._admission.covering_load():  # the trainer's own load just ended: a hold counts from here
            await self._switch(version, _ADOPTED, resume)

    async def weights_snapshot(self) -> StateDict:
        """The served weights as CPU tensors (for a replica that joins after a collective transfer)."""
        return await self._weights_snapshot()

    async def engine_rpc(self, method: str, *args: object, **kwargs: object) -> object:
        """Call a method of the engine's own API (vLLM: its AsyncLLM's, e.g. collective_rpc)."""
        return await self._engine_rpc(method, *args, **kwargs)

    async def _switch(self, version: int, weights: W | _Adopted | None, resume: bool) -> None:
        """Make `version` the served one between engine steps, then apply `resume`: the policy
        every weight source shares. `weights` None: nothing to load (the same version again);
        `_ADOPTED`: the engine holds `version` already, only the bookkeeping of a load is done."""
        async with self._control:
            paused_here = False
            if weights is not None and version != self.weight_version:
                replaced = self.weight_version
                self._session.note_weight_load()
                # No engine step between the old version's and the new one's (an engine that
                # cannot pause loads between its own steps).
                if not self._admission.held and self._options.has(Capability.PAUSE):
                    await self._admission.pause_engine()
                    paused_here = True
                try:
                    if isinstance(weights, _Adopted):
                        await self._adopted(version)
                    else:
                        await self._load_weights(weights, version)
                except BaseException:
                    if paused_here:  # keep serving the old weights; the load error is the answer
                        try:
                            await self._admission.resume_engine()
                        except Exception:
                            log.exception("resuming the engine after a failed weight load failed")
                    raise
                self.weight_version = version
                await self._count_outside(replaced)
            if not resume:
                # Hold for the /profile/start that follows, straight from the load's pause: not
                # one engine step may run unprofiled on `version` in between.
                await self._admission.hold()
            elif paused_here:
                await self._admission.resume_engine()
            else:
                await self._admission.release()

    async def _count_outside(self, replaced: int) -> None:
        """Record, in the entry of the window that recorded weights `replaced` alone, how many
        forward passes on them ran outside it (docs/design.md#exact-attribution)."""
        counts = self._pass_counts()
        step = self._session.step_started_on(replaced)
        if counts is not None and step is not None:
            outside = counts.run.get(replaced, 0) - counts.recorded.get(replaced, 0)
            # The entry is rewritten on disk: off the event loop.
            await asyncio.to_thread(self._session.annotate, step, forward_steps_outside=outside)

    async def wait_exported(self, step: int, timeout_s: float) -> ManifestEntry | None:
        """This replica's final entry for `step` once its export is done (None: none)."""
        return await asyncio.to_thread(self._session.wait_exported, step, timeout_s)

    # -- state ---------------------------------------------------------------------------------
    @property
    def active_step(self) -> int | None:
        """The step being recorded (or capped, awaiting its stop)."""
        return self._session.active_step

    @property
    def paused(self) -> bool:
        """Whether admission of new engine steps is held."""
        return self._admission.held

    def status(self) -> EngineStatus:
        return EngineStatus(
            state=self._session.state,
            active_step=self._session.active_step,
            weight_version=self.weight_version,
            paused=self.paused,
            forward_steps=self._session.forward_steps,
            forward_steps_by_version=counts.run if (counts := self._pass_counts()) else {},
            requests_in_flight=self._requests.in_flight,
        )

    def healthy(self) -> bool:
        return self._thread.alive() and self._healthy()

    async def shutdown(self) -> None:
        self._admission.cancel()
        await asyncio.to_thread(self._thread.shutdown)
        await self._close()

    # -- internals -----------------------------------------------------------------------------
    async def _on_thread(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the control thread; the engine's profiler hooks reach the event loop
        through `_loop`."""
        self._loop = asyncio.get_running_loop()
        return await asyncio.wrap_future(self._thread.submit(fn))

    async def _pause_counted(self) -> None:
        """The engine's pause, with the window's held time starting (the hooks are looked up at
        each call: a test or an engine may replace them after the build)."""
        await self._pause()
        self._requests.paused(True)

    async def _resume_counted(self) -> None:
        await self._resume()
        self._requests.paused(False)


def _max_positions(model_dir: Path) -> int | None:
    """The checkpoint's context length (`max_position_embeddings` of its config.json), if it says."""
    try:
        value = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) and value > 0 else None
