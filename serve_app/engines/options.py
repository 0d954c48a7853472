"""The base of every engine's options class (`engines/<name>/options.py`): the rules about an
engine's settings, the profiler tools it can record with, the request fields it cannot honour and
the capabilities it has. The rules run when the app config is read (so `serve run` refuses a bad
config before any replica starts) and again before each control call fans out (a 422 naming the
engine and what it lacks).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar, Literal

from profiling.config import ProfileOptions, StrictModel, Tool


class Capability(StrEnum):
    """What an engine can do beyond the control policy every engine shares; the protocol an
    engine's adapter implements for each is `CAPABILITY_PROTOCOLS` of
    `serve_app/engines/adapter.py` (docs/engines.md#capabilities)."""

    GENERATE = "generate"
    """Serve completions: every engine has it."""
    PROFILE = "profile"
    """Record profiling windows: the profile routes."""
    PAUSE = "pause"
    """Hold admission of engine steps: `pause: true`, `resume: false`."""
    LOAD_PATH = "load_path"
    """Load weights from a checkpoint path: `source: path`."""
    RECEIVE_COLLECTIVE = "receive_collective"
    """Receive a collective broadcast and stage it: `weight_transfer: collective`."""
    ADOPT_EXTERNAL = "adopt_external"
    """Report the weight version the trainer moved in itself: `source: external`."""
    ENGINE_RPC = "engine_rpc"
    """Call the engine's own API: the app handle's `engine_rpc`."""
    ABORT = "abort"
    """End requests in flight early, each answering finish_reason abort with the tokens sampled so
    far: `/pause?mode=abort`, `/abort_requests`."""
    ENGINE_TRANSFER = "engine_transfer"
    """Join a trainer's weight-update group through the engine's own API, driven over HTTP as the
    engine's own server is (vLLM's weight-transfer routes, SGLang's update-group routes), each
    update one sync of the app (docs/design.md#engine-transfer)."""


CAPABILITY_USE: dict[Capability, str] = {
    Capability.GENERATE: "serving completions",
    Capability.PROFILE: "profiling (/profile/start, /profile/stop)",
    Capability.PAUSE: "holding engine steps (pause: true, resume: false)",
    Capability.LOAD_PATH: "loading weights from a path (source: path)",
    Capability.RECEIVE_COLLECTIVE: "weight_transfer: collective",
    Capability.ADOPT_EXTERNAL: "adopting weights the trainer moved itself (source: external)",
    Capability.ENGINE_RPC: "engine RPC (the app handle's engine_rpc)",
    Capability.ABORT: "ending requests in flight early (/pause?mode=abort, /abort_requests)",
    Capability.ENGINE_TRANSFER: "the engine's own weight-update group over HTTP (vLLM's /init_weight_transfer_engine, "
    "SGLang's /init_weights_update_group and what follows them)",
}
"""What each capability lets a caller do, in the words of a refusal."""


TransferDialect = Literal["vllm", "sglang"]
"""Whose server routes drive an engine's own weight-update group (docs/design.md#engine-transfer)."""
TRANSFER_ROUTES: dict[TransferDialect, str] = {
    "vllm": "vLLM's /init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update",
    "sglang": "SGLang's /init_weights_update_group, /begin_weight_update, /update_weights_from_distributed, "
    "/end_weight_update",
}


class CapabilityMissing(ValueError):
    """A request needs a capability the app's engine does not declare (a 422 for the caller)."""


class EngineOptions(StrictModel):
    """Base of the engine blocks. Field docstrings are the fields' documentation."""

    engine: ClassVar[str]
    """The `engine:` value that selects this engine."""
    implementation: ClassVar[str]
    """`module:Class` of the engine, imported only when a replica builds it (an engine's module
    imports its engine's packages)."""
    capabilities: ClassVar[frozenset[Capability]]
    """What this engine can do; a request for anything else is refused before any replica is
    asked (`require`)."""
    lacks: ClassVar[dict[Capability, str]] = {}
    """Why this engine lacks a capability, where the reason helps the caller choose another way."""
    tools: ClassVar[tuple[Tool, ...]] = ()
    """The profiler tools this engine can record with (with `Capability.PROFILE`)."""
    unsupported_sampling: ClassVar[dict[str, str]] = {}
    """Generation request fields this engine cannot honour, each with why: a request that sets
    one is refused (422 naming the field and the engine), never served with it dropped."""
    transfer_dialect: ClassVar[TransferDialect | None] = None
    """Whose routes drive this engine's own weight-update group (with `Capability.ENGINE_TRANSFER`);
    None: it has none."""

    @property
    def transfer_backend(self) -> str | None:
        """The backend the engines build their weight-update group with when they start, where the
        engine fixes it then (vLLM's weight_transfer_config); None: none is fixed."""
        return None

    def transfer_refusal(self, dialect: TransferDialect) -> str | None:
        """Why a trainer cannot drive the engines' own weight-update group through `dialect`'s
        routes, as configured (None: it can)."""
        if self.transfer_dialect is None or not self.has(Capability.ENGINE_TRANSFER):
            why = f": {note}" if (note := self.lacks.get(Capability.ENGINE_TRANSFER)) else ""
            return f"engine {self.engine} has no weight-update group of its own to join{why}"
        if dialect != self.transfer_dialect:
            routes = TRANSFER_ROUTES[self.transfer_dialect]
            return f"engine {self.engine}'s weight-update group is driven through {routes}, not {dialect}'s routes"
        return None

    @classmethod
    def has(cls, capability: Capability) -> bool:
        """Whether this engine declares `capability`."""
        return capability in cls.capabilities

    @classmethod
    def missing(cls, capability: Capability, fix: str = "") -> CapabilityMissing:
        """The refusal of a call that needs `capability`: it names the use, the engine, the
        capability, why the engine lacks it (`lacks`) and `fix`."""
        why = f": {note}" if (note := cls.lacks.get(capability)) else ""
        return CapabilityMissing(
            f"{CAPABILITY_USE[capability]} is not supported with engine {cls.engine} (it lacks the capability "
            f"{capability.value!r}{why})" + (f": {fix}" if fix else "")
        )

    @classmethod
    def require(cls, capability: Capability, fix: str = "") -> None:
        """`missing(capability, fix)` raised, unless the engine declares `capability`."""
        if capability not in cls.capabilities:
            raise cls.missing(capability, fix)

    @classmethod
    def profiler_problems(cls, options: ProfileOptions, built: ProfileOptions) -> list[str]:
        """Why this engine cannot record with `options` (empty: it can). `built`: the app's
        `profiler` settings, which the engine was built with."""
        if options.tool not in cls.tools:
            return [
                f"tool {options.tool!r} is not available with engine {cls.engine!r} "
                f"(it records with {', '.join(cls.tools)})"
            ]
        return []

    @classmethod
    def check_profiler(cls, options: ProfileOptions, built: ProfileOptions) -> None:
        """ValueError naming every problem of `profiler_problems`."""
        if problems := cls.profiler_problems(options, built):
            raise ValueError("; ".join(problems))

    @classmethod
    def app_problems(cls, args: dict[str, Any]) -> dict[str, str]:
        """Rules tying this engine to the app's other keys (`args`: the app's validated keys), as
        {key: why}; empty when the engine has none or they hold."""
        return {}
