"""The per-step manifest (docs/design.md#manifest) and the per-producer records it is assembled from.

Each producer (a rollout replica, a trainer rank) writes its own `entry.record` in its own
directory; the controller writes `session.json`. `manifest.json` is derived from those files,
so no two processes ever write the same file concurrently.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, computed_field, model_validator

from profiling.config import ProfileOptions
from profiling.markers import FORWARD_STEP
from profiling.step_stats import RequestStats, Staleness
from profiling.weight_source import WeightSource, read_old_spelling

Role = Literal["rollout", "trainer"]
ManifestStatus = Literal["recording", "exporting", "complete", "partial"]
Driver = Literal["server", "client"]
"""Who started a window: `client`, a call of /profile/start (this project's trainer client, or
any other); `server`, the app's own `global_profiler` schedule at a version change it saw."""
AutoStop = Literal["max_forward_steps", "max_duration_s", "max_trace_mb"]
"""Why a window stopped recording before its stop."""


Transfer = Annotated[
    Literal[WeightSource.PATH, WeightSource.OBJECT_STORE, WeightSource.COLLECTIVE, WeightSource.EXTERNAL],
    BeforeValidator(read_old_spelling),
]
"""How a sync's weights reached the replicas (docs/trainer.md#several-ranks lists the modes), in
the words of `WeightSource`: path, a safetensors path through POST /weights/update (`file` in
manifests written before, read as path); object_store, a state dict through Ray's object store
(InClusterWeights); collective, a state dict broadcast to the replicas over a process group
(CollectiveWeights); external, the trainer's own transfer (`ExternalPublisher`), the app told
the version afterwards."""


class SyncCost(BaseModel):
    """Critical-path seconds of the weight sync that ended a profiled step."""

    stop_s: float | None = None
    """The profiling stop (with `pause`) before the update (None: nothing to stop)."""
    update_s: float | None = None
    """The whole update, from its call to its answer (the transfer and the replicas' load
    included)."""
    start_s: float | None = None
    """The profiling start after the update (None: nothing to start)."""
    began_at: float | None = None
    """Unix seconds when the sync's first control call was sent; the calls then ran back to back
    (stop, update_weights, start), so the durations place each of them on the timeline."""
    transfer: Transfer | None = None
    """How the weights travelled (None: recorded before the modes were told apart)."""
    publish_s: float | None = None
    """The trainer's publish before the sync's calls: writing the file, or gathering the state
    dict (every rank's gather included). Off the rollout's critical path: replicas still generate
    meanwhile; not part of `total_s`."""
    gather_s: float | None = None
    """Within `publish_s`, on the publishing rank: gathering the full state dict from the ranks'
    shards (Megatron: the tensor-parallel all-gathers and the pipeline stages' tensors; None: not
    measured apart)."""
    transfer_s: float | None = None
    """Moving the bytes, within `update_s`: the app's answer (`transfer_s`, the slowest replica's
    fetch or receive), or for `external` the trainer's own update function (None: not reported)."""
    load_s: float | None = None
    """The slowest replica's load of the new weights into its engine, within `update_s` (the app's
    answer; None: not reported)."""

    @property
    def total_s(self) -> float:
        """The sync's critical path: stop + update + start."""
        return sum(x for x in (self.stop_s, self.update_s, self.start_s) if x is not None)


class ClockSample(BaseModel):
    """A range the profiler recorded into the trace (`marker`), bracketed by wall-clock readings
    (`time.time_ns()`) taken just before it opened and just after it closed. The range's own
    timestamps in the trace are the profiler's clock at that instant, so comparing the two
    measures how the trace's clock maps to wall-clock time."""

    marker: str
    wall_before_ns: int
    wall_after_ns: int


class ClockSync(BaseModel):
    """Clock samples taken when recording started and when it stopped (None: not taken)."""

    start: ClockSample | None = None
    stop: ClockSample | None = None


