"""Engine controllers built in a test's own process, as a replica builds them."""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Any

from profiling.manifest import ManifestEntry
from profiling.session import BackendFactory, ProfileSession
from profiling.store import TraceStore
from serve_app.engines.controller import SessionFactory


def replica_sessions(store: TraceStore, exporter: Executor, replica_id: str, **identity: Any) -> SessionFactory:
    """The session factory a replica hands its engine controller: the rollout entries of
    `replica_id` (with `identity`'s other fields, e.g. node_id) in `store`."""

    def session(backend_factory: BackendFactory) -> ProfileSession:
        return ProfileSession(
            store=store,
            entry_identity=ManifestEntry(role="rollout", replica_id=replica_id, **identity),
            exporter=exporter,
            backend_factory=backend_factory,
        )

    return session
