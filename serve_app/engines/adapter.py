"""The adapter contract: what one engine (`transformers/`, `vllm/`, `sglang/`) supplies to the
`EngineController` (serve_app/engines/controller.py), which owns the control policy.

An adapter subclasses `EngineAdapter` (generation, which every engine has) and implements the
protocol of each other capability its options class declares (`EngineOptions.capabilities`,
docs/engines.md#capabilities): `Profiles`, `Pauses`, `LoadsPath`, `ReceivesCollective`,
`AdoptsExternal`, `CallsEngine`, `Aborts`, `TransfersThroughEngine`. The controller checks at
construction that the two agree (`capability_gaps`), and refuses a call that needs a capability
the engine lacks before any adapter method runs. The adapter reaches the controller only through `EngineHost`.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel

from profiling.backends.base import ProfilerBackend
from profiling.session import ProfileSession, SessionSpec
from serve_app.config import AppArgs
from serve_app.engines.control_thread import ControlThread
from serve_app.engines.generation import GenerateDelta, GenerateRequest
from serve_app.engines.options import Capability
from serve_app.engines.tokenizer import HfTokenizer
from serve_app.weights.checkpoint import StateDict
from serve_app.weights.collective_schema import CollectiveTransfer

T = TypeVar("T")


class PassCounts(BaseModel):
    """An engine's forward passes by weight version: all it ran, and those recorded in a window."""

    run: dict[int, int] = {}
    recorded: dict[int, int] = {}