class ClockOffset(BaseModel):
    """One process's wall clock against the app's reference clock (its controller's), measured
    NTP-style: the reference reads its clock, asks the process for its `time.time_ns()`, and reads
    its clock again; the exchange with the shortest round trip counts. Processes on other nodes
    (or with a skewed clock) need it: the in-process clock samples only map a trace to its own
    process's wall clock."""

    offset_ns: int
    """Added to this process's wall clock to get the reference clock (the midpoint of the
    reference's readings minus the process's reading)."""
    bound_ns: int
    """The offset's error is at most this: half the shortest round trip."""
    samples: int = 1
    """Exchanges made; the one with the shortest round trip gave offset and bound."""

    @property
    def applied_ns(self) -> int:
        """The offset the timeline applies: the measured one where it is larger than its bound,
        else 0. An offset within its bound of zero cannot be told from clocks that agree (one
        machine, or NTP-synced hosts), and moving a trace by it would only add error."""
        return self.offset_ns if abs(self.offset_ns) > self.bound_ns else 0

    @property
    def applied_bound_ns(self) -> int:
        """The error of `applied_ns` at most: the bound where the offset is applied, else how far
        the true offset may lie from zero (the measured offset plus its bound)."""
        return self.bound_ns if self.applied_ns else abs(self.offset_ns) + self.bound_ns


class TraceDialect(BaseModel):
    """How an entry's Chrome traces name a forward pass and where its weight version is written,
    which the analysis reads them by (docs/analysis.md#verify). The profiler that recorded the
    entry sets it; the default is this project's own markers (`profiling.markers`). An engine
    whose own profiler writes the trace names its ranges its own way."""

    model_config = ConfigDict(frozen=True)

    forward_range: str = FORWARD_STEP
    """Name prefix of the range around one forward pass."""
    version_in: Literal["marker", "file_name", "window"] = "marker"
    """marker: every forward range is a forward-step marker, naming its step and weight version;
    file_name: forward ranges carry no version, each trace file holds passes on one version, which
    its name carries (`file_version`); window: neither the ranges nor the file names carry a
    version (an engine's own profiler driven by another framework, e.g. vLLM's under verl): the
    recording's place in time assigned it to its step (the entry's `window_match`)."""
    file_version: str | None = None
    """With `file_name`: a regular expression whose first group, at its last match in a trace
    file's name, is the weight version of the file's passes."""
    rank_separator: str | None = None
    """Trace files whose names agree up to this text are ranks of one recording, which run the
    same passes (None: each file is a recording of its own)."""

    @model_validator(mode="after")
    def _consistent(self) -> TraceDialect:
        if self.version_in == "marker" and self.forward_range != FORWARD_STEP:
            raise ValueError(f"a forward range that carries its weight version is a {FORWARD_STEP!r} marker")
        if self.version_in == "file_name" and (self.file_version is None or re.compile(self.file_version).groups < 1):
            raise ValueError("version_in 'file_name' needs file_version, a regular expression with a group")
        if self.version_in == "window" and self.file_version is not None:
            raise ValueError("version_in 'window' takes no file_version: the file names carry no version")
        return self

    def file_version_of(self, name: str) -> int | None:
        """The weight version a trace file's name carries (None: this dialect puts none there,
        or the name does not carry one)."""
        if self.file_version is None:
            return None
        found = [m.group(1) for m in re.finditer(self.file_version, name)]
        return int(found[-1]) if found else None

    def recording_of(self, name: str) -> str:
        """The recording a trace file belongs to: its name up to `rank_separator`."""
        return name.split(self.rank_separator)[0] if self.rank_separator else name


class WindowMatch(BaseModel):
    """How a recording whose traces carry no weight version (`TraceDialect.version_in` window) was
    assigned to its step: by where it stopped in time (docs/analysis.md#verl). In verl, rollout
    step k's window opens after the sync that published version k-1 and closes before the sync
    that publishes version k, which runs inside the trainer's window of step k; so a recording
    belongs to the step whose trainer window holds its stop (the entry's `stopped_at`)."""

    trainer_started_at: float
    """Unix seconds: the first event of the step's trainer traces (every rank, every file)."""
    trainer_stopped_at: float
    """Unix seconds: the last event of the step's trainer traces."""
    margin_s: float
    """How far the recording's stop lies inside the trainer window: its distance to the nearer
    edge. The assignment holds as long as the clocks of the trainer's and the rollout's hosts
    disagree by less than this."""
    trainer_steps: list[int]
    """The trainer's own step numbers (verl's `step<S>` in the file names) that make the window."""
    hosts: list[str] = Field(default_factory=list)
    """The hosts the traces of the recording and of the trainer window name (Kineto's
    `host_name`; empty: none named)."""
    clocks: str
    """What the match assumes of the clocks, in words: one host's wall clock, or several hosts'
    clocks agreeing to well within `margin_s` (not measured: no clock exchange ran)."""


