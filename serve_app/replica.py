"""The rollout replica deployment: one engine, one profiling session, reached by handle, and with
`replica_listener` also over HTTP on a port of its own (serve_app/ingress/replica_listener.py).

Generation is admitted through the replica's own gate (serve_app/admission.py); control calls
(broadcast by the controller) never wait for it. Control methods return a ReplicaReport naming
the replica, since broadcast results carry no replica id. A replica that starts while a step is
profiled (late join, restart) converges to the controller's desired state in its constructor:
current weights, active step, admission hold.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from profiling.manifest import ManifestEntry
from profiling.session import ProfileSession, SessionConflict, SessionSpec
from profiling.store import TraceStore
from serve_app.admission import GenerationGate
from serve_app.api import EngineRpcReport, PerReplica, ReplicaReport
from serve_app.async_streams import merged
from serve_app.choices import ChoiceBuilder, JobAccepted, JobDone, JobResult, PromptJob, choice_index, sampling_for
from serve_app.config import AppArgs
from serve_app.desired_state import DesiredState, ObjectStoreWeights, PathWeights, PeerWeights
from serve_app.engines import create_engine
from serve_app.engines.base import AdoptRefused, check_fits, room_left
from serve_app.engines.generation import GenerateRequest
from serve_app.ingress.http_options import serve_http_options
from serve_app.ingress.listener import ListenerError
from serve_app.ingress.replica_listener import ReplicaListener
from serve_app.openai_api import ChatChunkChoice, ChatCompletionRequest, CompletionChunkChoice
from serve_app.reconcile import Reconciler
from serve_app.redact import app_redactor
from serve_app.trace_collection import ShippingTraceStore, node_local_dir
from serve_app.weights.collective_schema import CollectiveTransfer
from serve_app.weights.object_store import keep_only, materialize_weights
from serve_app.weights.safetensors_file import WeightsError

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 300.0
"""Longest a starting replica waits for the controller's desired state (the controller starts
with the app, alongside the replicas, on a machine that may be busy building engines)."""
INLINE_TOKENIZE_CHARS = 1024
"""Text prompts up to this long are tokenized on the event loop (about 0.2 ms at this length with
a fast tokenizer): the hop to a thread and back costs more than that under load (a tenth of a
replica's CPU per request at 1024 clients); longer ones go to a thread."""
CHECK_TIMEOUT_S = 2.0
"""Longest a health check waits for the desired state: a controller that is restarting must not
make the replicas' health checks time out (Serve would restart them)."""


class RolloutReplica:
    async def __init__(self, args: AppArgs):  # type: ignore[misc]  # Serve awaits it
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_tag
        self._args = args
        self._redact = app_redactor(args)
        self._node_id = ray.get_runtime_context().get_node_id()
        self._node_dir = node_local_dir(args.node_dir, self._node_id)
        # The controller merges once every replica's export is in (one merge per step).
        store = (
            ShippingTraceStore(self._node_dir / "traces", ctx.app_name)
            if args.trace_collection == "ray"
            else TraceStore(args.save_path)
        )
        self.engine = create_engine(
            args,
            lambda backend_factory: ProfileSession(
                store=store,
                entry_identity=ManifestEntry(role="rollout", replica_id=self.replica_id, node_id=self._node_id),
                exporter=ThreadPoolExecutor(1, thread_name_prefix="trace-export"),
                backend_factory=backend_factory,
            ),
            self.replica_id,
            trace_root=store.root,
        )
        await self.engine.opened()
        self._gate = GenerationGate(args.request_limits)
        # By name: the controller's deployment binds this one, so it cannot be bound here.
        controller = serve.get_deployment_handle("RolloutController", ctx.app_name)
        self._controller = ControllerView(controller)
        self._reconciler = Reconciler(self.engine, self._controller)
        await self._join()
        self._listener: ReplicaListener | None = None
        if (listener := args.replica_listener) is not None:
            http = await asyncio.to_thread(serve_http_options)
            timeout_s = None if http is None else http.request_timeout_s
            try:
                self._listener = ReplicaListener(self, controller, args, listener, timeout_s)
            except ListenerError:
                await self.engine.shutdown()
                raise

    async def _join(self) -> None:
        """Converge on the desired state as this replica starts: the served weights, the
        active step (joined late), the admission hold."""
        desired = await self._controller.get(JOIN_TIMEOUT_S)
        version = desired.weight_version
        match desired.weights:
            case PathWeights(path=path) if version > 0:
                await self.engine.update_weights(version, path, resume=True)
            case ObjectStoreWeights():
                if refs := await self._controller.weights_refs():
                    report = await self.update_weights_in_cluster(version, refs, True)
                    if not report.ok:
                        raise RuntimeError(f"cannot load the served weights, version {version}: {report.error}")
                elif version > 0:  # the object store's ref went with a controller that restarted
                    await self._load_from_peer(version)
            case PeerWeights() if version > 0:  # no file holds them
                await self._load_from_peer(version)
        if desired.active is not None:
            spec = desired.active.model_copy(update={"late_start": True})
            log.info("joining active step %s late", spec.step)
            await self.engine.start_profile(spec)
        if desired.paused:
            await self.engine.stop_profile(None, pause=True)

    async def _load_from_peer(self, version: int) -> None:
        """Load the served `version` from a peer replica's snapshot (no file holds weights that came
        by collective or the trainer's own transfer); RuntimeError when no peer can give it, so this
        replica never serves other weights under the app's version."""
        ctx = serve.get_replica_context()
        # Routed, not broadcast: this replica is not running yet, so a peer answers.
        peers = serve.get_deployment_handle(ctx.deployment, ctx.app_name)
        deadline = time.monotonic() + self._args.control_timeout_s
        why = "no peer replica answered"
        for _ in range(2 * self._args.num_replicas):
            try:
                refs = await asyncio.wait_for(
                    peers.weights_snapshot.remote(version), max(0.1, deadline - time.monotonic())
                )
            except Exception as e:  # noqa: BLE001 - another peer may have it; the last reason is raised
                why = _first_line(e)
                if time.monotonic() >= deadline:
                    break
                continue
            report = await self.update_weights_in_cluster(version, refs, True)
            if report.ok:
                log.info("loaded the served weights, version %s, from a peer replica", version)
                return
            why = report.error or "the load failed"
            break
        message = (
            f"cannot load the served weights, version {version}: they came by collective or by the trainer's "
            f"own transfer, no file holds them, and no peer replica gave a copy ({why}); publish the weights "
            "again as a new version to bring this replica in"
        )
        log.error(message)
        raise RuntimeError(message)

    def _report(self, **fields: Any) -> ReplicaReport:
        st = self.engine.status()
        base: dict[str, Any] = {
            "replica_id": self.replica_id,
            "pid": os.getpid(),
            "node_id": self._node_id,
            "state": st.state,
            "active_step": st.active_step,
            "weight_version": st.weight_version,
            "paused": st.paused,
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
        return ReplicaReport(**base)

    # -- generation (load balanced) -----------------------------------------------------------
    async def run_jobs(self, jobs: list[PromptJob]) -> list[JobResult]:
        """Prompts of one request, each with its `n` choices, whole. One call carries several
        prompts: a handle call costs more than a prompt's bookkeeping."""
        async with self._gate.admit():
            return list(await asyncio.gather(*(self._run_job(j) for j in jobs)))

    async def _run_job(self, job: PromptJob) -> JobResult:
        builders, requests = await self._prepare(job, stream=False)

        async def run(builder: ChoiceBuilder, request: GenerateRequest) -> None:
            async for delta in self.engine.generate(request):
                builder.feed(delta)

        await asyncio.gather(*(run(b, r) for b, r in zip(builders, requests, strict=True)))
        return JobResult(
            choices=[b.choice() for b in builders],
            prompt_tokens=len(builders[0].prompt_ids),
            completion_tokens=sum(len(b.token_ids) for b in builders),
        )

    async def stream_jobs(
        self, jobs: list[PromptJob]
    ) -> AsyncIterator[JobAccepted | CompletionChunkChoice | ChatChunkChoice | JobDone]:
        """Prompts of one request as stream pieces: `JobAccepted` once every prompt fits and its
        sequences are queued, then pieces as the engine makes tokens, then `JobDone`. Closing
        the stream (the caller went away) aborts every sequence still running."""
        async with self._gate.admit():
            prepared = [await self._prepare(j, stream=True) for j in jobs]
            builders = [b for bs, _ in prepared for b in bs]
            requests = [r for _, rs in prepared for r in rs]
            yield JobAccepted(prompt_tokens=sum(len(bs[0].prompt_ids) for bs, _ in prepared))
            async for i, delta in merged(self.engine.generate(r) for r in requests):
                if (piece := builders[i].piece(delta)) is not None:
                    yield piece
            yield JobDone(completion_tokens=sum(len(b.token_ids) for b in builders))

    async def _prepare(self, job: PromptJob, stream: bool) -> tuple[list[ChoiceBuilder], list[GenerateRequest]]:
        """Tokenize (a long prompt off the event loop: it must not stall control calls and health
        checks), check the prompt fits, and build each choice's request. ValueError: a 422."""
        engine, request = self.engine, job.request
        if isinstance(request, ChatCompletionRequest):
            messages = [{"role": m.role, "content": m.text()} for m in request.messages]
            prompt_ids = await asyncio.to_thread(engine.chat_prompt, messages, request.add_generation_prompt)
        elif isinstance(job.prompt, str) and len(job.prompt) <= INLINE_TOKENIZE_CHARS:
            prompt_ids = engine.tokenize(job.prompt)
        elif isinstance(job.prompt, str):
            prompt_ids = await asyncio.to_thread(engine.tokenize, job.prompt)
        else:
            prompt_ids = list(job.prompt or [])
        if not prompt_ids:
            raise ValueError("prompt is empty after tokenization")
        engine.check_prompt(prompt_ids)
        max_tokens = request.output_limit()
        if max_tokens is None:
            max_tokens = room_left(engine.context_length, len(prompt_ids))
        else:
            check_fits(engine.context_length, len(prompt_ids), max_tokens)
        text = job.prompt if isinstance(job.prompt, str) else None
        builders, requests = [], []
        for i in range(request.n):
            index = choice_index(request, job.prompt_index, i)
            builders.append(ChoiceBuilder(engine, request, index, prompt_ids, text, engine.weight_version))
            requests.append(
                GenerateRequest(
                    prompt_token_ids=prompt_ids,
                    sampling=sampling_for(request, job.prompt_index, i, max_tokens),
                    stream=stream,
                )
            )
        return builders, requests

    # -- control (broadcast) ------------------------------------------------------------------
    async def start_profile(self, spec: SessionSpec) -> ReplicaReport:
        try:
            started = await self.engine.start_profile(spec)
        except SessionConflict as e:
            return self._report(ok=False, conflict=True, error=str(e))
        except Exception as e:  # noqa: BLE001 - the engine or its profiler refused: reported per replica
            return self._report(ok=False, refused=True, error=f"start failed: {e}")
        return self._report(state="profiling" if started else self.engine.status().state)

    async def stop_profile(self, step: int | None, pause: bool) -> ReplicaReport:
        t0 = time.perf_counter()
        try:
            outcome = await self.engine.stop_profile(step, pause)
        except SessionConflict as e:
            return self._report(ok=False, conflict=True, error=str(e))
        except Exception as e:  # noqa: BLE001
            return self._report(ok=False, error=f"stop failed: {e}")
        return self._report(
            files=outcome.files,
            forward_steps=outcome.forward_steps,
            stop_ack_s=time.perf_counter() - t0,
        )

    async def update_weights(self, version: int, path: str | None, resume: bool) -> ReplicaReport:
        try:
            load_s = await self.engine.update_weights(version, path, resume)
        except WeightsError as e:
            return self._report(ok=False, error=str(e))
        except Exception as e:  # noqa: BLE001
            return self._report(ok=False, error=f"weight update failed: {e}")
        return self._report(load_s=load_s)

    async def update_weights_in_cluster(self, version: int, refs: list[ray.ObjectRef], resume: bool) -> ReplicaReport:
        """Fetch the weights from the object store onto this node, then load them like a path."""
        t0 = time.perf_counter()
        try:
            path = await materialize_weights(refs, self._node_dir, version)
        except Exception as e:  # noqa: BLE001 - reported per replica
            return self._report(ok=False, error=f"could not fetch the weights from the object store: {e}")
        transfer_s = time.perf_counter() - t0
        report = await self.update_weights(version, str(path), resume)
        if report.ok:
            keep_only(path)
        else:
            path.unlink(missing_ok=True)
        return report.model_copy(update={"transfer_s": transfer_s})

    # -- weights by collective, and the trainer's own transfer (broadcast) -----------------------
    async def receive_weights(
        self, version: int, transfer: CollectiveTransfer, first_ranks: dict[str, int], world_size: int
    ) -> ReplicaReport:
        """Join the sync's group at this replica's ranks in `first_ranks` and stage `version`'s
        tensors (docs/design.md#weights-by-collective); the served weights are untouched."""
        first = first_ranks.get(self.replica_id)
        if first is None:
            return self._report(
                ok=False,
                error=f"not a member of the transfer of version {version}: this replica started after the "
                "members were counted; the next sync counts it",
            )
        try:
            transfer_s = await self.engine.receive_weights(transfer, first, world_size, self._args.control_timeout_s)
        except WeightsError as e:
            return self._report(ok=False, error=str(e))
        except Exception as e:  # noqa: BLE001 - reported per replica
            return self._report(ok=False, error=f"did not receive version {version}: {_first_line(e)}")
        return self._report(transfer_s=transfer_s)

    async def load_staged(self, version: int, resume: bool) -> ReplicaReport:
        """Load the staged transfer as `version` (every member received it), as a path loads."""
        try:
            load_s = await self.engine.load_staged(version, resume)
        except WeightsError as e:
            return self._report(ok=False, error=str(e))
        except Exception as e:  # noqa: BLE001
            return self._report(ok=False, error=f"weight update failed: {_first_line(e)}")
        return self._report(load_s=load_s)

    async def drop_staged(self) -> ReplicaReport:
        """Forget a staged transfer (another member did not receive it): the old version serves on."""
        await self.engine.drop_staged()
        return self._report()

    async def adopt_weights(self, version: int, resume: bool) -> ReplicaReport:
        """Record `version`, which the trainer moved into the engine itself (source external), if
        the engine reports it; `refused` when the engine keeps no version, `conflict` when it
        reports another."""
        try:
            await self.engine.adopt_weights(version, resume)
        except AdoptRefused as e:
            return self._report(ok=False, refused=True, error=str(e))
        except ValueError as e:
            return self._report(ok=False, conflict=True, error=str(e))
        except Exception as e:  # noqa: BLE001
            return self._report(ok=False, error=f"could not adopt version {version}: {_first_line(e)}")
        return self._report()

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
        try:
            args = [a.pick(self.replica_id) if isinstance(a, PerReplica) else a for a in args]
            kwargs = {k: v.pick(self.replica_id) if isinstance(v, PerReplica) else v for k, v in kwargs.items()}
            result = await self.engine.engine_rpc(method, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - reported per replica
            return EngineRpcReport(
                **self._report(ok=False, error=f"engine rpc {method} failed: {_first_line(e)}").model_dump()
            )
        return EngineRpcReport(**self._report().model_dump(), result=result)

    async def status(self) -> ReplicaReport:
        return self._report()

    async def wall_clock(self) -> tuple[str, int]:
        """This replica's id and `time.time_ns()`, for the controller's clock exchange."""
        return self.replica_id, time.time_ns()

    async def export_report(self, step: int) -> ReplicaReport:
        """Answers once this replica's trace export for `step` has finished."""
        entry = await self.engine.wait_exported(step, self._args.export_timeout_s)
        if entry is None:
            return self._report(ok=False, error=f"this replica recorded nothing for step {step}")
        return self._report(ok=entry.status == "ok", files=entry.files, error=entry.error)

    async def check_health(self) -> None:
        if not self.engine.healthy():
            raise RuntimeError(f"engine {self._args.engine} is not healthy")
        try:
            await self._reconciler.check()
        except Exception:
            log.exception("could not converge on the app's desired state")

    async def __del__(self) -> None:
        if (listener := getattr(self, "_listener", None)) is not None:  # requests under way finish first
            await listener.close()
        await self.engine.shutdown()


class ControllerView:
    """The desired state as this replica reads it: from the app's controller, by handle."""

    def __init__(self, controller: DeploymentHandle):
        self._controller = controller

    async def get(self, timeout_s: float = CHECK_TIMEOUT_S) -> DesiredState:
        """The desired state; TimeoutError when the controller does not answer within `timeout_s`
        (it is restarting: the next health check asks again)."""
        return await asyncio.wait_for(self._controller.desired_state.remote(), timeout_s)

    async def weights_refs(self) -> list[ray.ObjectRef]:
        """`[ref]` of the served weights in the object store; empty when the controller restarted since."""
        return await asyncio.wait_for(self._controller.weights_refs.remote(), JOIN_TIMEOUT_S)


def _first_line(e: BaseException) -> str:
    """`<type>: <first line>` of an error (gloo's and Ray's carry long tails)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"
