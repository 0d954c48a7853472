"""The per-step manifest (DESIGN.md §5) and the per-producer records it is assembled from.

Each producer (a rollout replica, a trainer rank) writes its own `entry.json` in its own
directory; the controller writes `session.json`. `manifest.json` is derived from those files,
so no two processes ever write the same file concurrently.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from profiling.config import ProfileOptions

Role = Literal["rollout", "trainer"]
ManifestStatus = Literal["recording", "exporting", "complete", "partial"]


class SyncCost(BaseModel):
    """Critical-path seconds of the weight sync that ended a profiled step."""

    stop_s: float | None = None
    update_s: float | None = None
    start_s: float | None = None

    @property
    def total_s(self) -> float:
        return sum(x for x in (self.stop_s, self.update_s, self.start_s) if x is not None)


class ManifestEntry(BaseModel):
    """One process's contribution to a step: its trace files and what they hold."""

    role: Role
    replica_id: str | None = None
    rank: int | None = None
    node_id: str | None = None
    pid: int | None = None
    status: Literal["ok", "error"] = "ok"
    exporting: bool = False
    """True while the trace is still being written in the background."""
    files: list[str] = Field(default_factory=list, description="Paths relative to the step dir.")
    bytes: int = 0
    weight_version: int | None = None
    """Weight version the recording started with (k-1 for step k)."""
    weight_versions: list[int] = Field(default_factory=list)
    """Every weight version seen while recording (more than one in a continuous window)."""
    started_at: float | None = None
    stopped_at: float | None = None
    forward_steps: int = 0
    late_start: bool = False
    """The process joined after the step had started (replica started or restarted)."""
    auto_stopped: Literal["max_forward_steps", "max_duration_s"] | None = None
    finalize_s: float | None = None
    """Seconds the profiler's own stop (finalize) took, off the acknowledged path."""
    export_s: float | None = None
    sync: SyncCost | None = None
    """Trainer entries: the critical-path cost of the sync that ended this step."""
    error: str | None = None

    @property
    def key(self) -> str:
        return f"{self.role}/{self.replica_id if self.role == 'rollout' else f'rank_{self.rank}'}"


class SessionRecord(BaseModel):
    """Step-level facts the controller knows: the window, options, who took part, who failed."""

    step: int
    steps: list[int]
    tool: str
    tag: str | None = None
    options: ProfileOptions
    started_at: float
    stopped_at: float | None = None
    replicas: list[str] = Field(default_factory=list, description="Replicas that started it.")
    failures: dict[str, str] = Field(
        default_factory=dict, description="replica_id -> why it has no (complete) trace."
    )
    auto_stopped: str | None = None


class StepManifest(BaseModel):
    """`step_<k>/manifest.json`."""

    step: int
    steps: list[int]
    tool: str
    tag: str | None = None
    status: ManifestStatus
    options: ProfileOptions | None = None
    started_at: float | None = None
    stopped_at: float | None = None
    auto_stopped: str | None = None
    """Set when the controller stopped the step itself (e.g. `max_duration_s`)."""
    sync: SyncCost | None = None
    entries: list[ManifestEntry] = Field(default_factory=list)

    @classmethod
    def assemble(cls, step: int, session: SessionRecord | None, entries: list[ManifestEntry]) -> StepManifest:
        """Derive the manifest from the controller's record and the producers' entries."""
        by_key = {e.key: e for e in entries}
        if session is not None:
            for rid, why in session.failures.items():
                known = by_key.get(f"rollout/{rid}")
                if known is None or known.exporting:
                    base = known or ManifestEntry(role="rollout", replica_id=rid)
                    by_key[base.key] = base.model_copy(
                        update={"status": "error", "exporting": False, "error": why}
                    )
        merged = sorted(by_key.values(), key=lambda e: e.key)
        if session is not None and session.stopped_at is None:
            status: ManifestStatus = "recording"
        elif any(e.exporting for e in merged):
            status = "exporting"
        elif any(e.status == "error" for e in merged) or not merged:
            status = "partial"
        else:
            status = "complete"
        sync = next((e.sync for e in merged if e.sync is not None), None)
        return cls(
            step=step,
            steps=session.steps if session else [step],
            tool=session.tool if session else "torch",
            tag=session.tag if session else None,
            status=status,
            options=session.options if session else None,
            started_at=session.started_at if session else None,
            stopped_at=session.stopped_at if session else None,
            auto_stopped=session.auto_stopped if session else None,
            sync=sync,
            entries=merged,
        )