class ParallelRank(BaseModel):
    """A trainer rank's place in Megatron's grid (docs/trainer.md#megatron): its tensor-,
    pipeline- and data-parallel ranks, and the sizes of those groups."""

    tp: int = Field(ge=0)
    pp: int = Field(ge=0)
    dp: int = Field(ge=0)
    tp_size: int = Field(ge=1)
    pp_size: int = Field(ge=1)
    dp_size: int = Field(ge=1)

    @model_validator(mode="after")
    def _ranks_within_sizes(self) -> ParallelRank:
        for axis in ("tp", "pp", "dp"):
            rank, size = getattr(self, axis), getattr(self, f"{axis}_size")
            if rank >= size:
                raise ValueError(f"{axis} rank {rank} is not below {axis}_size {size}")
        return self

    @property
    def label(self) -> str:
        """`tp1 pp0` (and `dp<r>` with several data-parallel replicas)."""
        return f"tp{self.tp} pp{self.pp}" + (f" dp{self.dp}" if self.dp_size > 1 else "")

    @property
    def last_stage(self) -> bool:
        return self.pp == self.pp_size - 1


class ManifestEntry(BaseModel):
    """One process's contribution to a step: its trace files and what they hold."""

    role: Role
    replica_id: str | None = None
    rank: int | None = None
    parallel: ParallelRank | None = None
    """Trainer entries of the Megatron backend: the rank's tensor-, pipeline- and data-parallel
    ranks (None: a backend without them)."""
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
    """Forward steps recorded in the trace (engine iterations on a replica)."""
    forward_steps_in_window: int | None = Field(None, ge=0)
    """Forward steps the process ran from the window's start to its stop, recorded or not: more
    than `forward_steps` when a cap (`auto_stopped`) ended the recording first. Set at the stop
    (None: not counted, as by an engine whose own profiler counts only what it recorded, or
    while the window is still open)."""
    trace_dialect: TraceDialect = TraceDialect()
    """How the entry's traces name forward passes and carry their weight versions (entries written
    before the field: this project's markers)."""
    late_start: bool = False
    """The process joined after the step had started (replica started or restarted)."""
    auto_stopped: AutoStop | None = None
    """Why the window stopped recording before its stop: a cap, or `max_trace_mb` when the steps
    recorded so far were estimated to fill the trace budget."""
    trace_mb: float | None = None
    """The trace's JSON as exported, before compression and before any cut, in MiB (None: not
    measured, e.g. an engine-owned trace)."""
    truncated: bool = False
    """The trace exceeded `max_trace_mb` and was cut: it keeps the first `forward_steps_kept` of
    the `forward_steps` recorded; every event from the next forward step's start on was dropped."""
    forward_steps_kept: int | None = None
    """Forward steps left in a truncated trace (None: not truncated)."""
    over_budget: bool = False
    """The trace exceeded `max_trace_mb` and was kept whole (an engine-owned trace, which is not
    cut): a viewer may fail to open it."""
    finalize_s: float | None = None
    """Seconds the profiler's own stop (finalize) took, off the acknowledged path."""
    export_s: float | None = None
    sync: SyncCost | None = None
    """Trainer entries: the critical-path cost of the sync that ended this step."""
    clock: ClockSync | None = None
    """Clock samples for aligning this process's trace with the others (None: backend has none)."""
    clock_offset: ClockOffset | None = None
    """This process's wall clock against the app's reference clock (None: not measured)."""
    clock_unmeasured: str | None = None
    """Why `clock_offset` is None and what the timeline assumes instead, in words (entries built
    from another framework's profiler output, which ran no clock exchange: docs/analysis.md#verl;
    None: an entry of this project's own producers, for which a missing offset is a fault)."""
    window_match: WindowMatch | None = None
    """Entries whose traces carry no weight version (`trace_dialect.version_in` window): the time
    match that assigned the recording to this step and so its `weight_version`."""
    requests: RequestStats | None = None
    """Rollout entries: requests served and time generating, held and idle in the window."""
    staleness: Staleness | None = None
    """Trainer entries: staleness of the samples consumed by the step's mini-batches."""
    sync_held_s: float | None = None
    """Rollout entries: seconds the replica held admission for the sync that ended the step, from
    its stop with `pause` to the start (or resuming update, or hold expiry) that released it; the
    profiler's finalize runs within it. Added when the hold ends (None: the stop did not pause)."""
    forward_steps_outside: int | None = None
    """Rollout entries of a window on one weight version: forward passes the engine ran on that
    version (`weight_version`) outside the window, counted when the engine loaded the next version
    (None: not counted: that version is still served, the window spans versions, or the engine
    does not count its passes). A step profiled with pause has 0 (docs/design.md#exact-attribution)."""
    error: str | None = None

    @model_validator(mode="after")
    def _counts_consistent(self) -> ManifestEntry:
        if self.forward_steps_in_window is not None and self.forward_steps_in_window < self.forward_steps:
            raise ValueError(
                f"forward_steps_in_window {self.forward_steps_in_window} is below the {self.forward_steps} "
                "forward steps recorded: the window ran at least the steps its trace holds"
            )
        return self

    @property
    def trainer_name(self) -> str:
        """How the timeline and the reports name a trainer rank: `trainer rank 0`, or with
        Megatron's coordinates `trainer tp1 pp0 (rank 1)`."""
        if self.parallel is None:
            return f"trainer rank {self.rank or 0}"
        return f"trainer {self.parallel.label} (rank {self.rank or 0})"

    @property
    def key(self) -> str:
        return f"{self.role}/{self.replica_id if self.role == 'rollout' else f'rank_{self.rank}'}"

    @computed_field  # type: ignore[prop-decorator]
    @property
    def kept(self) -> str | None:
        """In plain words, how much of the window the trace holds when it is not all of it (a
        cap stopped the recording early, or the trace was cut to its budget); None: all of it."""
        kept = self.forward_steps_kept if self.truncated and self.forward_steps_kept is not None else self.forward_steps
        reasons, limits = [], []
        if self.auto_stopped is not None:
            reasons.append(f"{self.auto_stopped} stopped the recording")
            limits.append(self.auto_stopped)
        if self.truncated:
            reasons.append("the trace was cut to max_trace_mb")
            limits.append("max_trace_mb")
        if not reasons:
            return None
        why = " and ".join(reasons)
        ran = self.forward_steps_in_window
        if ran is None and self.auto_stopped is not None:
            return f"kept {kept:,} forward steps: {why}; the steps run after it are not counted"
        total = self.forward_steps if ran is None else ran
        if kept >= total:
            return None
        fix = " or ".join(dict.fromkeys(limits))  # max_trace_mb may be both
        return f"kept {kept:,} of {total:,} forward steps: {why}; raise {fix} (null: no limit) to keep them all"


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
    failures: dict[str, str] = Field(default_factory=dict, description="replica_id -> why it has no (complete) trace.")
    auto_stopped: str | None = None
    driver: Driver = "client"
    clock_offsets: dict[str, ClockOffset] = Field(
        default_factory=dict, description="replica_id -> its wall clock against the controller's."
    )


