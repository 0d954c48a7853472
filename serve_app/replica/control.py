"""The replica's control plane: the calls the controller broadcasts (profile, weights, status),
each answered with a ReplicaReport that names the replica (broadcast results carry no replica
id). Every failure takes one path into the report: the app's own errors keep their text and say
how the call ended; any other error is named by the call and its first line."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import ray

from profiling.session import SessionConflict, SessionSpec
from serve_app.admission import GenerationGate
from serve_app.api import ClientPauseMode, EngineRpcReport, Outcome, PerReplica, ReplicaReport
from serve_app.config import AppArgs
from serve_app.engines.adapter import TransferRefused
from serve_app.engines.controller import EngineController
from serve_app.engines.weight_control import AdoptConflict, AdoptRefused
from serve_app.weights.collective_schema import CollectiveTransfer
from serve_app.weights.object_store import keep_only, materialize_weights
from serve_app.weights.safetensors_file import WeightsError

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R", bound=ReplicaReport)

OWN_ERRORS: tuple[tuple[type[Exception], Outcome], ...] = (
    (SessionConflict, Outcome.CONFLICT),
    (AdoptConflict, Outcome.CONFLICT),
    (AdoptRefused, Outcome.REFUSED),
    (TransferRefused, Outcome.REFUSED),
    (WeightsError, Outcome.FAILED),
)
"""Errors whose text is written for the user, with the outcome each one means."""


def _paused(mode: str) -> str:
    return (
        f"generation is paused (POST /pause with mode={mode}): new requests are refused until POST /resume, "
        "or until client_pause_max_s passes"
    )


WAIT_PAUSED = _paused("wait")
ABORT_PAUSED = _paused("abort")


class ControlPlane:
    """Control methods of the replica deployment, reached by the controller's broadcast."""

    engine: EngineController
    replica_id: str
    _args: AppArgs
    _gate: GenerationGate
    _node_id: str
    _node_dir: Path
    _redact: Callable[[str], str]

    def _report(self, kind: type[R] = ReplicaReport, **fields: Any) -> R:  # type: ignore[assignment]
        """This replica's state as a report of `kind`, with `fields` over it."""
        st = self.engine.status()
        base: dict[str, Any] = {
            "replica_id": self.replica_id,
            "pid": os.getpid(),
            "node_id": self._node_id,
            "state": st.state,
            "active_step": st.active_step,
            "weight_version": st.weight_version,
            "paused": st.paused,
            "client_pause": self.client_pause_mode,
            "forward_steps": st.forward_steps,
            "forward_steps_by_version": st.forward_steps_by_version,
            "requests_in_flight": st.requests_in_flight,
            "requests_waiting": self._gate.waiting,
            "transfer_ranks": self.engine.transfer_ranks,
        }
        base.update(fields)
        if error := base.get("error"):  # the full text goes to the log, the answer names no server path
            log.info("replica %s: %s", self.replica_id, error)
            base["error"] = self._redact(str(error))
        return kind(**base)

    def _failed(self, error: str, outcome: Outcome = Outcome.FAILED, kind: type[R] = ReplicaReport) -> R:  # type: ignore[assignment]
        """The report of a call that failed; `error` says why, for the user."""
        return self._report(kind, error=error, **outcome.flags())

    def _raised(self, e: Exception, what: str, otherwise: Outcome, kind: type[R]) -> R:
        """The report of a call that raised `e`: the app's own errors keep their text and say how
        the call ended; any other is `otherwise`, named by `what` and its first line."""
        outcome, error = next(
            ((o, str(e)) for t, o in OWN_ERRORS if isinstance(e, t)), (otherwise, f"{what}: {first_line(e)}")
        )
        return self._failed(error, outcome, kind)

    async def _control(
        self,
        what: str,
        call: Awaitable[T],
        fields: Callable[[T], dict[str, Any]] = lambda _: {},
        otherwise: Outcome = Outcome.FAILED,
        kind: type[R] = ReplicaReport,  # type: ignore[assignment]
    ) -> R:
        """Await `call`: the report with `fields` of its result, or of how it failed."""
        try:
            result = await call
        except Exception as e:  # noqa: BLE001 - every failure is reported per replica
            return self._raised(e, what, otherwise, kind)
        return self._report(kind, **fields(result))

    async def start_profile(self, spec: SessionSpec) -> ReplicaReport:
        """Start recording `spec`'s step; an engine or profiler that cannot is a refusal."""
        return await self._control(
            "start failed",
            self.engine.start_profile(spec),
            lambda started: {"state": "profiling" if started else self.engine.status().state},
            otherwise=Outcome.REFUSED,
        )

    async def stop_profile(self, step: int | None, pause: bool) -> ReplicaReport:
        """Stop recording `step` (None: whichever is recording), holding admission if `pause`."""
        t0 = time.perf_counter()
        return await self._control(
            "stop failed",
            self.engine.stop_profile(step, pause),
            lambda outcome: {
                "files": outcome.files,
                "forward_steps": outcome.forward_steps,
                "stop_ack_s": time.perf_counter() - t0,
            },
        )

    async def release_hold(self) -> ReplicaReport:
        """End the sync's admission hold (the update it held for failed)."""
        return await self._control("release failed", self.engine.release_hold())

    async def update_weights(self, version: int, path: str | None, resume: bool) -> ReplicaReport:
        """Load `version` from `path`."""
        return await self._control(
            "weight update failed",
            self.engine.update_weights(version, path, resume),
            lambda load_s: {"load_s": load_s},
        )

    async def update_weights_in_cluster(self, version: int, refs: list[ray.ObjectRef], resume: bool) -> ReplicaReport:
        """Fetch the weights from the object store onto this node, then load them like a path."""
        t0 = time.perf_counter()
        try:
            path = await materialize_weights(refs, self._node_dir, version)
        except Exception as e:  # noqa: BLE001 - reported per replica
            return self._raised(e, "could not fetch the weights from the object store", Outcome.FAILED, ReplicaReport)
        transfer_s = time.perf_counter() - t0
        report = await self.update_weights(version, str(path), resume)
        if report.ok:
            keep_only(path)
        else:
            path.unlink(missing_ok=True)
        return report.model_copy(update={"transfer_s": transfer_s})

    async def receive_weights(
        self, version: int, transfer: CollectiveTransfer, first_ranks: dict[str, int], world_size: int
    ) -> ReplicaReport:
        """Join the sync's group at this replica's ranks in `first_ranks` and stage `version`'s
        tensors (docs/design.md#weights-by-collective); the served weights are untouched."""
        first = first_ranks.get(self.replica_id)
        if first is None:
            return self._failed(
                f"not a member of the transfer of version {version}: this replica started after the "
                "members were counted; the next sync counts it"
            )
        return await self._control(
            f"did not receive version {version}",
            self.engine.receive_weights(transfer, first, world_size, self._args.control_timeout_s),
            lambda transfer_s: {"transfer_s": transfer_s},
        )

    async def load_staged(self, version: int, resume: bool) -> ReplicaReport:
        """Load the staged transfer as `version` (every member received it), as a path loads."""
        return await self._control(
            "weight update failed", self.engine.load_staged(version, resume), lambda load_s: {"load_s": load_s}
        )

    async def drop_staged(self) -> ReplicaReport:
        """Forget a staged transfer (another member did not receive it): the old version serves on."""
        await self.engine.drop_staged()
        return self._report()

    async def adopt_weights(self, version: int, resume: bool) -> ReplicaReport:
        """Record `version`, which the trainer moved into the engine itself (source external), if
        the engine reports it; a refusal when the engine keeps no version, a conflict when it
        reports another."""
        return await self._control(f"could not adopt version {version}", self.engine.adopt_weights(version, resume))

    async def weights_snapshot(self, version: int) -> list[ray.ObjectRef]:
        """`[ref]` of the served weights (CPU tensors) in the object store, for a replica that
        joins after a collective or external transfer. ValueError when this replica serves
        another version."""
        if self.engine.weight_version != version:
            raise ValueError(f"this replica serves version {self.engine.weight_version}, not {version}")
        snapshot = await self.engine.weights_snapshot()
        return [ray.put(snapshot)]

    async def engine_rpc(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> EngineRpcReport:
        """`method(*args, **kwargs)` of the engine's own API (reached by handle only, never HTTP);
        a `PerReplica` argument is replaced by this replica's value."""

        async def call() -> Any:
            mine = [a.pick(self.replica_id) if isinstance(a, PerReplica) else a for a in args]
            named = {k: v.pick(self.replica_id) if isinstance(v, PerReplica) else v for k, v in kwargs.items()}
            return await self.engine.engine_rpc(method, *mine, **named)

        return await self._control(
            f"engine rpc {method} failed", call(), lambda result: {"result": result}, kind=EngineRpcReport
        )

    # -- the engine's own weight-update group, driven over HTTP (docs/design.md#engine-transfer) --
    async def transfer_init(self, body: dict[str, Any], rank_offsets: dict[str, int] | None) -> ReplicaReport:
        """Join the trainer's group, this replica's engine workers from rank
        `rank_offsets[<this replica>]` on (None: `body` places them)."""

        async def init() -> None:
            offset = None
            if rank_offsets is not None:
                if self.replica_id not in rank_offsets:
                    raise TransferRefused(
                        f"replica {self.replica_id} started after the trainer's group was formed, so it has no rank "
                        "in it: form the group again"
                    )
                offset = rank_offsets[self.replica_id]
            await self.engine.transfer_init(body, offset)

        return await self._control("joining the trainer's weight-update group failed", init())

    async def transfer_begin(self) -> ReplicaReport:
        """Open one update of the weights through the group (generation is held)."""
        return await self._control("opening the weight update failed", self.engine.transfer_begin())

    async def transfer_send(
        self, body: dict[str, Any] | list[dict[str, Any]], first_workers: dict[str, int]
    ) -> ReplicaReport:
        """Receive and load one chunk (`first_workers[<this replica>]`: where this replica's
        workers start among the app's, for a chunk given per worker)."""

        async def send() -> None:
            if self.replica_id not in first_workers:
                raise TransferRefused(
                    f"replica {self.replica_id} is not a member of the trainer's weight-update group (it started "
                    "after the group was formed): form the group again"
                )
            await self.engine.transfer_send(body, first_workers[self.replica_id])

        return await self._control("receiving the weights failed", send())

    async def transfer_end(self, version: int) -> ReplicaReport:
        """Close the update, the engine's weights labelled `version`."""
        return await self._control(f"closing the update to version {version} failed", self.engine.transfer_end(version))

    async def transfer_close(self, body: dict[str, Any]) -> ReplicaReport:
        """Leave the trainer's group."""
        return await self._control("leaving the trainer's weight-update group failed", self.engine.transfer_close(body))

    async def reset_prefix_cache(self, reset_running_requests: bool, reset_external: bool) -> ReplicaReport:
        """Empty the engine's prefix cache; the engine's refusal is the report's error."""
        refused = {
            "error": "the engine refused to empty its prefix cache: requests in flight hold cached blocks "
            "(vLLM: ask with reset_running_requests=true to preempt them; SGLang: once they end)",
            **Outcome.REFUSED.flags(),
        }
        return await self._control(
            "prefix cache reset failed",
            self.engine.reset_prefix_cache(reset_running_requests, reset_external),
            lambda done: {} if done else refused,
        )

    @property
    def client_pause_mode(self) -> ClientPauseMode | None:
        """The client's pause in effect here (None: none)."""
        if self.engine.client_aborting:
            return "abort"
        return "keep" if self.engine.client_held else "wait" if self._gate.closed is not None else None

    async def client_pause(self, mode: ClientPauseMode, for_s: float, drain: bool = True) -> ReplicaReport:
        """A client's pause here, for `for_s` seconds at most (docs/design.md#client-pause):
        `keep` holds the engine (requests in flight freeze between engine steps, new ones queue);
        `wait` refuses new generation calls with 503 and, with `drain`, answers once those
        admitted finished (a health check's convergence does not wait for them); `abort` refuses
        new ones with 503 and ends those in flight at once (the report's `aborted`)."""

        async def pause() -> dict[str, Any]:
            if mode == "keep":
                self._gate.open()
                await self.engine.client_hold(for_s)
                return {}
            if mode == "abort":
                # Closed first: what the gate admitted until now is in flight, and is ended.
                self._gate.close(ABORT_PAUSED, for_s)
                return {"aborted": await self.engine.client_abort(for_s)}
            await self.engine.client_release()
            self._gate.close(WAIT_PAUSED, for_s)
            if drain:
                await self._gate.drained()
            return {}

        return await self._control("pause failed", pause(), lambda fields: fields)

    async def abort_requests(self, request_ids: list[str] | None) -> ReplicaReport:
        """End the generation requests in flight here that `request_ids` names (None: every
        one), each answering finish_reason abort with the tokens sampled so far; the report's
        `aborted` counts them (one per choice)."""
        return await self._control("abort failed", self.engine.abort(request_ids), lambda n: {"aborted": n})

    async def client_resume(self) -> ReplicaReport:
        """End a client's pause here: the engine runs and the gate admits again (the sync's
        own hold, where one is in effect, still holds the engine)."""

        async def resume() -> None:
            self._gate.open()
            await self.engine.client_release()

        return await self._control("resume failed", resume())

    async def status(self) -> ReplicaReport:
        """This replica's state."""
        return self._report()

    async def wall_clock(self) -> tuple[str, int]:
        """This replica's id and `time.time_ns()`, for the controller's clock exchange."""
        return self.replica_id, time.time_ns()

    async def export_report(self, step: int) -> ReplicaReport:
        """Answers once this replica's trace export for `step` has finished."""
        entry = await self.engine.wait_exported(step, self._args.export_timeout_s)
        if entry is None:
            return self._failed(f"this replica recorded nothing for step {step}")
        return self._report(ok=entry.status == "ok", files=entry.files, error=entry.error)


def first_line(e: BaseException) -> str:
    """`<type>: <first line>` of an error (gloo's and Ray's carry long tails)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"