class EngineHost(Protocol):
    """What the controller lends its adapter."""

    model_dir: Path
    trace_dir: Path
    """This replica's directory for files an engine's own profiler writes."""
    tokenizer: HfTokenizer
    context_length: int | None
    """Longest prompt + completion the engine takes, in tokens (None: unknown); `open` may narrow
    it (vLLM's max_model_len)."""
    loop: asyncio.AbstractEventLoop | None
    """The replica's event loop, once a control call or `opened` ran on it."""

    @property
    def weight_version(self) -> int:
        """The version served now."""

    @property
    def session(self) -> ProfileSession:
        """The replica's profiling session (its `forward_step` range, `mark_weight_update`)."""

    @property
    def thread(self) -> ControlThread:
        """The engine's control thread (`wake`, `admit`)."""

    async def on_thread(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the control thread."""

    def abort_asked(self, request_id: str) -> bool:
        """Whether the app asked to end sequence `request_id` early (`Aborts.abort`): an engine
        that ends a sequence it was not asked to end failed it."""


class EngineAdapter(ABC):
    """One engine inside one replica: generation (`Capability.GENERATE`), and the optional hooks
    every engine may fill. Built by the controller, which passes itself as `host`."""

    steps_on_control_thread: ClassVar[bool] = False
    """Whether this engine's forward passes run on the control thread (`engine_step`). Then a
    stop closes the window between two of them even without `pause`; otherwise only a paused
    engine has closed the window when the session acknowledges the stop."""

    def __init__(self, host: EngineHost):
        self.host = host

    @abstractmethod
    def open(self, args: AppArgs, model_dir: Path) -> None:
        """Build or reach the engine serving `model_dir` (in the replica's constructor)."""

    async def opened(self) -> None:  # noqa: B027 - optional: nothing to finish by default
        """Finish opening on the replica's event loop (after `open`, before any request)."""

    @abstractmethod
    def stream(self, request: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        """Generate one sequence for a prompt whose token ids are in the model's vocabulary
        (serve_app/engines/generation.py): deltas until one with `finish_reason`. Honour every
        field of `request.sampling` (a field the engine cannot honour is refused before the
        request reaches it: `EngineOptions.unsupported_sampling`). Closing the iterator early
        (the caller went away) aborts the sequence and frees its slot. ValueError: the request
        itself is unusable (a 422 for the caller)."""

    @abstractmethod
    def healthy(self) -> bool: ...

    @abstractmethod
    async def close(self) -> None:
        """Release the engine (the control thread is already stopped)."""

    def engine_step(self) -> bool:
        """One engine step on the control thread (with `steps_on_control_thread`); False when
        there was nothing to do."""
        return False

    async def reset_prefix_cache(self, reset_running_requests: bool, reset_external: bool) -> bool:
        """Empty the engine's prefix cache on a client's request (vLLM's `/reset_prefix_cache`;
        the controller empties it at every weight switch on its own): False when the engine
        refuses, as while requests in flight hold cached blocks and `reset_running_requests`
        (preempt them) is off; `reset_external`: a KV connector's cache too. True by default: an
        engine that shares no KV between requests holds nothing to empty."""
        return True

    def pass_counts(self) -> PassCounts | None:
        """The forward passes run and recorded, by weight version (None: the engine does not
        count them). Read right after a weight load, for the version it replaced."""
        return None

    @property
    def transfer_ranks(self) -> int:
        """Members this engine puts in a collective weight transfer's group: one per process that
        holds a copy of the weights (vLLM: each worker)."""
        return 1


@runtime_checkable
class Profiles(Protocol):
    """`Capability.PROFILE`."""

    def profiler(self, spec: SessionSpec) -> ProfilerBackend:
        """The profiler that records this engine for `spec` (started and stopped by the session
        on the control thread; `host.loop` is the replica's event loop)."""


@runtime_checkable
class Pauses(Protocol):
    """`Capability.PAUSE`."""

    async def pause(self) -> None:
        """Admit no new engine step; requests in flight wait (they are not aborted)."""

    async def resume(self) -> None:
        """Admit engine steps again."""


@runtime_checkable
class LoadsWeights(Protocol):
    """The load shared by `LoadsPath` and `ReceivesCollective`."""

    async def load_weights(self, weights: Any, version: int) -> None:
        """Load `weights` as `version` while no engine step runs (an engine without
        `Capability.PAUSE` is not paused first: its load must fall between its own steps); reset
        prefix caches."""


@runtime_checkable
class LoadsPath(LoadsWeights, Protocol):
    """`Capability.LOAD_PATH`."""

    async def read_weights(self, path: Path) -> Any:
        """Prepare `path` (a safetensors file or directory) for loading, as `load_weights` takes
        it; runs before the control lock is taken, so it may overlap the finalize of the stop
        before it."""


@runtime_checkable
class ReceivesCollective(LoadsWeights, Protocol):
    """`Capability.RECEIVE_COLLECTIVE` (docs/design.md#weight-transfer)."""

    async def receive_weights(
        self, transfer: CollectiveTransfer, first_rank: int, world_size: int, timeout_s: float
    ) -> None:
        """Join the sync's group (serve_app/weights/collective.py) as ranks `first_rank` ..
        `first_rank + transfer_ranks - 1` of `world_size` and stage every tensor it delivers,
        without touching the served weights (each group operation fails after `timeout_s`)."""

    async def staged_weights(self) -> Any:
        """The weights `receive_weights` staged, as `load_weights` takes them."""

    async def drop_staged(self) -> None:
        """Forget staged weights (a transfer that failed somewhere, or after they loaded)."""

    async def weights_snapshot(self) -> StateDict:
        """The served weights as a CPU state dict: what a replica that starts after a collective
        transfer loads from a peer (no file holds them)."""


@runtime_checkable
class AdoptsExternal(Protocol):
    """`Capability.ADOPT_EXTERNAL`: the trainer moved the weights into the engine itself."""

    async def reported_version(self) -> int | None:
        """The weight version the engine itself reports (vLLM: its weight version); None: the
        engine keeps none of its own."""

    async def adopted(self, version: int) -> None:
        """The engine holds `version` already: let it take the version on (its forward-step
        labels, pass counts, prefix cache), while no engine step runs."""


@runtime_checkable
class CallsEngine(Protocol):
    """`Capability.ENGINE_RPC`."""

    async def engine_rpc(self, method: str, *args: object, **kwargs: object) -> object:
        """Call the engine's own API (vLLM: a method of its AsyncLLM, such as collective_rpc), for a
        trainer that moves weights itself through the app's handle."""


@runtime_checkable
class Aborts(Protocol):
    """`Capability.ABORT` (docs/design.md#client-pause)."""

    async def abort(self, request_ids: list[str] | None) -> None:
        """End the sequences `request_ids` names (their `GenerateRequest.request_id`; None: every
        sequence in the engine) between engine steps, paused or not: each stream's last delta has
        finish_reason 'abort' and the tokens not streamed yet, with their weight versions. An id
        the engine no longer runs is no error."""


class TransferRefused(ValueError):
    """A call of the engine's own weight-update group that this engine, as built, cannot take
    (its text is the caller's answer)."""


@runtime_checkable
class TransfersThroughEngine(Protocol):
    """`Capability.ENGINE_TRANSFER` (docs/design.md#engine-transfer): the engine's own
    weight-update group, which a trainer drives through the app's HTTP routes as it drives the
    engine's own server (vLLM's weight-transfer engine, SGLang's update group). The controller
    holds generation from `transfer_begin` until the update is published: in between, the
    engine's weights are partly loaded."""

    def transfer_problem(self) -> str | None:
        """Why this engine, as built, cannot join a trainer's group (None: it can)."""

    async def transfer_init(self, body: dict[str, Any], rank_offset: int | None) -> None:
        """Join the trainer's group as the engine's own API does with `body` (its fields, the
        trainer's rendezvous among them), this engine's workers from rank `rank_offset` on
        (None: `body` places them). ValueError: the engine refuses the fields."""

    async def transfer_begin(self) -> None:
        """Open one update (the engine's own update session)."""

    async def transfer_send(self, body: dict[str, Any] | list[dict[str, Any]], first_worker: int) -> None:
        """Receive one chunk of the update from the group and load it. `body`: the chunk's fields;
        a list holds one entry per engine worker of the whole app, this engine's from index
        `first_worker` on."""

    async def transfer_end(self, version: int) -> None:
        """Close the update, the engine's weights labelled `version` (what `reported_version`
        reports from then on)."""

    async def transfer_close(self, body: dict[str, Any]) -> None:
        """Leave the trainer's group (`body`: the engine's own fields, e.g. the group's name)."""


CAPABILITY_PROTOCOLS: dict[Capability, type] = {
    Capability.PROFILE: Profiles,
    Capability.PAUSE: Pauses,
    Capability.LOAD_PATH: LoadsPath,
    Capability.RECEIVE_COLLECTIVE: ReceivesCollective,
    Capability.ADOPT_EXTERNAL: AdoptsExternal,
    Capability.ENGINE_RPC: CallsEngine,
    Capability.ABORT: Aborts,
    Capability.ENGINE_TRANSFER: TransfersThroughEngine,
}
"""The protocol an adapter implements for each capability beyond generation."""


def protocol_methods(protocol: type) -> list[str]:
    """The methods `protocol` asks for, its bases' included."""
    own = (vars(base) for base in protocol.__mro__ if base not in (Protocol, object) and Protocol in base.__mro__)
    return sorted({name for names in own for name in names if not name.startswith("_")})


def capability_gaps(adapter: type[EngineAdapter], declared: frozenset[Capability]) -> list[str]:
    """Where `adapter`'s methods and its `declared` capabilities disagree: a declared capability
    whose protocol it does not implement, or a protocol it implements for a capability not
    declared (never called). Empty: they agree."""
    gaps = []
    for capability, protocol in CAPABILITY_PROTOCOLS.items():
        missing = [m for m in protocol_methods(protocol) if not callable(getattr(adapter, m, None))]
        if capability in declared and missing:
            gaps.append(f"declares {capability.value!r} but does not implement {', '.join(missing)}")
        elif capability not in declared and not missing:
            gaps.append(f"implements {', '.join(protocol_methods(protocol))} but does not declare {capability.value!r}")
    return gaps


def as_capability(adapter: EngineAdapter, protocol: type[T]) -> T:
    """`adapter` typed as `protocol`, which it implements (checked by `capability_gaps`)."""
    assert isinstance(adapter, protocol)
    return adapter