class TrainerRecord(BaseModel):
    """`step_<k>/trainer/ranks.record`: the trainer ranks a window selected, and those that died.

    The driving rank writes `ranks` when it starts the window; whoever sees a rank die (the main
    job's launcher) adds it to `failures`. A selected rank without a finished entry keeps the
    manifest `exporting`, until it writes one or its failure is recorded (then `partial`)."""

    ranks: list[int] = Field(default_factory=list)
    """The ranks that record the window (`profiler.ranks`, or all with `profiler.all_ranks`)."""
    world_size: int | None = None
    """Trainer ranks in the job (None: not known to the writer)."""
    driver_rank: int | None = None
    """The rank that drives the app (its profiling and weight calls)."""
    failures: dict[int, str] = Field(default_factory=dict)
    """rank -> why it has no (complete) trace: it died, naming how."""


class ProcessAlignment(BaseModel):
    """How one trace file's timestamps were mapped to wall-clock time in the merged timeline."""

    key: str
    """The entry (`rollout/<replica_id>` or `trainer/rank_<r>`)."""
    file: str
    source: Literal["clock_sync", "baseTimeNanoseconds", "started_at", "epoch"]
    """clock_sync: measured from the entry's clock samples; baseTimeNanoseconds: the trace's
    `ts + baseTimeNanoseconds` taken as wall clock (not measured); started_at: a trace with no
    absolute time, its first event placed at the entry's started_at; epoch: `ts` taken as unix
    microseconds."""
    offset_ns: int = 0
    """Added to the trace's absolute time (`ts` plus `baseTimeNanoseconds`) to get the reference
    clock: the in-process offset measured from the markers plus the entry's
    `clock_offset.applied_ns` (`reference_offset_ns` where it exceeds its bound, else 0)."""
    uncertainty_ns: int | None = None
    """Half the widest wall-clock bracket around a clock marker, less the marker's duration, plus
    `clock_offset.applied_bound_ns`."""
    reference_offset_ns: int = 0
    """The process's wall clock against the app's reference clock (the entry's `clock_offset`;
    0 when not measured)."""
    reference_bound_ns: int | None = None
    """The error bound of `reference_offset_ns` (None: not measured)."""
    drift_ns: int | None = None
    """Offset measured at stop minus offset measured at start (both samples found)."""


