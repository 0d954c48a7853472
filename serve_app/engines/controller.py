"""The engine controller: one per replica, it owns the whole control policy and composes the
engine's adapter (serve_app/engines/adapter.py), which only fills the hooks of the capabilities
its options class declares.

The public methods own the state and its guards (docs/design.md#exact-attribution):

* every profiling-session call runs on the engine's one control thread (`ControlThread`);
  `stop(pause)`, `update_weights` and `start` are serialised by one lock, so an update never
  overlaps the finalize of the stop before it, and a start never overlaps either;
* the admission hold: a stop with `pause`, or an update with `resume: false`, admits no new
  engine step until the next start or resuming update, or until `hold_timeout_s` passes; the
  deadline does not run while weights are read, received or loaded, and restarts when that ends;
* a stop is acknowledged as soon as no further engine step can enter the window, then the
  profiler finalizes on the control thread and the export runs in the background;
* a weight update (serve_app/engines/weight_control.py) reads its file before taking the lock
  (overlapping a finalize), then loads it between engine steps, and serves the old version if the
  load fails;
* an abort (docs/design.md#client-pause): the sequences in flight are tracked here, each by the
  ids a client names it by; the ones an abort names are marked before the engine is asked (its
  adapter reads the mark: `abort_asked`), asked again while an engine that takes a request over
  awaits had not seen it yet, and counted; during a client's abort pause, a sequence that reaches
  the engine ends at once as the others did.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from profiling.backends.base import ProfilerBackend
from profiling.manifest import ManifestEntry
from profiling.session import BackendFactory, ProfileSession, SessionSpec, SessionState, StopOutcome
from serve_app.config import AppArgs
from serve_app.engines.adapter import Aborts, EngineAdapter, Pauses, Profiles, capability_gaps
from serve_app.engines.admission_hold import AdmissionHold
from serve_app.engines.control_thread import ControlThread
from serve_app.engines.generation import GenerateDelta, GenerateRequest
from serve_app.engines.options import Capability
from serve_app.engines.registry import ENGINE_OPTIONS
from serve_app.engines.request_stats import RequestAccounting
from serve_app.engines.tokenizer import HfTokenizer
from serve_app.engines.weight_control import WeightControl

T = TypeVar("T")
log = logging.getLogger(__name__)

SessionFactory = Callable[[BackendFactory], ProfileSession]
"""Makes the replica's profiling session around the engine's profiler."""

# After a stop is acknowledged, how long the control thread waits for the event loop to take the
# answer, and then for the answer to be sent, before the finalize runs: an in-process profiler's
# finalize holds the GIL for its whole duration.
_ACK_WAIT_S = 0.5
_ACK_GRACE_S = 0.02

ABORT_RETRY_S = 0.5
ABORT_RETRIES = 10
"""An engine that takes a request over awaits (vLLM's `add_request`) does not know it yet when an
abort comes in between, and ends nothing: every ABORT_RETRY_S the abort is asked again for the
sequences it named that still run, at most ABORT_RETRIES times."""


@dataclass(eq=False)
class _Flight:
    """One sequence in the engine, as an abort finds it."""

    request: GenerateRequest
    aborted: bool = False
    """An abort named it: the engine's abort of it was asked for."""
    ended: bool = False


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


class EngineController(WeightControl):
    """One engine inside one replica: the policy here, the engine behind `adapter`."""

    def __init__(
        self,
        adapter: type[EngineAdapter],
        *,
        args: AppArgs,
        model_dir: Path,
        session_factory: SessionFactory,
        trace_dir: Path,
    ):
        """`trace_dir`: this replica's directory for files an engine's own profiler writes."""
        self._options = ENGINE_OPTIONS[args.engine]
        if gaps := capability_gaps(adapter, self._options.capabilities):
            raise TypeError(f"engine {args.engine} ({adapter.__name__}): {'; '.join(gaps)}")
        self.model_name = args.model_name
        self.model_dir = model_dir
        self.trace_dir = trace_dir
        self.weight_version = 0
        self.context_length: int | None = _max_positions(model_dir)
        """Longest prompt + completion the engine takes, in tokens (None: unknown); the adapter's
        `open` may narrow it (vLLM's max_model_len)."""
        self.loop: asyncio.AbstractEventLoop | None = None
        self.tokenizer = HfTokenizer(model_dir)
        self._built_profiler = args.profiler
        self.adapter = adapter(self)
        self.adapter.open(args, model_dir)
        self._session = session_factory(self._profiler)
        steps = self.adapter.engine_step if self.adapter.steps_on_control_thread else None
        self._thread = ControlThread(steps, self._session.check_deadline)
        self._control = asyncio.Lock()
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
        self._flights: dict[str, _Flight] = {}
        """The sequences in the engine, by `GenerateRequest.request_id`."""
        self._aborting_all = 0
        """Aborts of every sequence under way: a sequence that arrives meanwhile ends at once (the
        engine's own abort of everything may reach it, unasked)."""
        self._end_arrivals_until: float | None = None
        """A client's abort pause (monotonic end): a sequence that reaches the engine until then
        ends at once; the replica's gate refuses new calls, so it was admitted before the pause."""
        self._chasers: set[asyncio.Task[None]] = set()

    # -- what the adapter is lent (EngineHost) --------------------------------------------------
    @property
    def session(self) -> ProfileSession:
        return self._session

    @property
    def thread(self) -> ControlThread:
        return self._thread

    async def on_thread(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the control thread."""
        self.loop = asyncio.get_running_loop()
        return await asyncio.wrap_future(self._thread.submit(fn))

    def abort_asked(self, request_id: str) -> bool:
        """Whether an abort named sequence `request_id` (an engine's abort of any other is its failure)."""
        flight = self._flights.get(request_id)
        return flight is not None and flight.aborted

    async def opened(self) -> None:
        """Await once after construction, on the replica's event loop, before serving."""
        self.loop = asyncio.get_running_loop()
        await self.adapter.opened()

    # -- generation --------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """The sequence's deltas (the adapter's `stream`), counted in the profiling window's
        request stats; one delta with finish_reason 'abort' when it arrives while every sequence
        is being aborted (`abort(None)`, a client's abort pause)."""
        self.tokenizer.check_prompt(request.prompt_token_ids)
        flight = self._flights[request.request_id] = _Flight(request)
        entered = self._requests.entered()
        tokens = 0
        versions: set[int] = set()
        finished = False
        try:
            if self._aborting_all or self.client_aborting:
                flight.aborted = finished = True
                yield GenerateDelta(finish_reason="abort")
                return
            # aclosing: a consumer that stops early closes the engine's stream now (an abort),
            # not whenever the generator is collected.
            async with contextlib.aclosing(self.adapter.stream(request)) as stream:
                async for delta in stream:
                    tokens += len(delta.token_ids)
                    if delta.weight_versions is not None:
                        versions = {s.version for s in delta.weight_versions}
                    elif delta.weight_version is not None and delta.token_ids:
                        versions.add(delta.weight_version)
                    finished = finished or delta.finish_reason is not None
                    yield delta
        finally:
            flight.ended = True
            if self._flights.get(request.request_id) is flight:
                del self._flights[request.request_id]
            self._requests.finished(entered, len(request.prompt_token_ids), tokens if finished else None, versions)

    async def abort(self, request_ids: list[str] | None) -> int:
        """End the sequences in flight that `request_ids` names (by any of their
        `GenerateRequest.names`; None: every one) between engine steps, paused or not: each
        answers finish_reason 'abort' with the tokens sampled so far. How many it ended (one per
        choice). CapabilityMissing: the engine cannot abort."""
        aborts = self._capability(Capability.ABORT, Aborts)
        wanted = None if request_ids is None else set(request_ids)
        flights = [
            f
            for f in self._flights.values()
            if not f.aborted and (wanted is None or not wanted.isdisjoint(f.request.names))
        ]
        for f in flights:
            f.aborted = True
        if wanted is None:
            # Everything the engine runs, in one call; what arrives meanwhile ends at `generate`.
            self._aborting_all += 1
            try:
                await aborts.abort(None)
            finally:
                self._aborting_all -= 1
        elif flights:
            await aborts.abort([f.request.request_id for f in flights])
        if flights:
            chaser = asyncio.ensure_future(self._chase(aborts, flights))
            self._chasers.add(chaser)
            chaser.add_done_callback(self._chasers.discard)
        return len(flights)

    async def _chase(self, aborts: Aborts, flights: list[_Flight]) -> None:
        """Ask the engine again to end `flights` while some still run (ABORT_RETRIES)."""
        for _ in range(ABORT_RETRIES):
            await asyncio.sleep(ABORT_RETRY_S)
            if not (running := [f.request.request_id for f in flights if not f.ended]):
                return
            try:
                await aborts.abort(running)
            except Exception:  # the first abort was answered; this one only helps
                log.exception("asking the engine again to abort %d sequences failed", len(running))

    # -- profiling -----------------------------------------------------------------------------
    async def start_profile(self, spec: SessionSpec) -> bool:
        """Start recording `spec`; always ends an admission hold. False: that step was already
        recording. ValueError: this engine cannot record with `spec.options`."""
        async with self._control:
            try:
                self._options.require(Capability.PROFILE)
                self._options.check_profiler(spec.options, self._built_profiler)
                started = await self.on_thread(lambda: self._session.start(spec, self.weight_version))
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

        closes_at_ack = pause or self.adapter.steps_on_control_thread
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

        done = asyncio.ensure_future(self.on_thread(stop))
        done.add_done_callback(lambda _: self._control.release())
        await asyncio.wait([acked, done], return_when=asyncio.FIRST_COMPLETED)
        return acked.result() if acked.done() else done.result()

    async def release_hold(self) -> None:
        """End the sync's admission hold without a start or an update (the app's own schedule
        held for an update that then failed); a client's pause stays."""
        async with self._control:
            await self._admission.release()

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
        """Whether admission of new engine steps is held (by the sync's hold)."""
        return self._admission.held

    @property
    def client_held(self) -> bool:
        """Whether a client's pause (mode keep) holds the engine."""
        return self._admission.client_held

    @property
    def client_aborting(self) -> bool:
        """Whether a client's abort pause ends every sequence that reaches the engine."""
        return self._end_arrivals_until is not None and time.monotonic() < self._end_arrivals_until

    async def client_hold(self, for_s: float) -> None:
        """A client's pause, mode keep: no engine step until `client_release`, or for `for_s`
        seconds at most; requests in flight and new ones wait (docs/design.md#client-pause)."""
        self._end_arrivals_until = None
        async with self._control:
            await self._admission.client_hold(for_s)

    async def client_abort(self, for_s: float) -> int:
        """A client's pause, mode abort: every sequence in flight ends now (`abort(None)`), and so
        does one that reaches the engine until `client_hold` or `client_release`, or for `for_s`
        seconds at most (the replica's gate refuses new calls meanwhile); a keep pause before it
        ends after its requests were aborted. How many sequences it ended."""
        self._options.require(Capability.ABORT)
        self._end_arrivals_until = time.monotonic() + max(0.0, for_s)
        ended = await self.abort(None)
        async with self._control:
            await self._admission.client_release()
        return ended

    async def client_release(self) -> None:
        """End a client's pause: the engine runs again unless the sync's hold holds it."""
        self._end_arrivals_until = None
        async with self._control:
            await self._admission.client_release()

    @property
    def transfer_ranks(self) -> int:
        """Members this engine puts in a collective weight transfer's group."""
        return self.adapter.transfer_ranks

    async def reset_prefix_cache(self, reset_running_requests: bool, reset_external: bool) -> bool:
        """Empty the engine's prefix cache on a client's request; False: the engine refused."""
        return await self.adapter.reset_prefix_cache(reset_running_requests, reset_external)

    def status(self) -> EngineStatus:
        return EngineStatus(
            state=self._session.state,
            active_step=self._session.active_step,
            weight_version=self.weight_version,
            paused=self.paused,
            forward_steps=self._session.forward_steps,
            forward_steps_by_version=counts.run if (counts := self.adapter.pass_counts()) else {},
            requests_in_flight=self._requests.in_flight,
        )

    def healthy(self) -> bool:
        return self._thread.alive() and self.adapter.healthy()

    async def shutdown(self) -> None:
        self._admission.cancel()
        for chaser in self._chasers:
            chaser.cancel()
        await asyncio.to_thread(self._thread.shutdown)
        await self.adapter.close()

    # -- internals -----------------------------------------------------------------------------
    def _profiler(self, spec: SessionSpec) -> ProfilerBackend:
        """The session's backend factory: the adapter's profiler (starts are refused before they
        reach the session when the engine cannot profile)."""
        return self._capability(Capability.PROFILE, Profiles).profiler(spec)

    async def _pause_counted(self) -> None:
        """The engine's pause, with the window's held time starting (the adapter is looked up at
        each call: a test may replace its methods after the build)."""
        await self._capability(Capability.PAUSE, Pauses).pause()
        self._requests.paused(True)

    async def _resume_counted(self) -> None:
        await self._capability(Capability.PAUSE, Pauses).resume()
        self._requests.paused(False)


def _max_positions(model_dir: Path) -> int | None:
    """The checkpoint's context length (`max_position_embeddings` of its config.json), if it says."""
    try:
        value = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) and value > 0 else None
