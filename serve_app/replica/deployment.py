"""The rollout replica deployment: one engine, one profiling session, reached by handle, and with
`replica_listener` also over HTTP on a port of its own (serve_app/ingress/replica_listener.py).

Its methods come in two planes: generation (serve_app/replica/generation.py), admitted through the
replica's own gate, and control (serve_app/replica/control.py), broadcast by the controller and
never waiting for generation. A replica that starts while a step is profiled (late join,
restart) converges to the controller's desired state in its constructor: current weights,
active step, admission hold.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from profiling.manifest import ManifestEntry
from profiling.session import ProfileSession
from profiling.store import TraceStore
from serve_app.admission import GenerationGate
from serve_app.config import AppArgs
from serve_app.desired_state import DesiredState, ObjectStoreWeights, PathWeights, PeerWeights
from serve_app.engines import create_engine
from serve_app.ingress.http_options import serve_http_options
from serve_app.ingress.listener import ListenerError
from serve_app.ingress.replica_listener import ReplicaListener
from serve_app.reconcile import Reconciler
from serve_app.redact import app_redactor
from serve_app.replica.control import ControlPlane, first_line
from serve_app.replica.generation import GenerationPlane
from serve_app.serve_logs import quiet_serve_logs
from serve_app.trace_collection import ShippingTraceStore, node_local_dir

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 300.0
"""Longest a starting replica waits for the controller's desired state (the controller starts
with the app, alongside the replicas, on a machine that may be busy building engines)."""
CHECK_TIMEOUT_S = 2.0
"""Longest a health check waits for the desired state: a controller that is restarting must not
make the replicas' health checks time out (Serve would restart them)."""


class RolloutReplica(GenerationPlane, ControlPlane):
    """The deployment: both planes over one engine and one profiling session."""

    async def __init__(self, args: AppArgs):  # type: ignore[misc]  # Serve awaits it
        quiet_serve_logs()
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
        self._reconciler = Reconciler(self.engine, self._controller, self)
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
                if await asyncio.to_thread(os.path.exists, path):
                    await self.engine.update_weights(version, path, resume=True)
                else:  # deleted after the load (AReaL deletes each checkpoint once loaded): a peer has it
                    log.warning("the served weights' path is gone; copying version %s from a peer replica", version)
                    await self._load_from_peer(version)
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
        if (pause := desired.client_pause) is not None and pause.left_s() > 0:
            await self.client_pause(pause.mode, pause.left_s())

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
                why = first_line(e)
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
