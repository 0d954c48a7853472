"""Trace collection through Ray, for clusters whose nodes share no filesystem
(`trace_collection: ray`).

Each replica records into a directory on its own node (`<node_dir>/node-<node id>/traces/`,
the save_path layout) and ships every file it writes there to the `TraceCollector`, one actor on the
ingress's node that writes them under the one `save_path` the manifests name. A replica's local
copies are deleted once shipped, so nothing is left stranded on a node; a file that could not be
shipped stays where it was and the entry's error says where.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from profiling.manifest import ManifestEntry, StepManifest
from profiling.store import ENTRY_FILE, TraceStore, atomic_write_text

CHUNK_BYTES = 16 * 2**20
"""Files travel in pieces of this size, so neither side holds a whole large trace in memory."""
LOOKUP_TIMEOUT_S = 60.0
"""How long a replica waits for the ingress to have created the collector."""


def collector_name(app_name: str) -> str:
    return f"rollout-profiler-trace-collector-{app_name}"


def node_local_dir(node_dir: str, node_id: str) -> Path:
    """This node's own directory (the node id keeps nodes apart when they do share a disk)."""
    return Path(node_dir) / f"node-{node_id[:16]}"


class TraceCollectorLogic:
    """Writes shipped trace files under save_path, on the node that owns it (the actor's body)."""

    def __init__(self, save_path: str):
        self._store = TraceStore(save_path)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def write_chunk(self, step: int, relative: str, data: bytes, offset: int, last: bool) -> None:
        """Write bytes at `offset` of `relative` (a path inside step `step`'s directory); the
        file appears under its name only once its last chunk is written."""
        target = self._target(step, relative)
        part = target.with_name(f".{target.name}.part")
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(part, "r+b" if offset else "wb") as f:
            f.seek(offset)
            f.write(data)
        if last:
            part.replace(target)

    def write_entry(self, step: int, entry_json: str) -> None:
        entry = ManifestEntry.model_validate_json(entry_json)
        atomic_write_text(self._store.entry_dir(step, entry) / ENTRY_FILE, entry_json)

    def refresh_manifest(self, step: int) -> str:
        return self._store.refresh_manifest(step).model_dump_json()

    def _target(self, step: int, relative: str) -> Path:
        step_dir = self._store.step_dir(step)
        target = (step_dir / relative).resolve()
        if not target.is_relative_to(step_dir / "rollout"):
            raise ValueError(f"refusing to write {relative!r} outside step {step}'s rollout directory")
        return target


TraceCollector = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=3)(TraceCollectorLogic)


def create_collector(app_name: str, save_path: str) -> Any:  # Ray types a new actor as "handle or class"
    """The app's collector, pinned to the calling process's node (the one that holds save_path)."""
    here = ray.get_runtime_context().get_node_id()
    return TraceCollector.options(
        name=collector_name(app_name),
        namespace="serve",
        get_if_exists=True,
        lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
    ).remote(save_path)


class ShippingTraceStore(TraceStore):
    """A replica's store on its own node: every entry it writes is shipped to the collector, and
    with a finished entry its trace files; shipped files are deleted here."""

    def __init__(self, local_root: Path, app_name: str):
        super().__init__(local_root)
        self._app_name = app_name
        self._collector: ray.actor.ActorHandle | None = None

    def write_entry(self, step: int, entry: ManifestEntry) -> None:
        super().write_entry(step, entry)
        if entry.exporting:  # recording: only the entry, so save_path shows this replica at work
            self._call("write_entry", step, entry.model_dump_json(indent=2))
            return
        entry_dir = self.entry_dir(step, entry)
        try:
            for path in sorted(p for p in entry_dir.iterdir() if p.is_file() and p.name != ENTRY_FILE):
                self._ship(step, path)
            self._call("write_entry", step, entry.model_dump_json(indent=2))
        except Exception as e:
            raise OSError(
                f"could not ship step {step}'s trace to the collector on the save_path node "
                f"({e}); the files are kept on node {entry.node_id} under {entry_dir}"
            ) from e
        # Only this replica's directory: the step's own may be in use by another replica here.
        shutil.rmtree(entry_dir, ignore_errors=True)

    def refresh_manifest(self, step: int) -> StepManifest:
        return StepManifest.model_validate_json(self._call("refresh_manifest", step))

    def _ship(self, step: int, path: Path) -> None:
        relative = str(path.relative_to(self.step_dir(step)))
        size = path.stat().st_size
        with open(path, "rb") as f:
            offset = 0
            while True:
                data = f.read(CHUNK_BYTES)
                last = offset + len(data) >= size
                self._call("write_chunk", step, relative, data, offset, last)
                offset += len(data)
                if last:
                    return

    def _call(self, method: str, *args: object) -> Any:
        return ray.get(getattr(self._lookup(), method).remote(*args))

    def _lookup(self) -> ray.actor.ActorHandle:
        if self._collector is None:
            deadline = time.monotonic() + LOOKUP_TIMEOUT_S
            while True:
                try:
                    self._collector = ray.get_actor(collector_name(self._app_name), namespace="serve")
                    break
                except ValueError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"no trace collector for app {self._app_name!r} after {LOOKUP_TIMEOUT_S:.0f}s: "
                            "the ingress creates it at start-up (trace_collection: ray)"
                        ) from None
                    time.sleep(0.5)
        return self._collector