class MergeRecord(BaseModel):
    """`step_<k>/merge.json`: the outcome of the last merge of the step's traces."""

    status: Literal["ok", "error"]
    path: str | None = None
    """The merged trace, relative to the step directory."""
    digest: str
    """Digest of the step's records (session + entries) the merge was made from."""
    finished_at: float
    duration_s: float
    bytes_in: int = 0
    bytes_out: int = 0
    events: int = 0
    processes: list[ProcessAlignment] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list, description="'<file>: <why>' per file not merged.")
    error: str | None = None


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
    driver: Driver = "client"
    """Who started the window: `server` when the app's own schedule did (docs/design.md#who-drives)."""
    sync: SyncCost | None = None
    entries: list[ManifestEntry] = Field(default_factory=list)
    merge: MergeRecord | None = None
    """The last merge into `merged.trace.json.gz` (None: never merged)."""

    @classmethod
    def assemble(
        cls,
        step: int,
        session: SessionRecord | None,
        entries: list[ManifestEntry],
        trainer: TrainerRecord | None = None,
    ) -> StepManifest:
        """Derive the manifest from the controller's record, the trainer's ranks record and the
        producers' entries."""
        by_key = {e.key: e for e in entries}
        if trainer is not None:
            _account_trainer_ranks(by_key, trainer)
        if session is not None:
            for rid, why in session.failures.items():
                known = by_key.get(f"rollout/{rid}")
                if known is None or known.exporting:
                    base = known or ManifestEntry(role="rollout", replica_id=rid)
                    by_key[base.key] = base.model_copy(update={"status": "error", "exporting": False, "error": why})
        if session is not None:  # the controller measured the replicas' clocks
            for rid, offset in session.clock_offsets.items():
                known = by_key.get(f"rollout/{rid}")
                if known is not None and known.clock_offset is None:
                    by_key[known.key] = known.model_copy(update={"clock_offset": offset})
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
            driver=session.driver if session else "client",
            sync=sync,
            entries=merged,
        )


def _account_trainer_ranks(by_key: dict[str, ManifestEntry], trainer: TrainerRecord) -> None:
    """A rank that died without a finished entry is an error naming it; a selected rank that has
    written nothing yet is awaited (exporting), so the step does not look complete without it."""
    for rank in sorted({*trainer.ranks, *trainer.failures}):
        key = f"trainer/rank_{rank}"
        known = by_key.get(key)
        why = trainer.failures.get(rank)
        if why is not None and (known is None or known.exporting):
            base = known or ManifestEntry(role="trainer", rank=rank)
            by_key[key] = base.model_copy(update={"status": "error", "exporting": False, "error": why})
        elif known is None:
            by_key[key] = ManifestEntry(role="trainer", rank=rank, exporting=True)
