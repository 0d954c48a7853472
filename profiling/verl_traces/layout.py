"""What verl's own profilers leave in `global_profiler.save_path` (verl 0.9.1), read from the
names alone (docs/analysis.md#verl):

* **trainer traces**, flat in save_path, named by `verl/utils/profiler/torch_profile.py`
  (`build_trace_basename` and the trace handler of `get_torch_profiler`):
  `[<prefix>_][<role>_][step<S>_]rank<r>[-of-<W>][_tp..-pp..-dp..-cp..]_pid<pid>_<YYYYmmddHHMMSSmmm>`
  `[_mb<a>[-<b>]|_part<i>].json.gz`: the worker's role (`save_file_prefix`), the profiling scope
  (`train` for a continuous window, the stage in discrete mode), verl's step S (`global_steps`),
  the rank and the rest; every label is sanitised to `[0-9A-Za-z.=+-]`, so `_` separates parts;
* **rollout traces**, written by the engine's own profiler into
  `<save_path>/agent_loop_rollout_replica_<r>/` (`rollout_trace_dir`, handed to vLLM as
  `torch_profiler_dir` by `build_vllm_profiler_args` and to SGLang as `output_dir` by
  `build_sglang_profiler_args`), or moved up into save_path by `relocate_rollout_traces` as
  `rollout-replica<r>[-globalrank<g>]_<engine's name>`: one file per engine worker per start/stop
  window, no step and no weight version in the name (vLLM's `tensorboard_trace_handler`:
  `<worker>.<time>.pt.trace.json.gz`; SGLang's `<profile_id>-TP-<tp>.trace.json.gz`);
* **other tools' output**: nsys reports moved in by verl's `relocate_results`
  (`[<prefix>_]<host>_worker_process_<pid>[.<n>].nsys-rep`), torch_npu's `*_ascend_pt`
  directories (under `[<step>/][<role>/]`), vLLM's op table (`<worker>.profiler_out.txt`,
  rewritten at every stop). They are recognised and listed, not merged.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from profiling.analysis.events import is_trace_name
from profiling.verl_traces.clocks import CLOCKS_FILE

ROLLOUT_DIR = re.compile(r"^agent_loop_rollout_replica_(\d+)$")
"""`rollout_trace_dir`'s directory of replica r."""
_RELOCATED = re.compile(r"^rollout-replica(\d+)(?:-globalrank(\d+))?_(.+)$")
_TRAINER = re.compile(
    r"^(?P<labels>(?:[^_]+_){0,2}?)"
    r"(?:step(?P<step>\d+)_)?"
    r"rank(?P<rank>\d+)(?:-of-(?P<world_size>\d+))?"
    r"(?:_(?P<parallel>(?:tp|pp|dp|cp)\d+(?:-(?:tp|pp|dp|cp)\d+)*))?"
    r"_pid(?P<pid>\d+)_(?P<written>\d{17})"
    r"(?:_mb(?P<mb_first>\d+)(?:-(?P<mb_last>\d+))?|_part(?P<part>\d+))?"
    r"\.json\.gz$"
)
_SGLANG = re.compile(r"-TP-\d+\.trace\.json(\.gz)?$")
_VLLM = re.compile(r"\.pt\.trace\.json(\.gz)?$")
_NPU_STEP = re.compile(r"^(?:step)?(\d+)$")
_OUTPUTS = re.compile(r"^(step_\d+(\.replaced-[\w-]+)?|\.step_\d+.*|index\.html|\..*\.lock)$")
"""This project's own outputs in a save_path (steps, the report index, lock files)."""

Engine = Literal["vllm", "sglang"]
FORWARD_RANGE: dict[Engine, str] = {"vllm": "execute_", "sglang": "step["}
"""Each engine's range around one engine step in its own traces: vLLM's worker annotates every
iteration `execute_...` while it profiles (`Worker.annotate_profile`), SGLang's model runner
`step[<mode> bs=<n>...]` (docs/sglang.md#forward-steps-and-weight-versions)."""


class TrainerTrace(BaseModel):
    """One trainer trace file, as verl named it."""

    model_config = ConfigDict(frozen=True)

    name: str
    """The file's name in save_path."""
    labels: tuple[str, ...]
    """What precedes the step in the name, in verl's order: the worker's role
    (`save_file_prefix`, e.g. `actor-rollout`) and the profiling scope (`train`, or the stage in
    discrete mode), those that were given."""
    step: int | None
    """verl's step (`profile_step`: the trainer's `global_steps`); None: started without one."""
    rank: int
    world_size: int | None = None
    parallel: dict[str, int] = {}
    """Megatron's tp/pp/dp/cp ranks, where the name carries them."""
    pid: int
    written: str
    """When the profiler was made, `YYYYmmddHHMMSSmmm` in the writer's local time."""
    part: int | None = None
    """A later file of one profiler (`_part<i>`: a schedule fired more than once)."""
    mini_batches: tuple[int, int] | None = None
    """The update mini-batches a scheduled stage's file holds (`_mb<a>-<b>`)."""


class RolloutTrace(BaseModel):
    """One rollout trace file: one engine worker's recording of one start/stop window."""

    model_config = ConfigDict(frozen=True)

    rel: str
    """Its path relative to save_path."""
    replica: int
    global_rank: int | None = None
    """The GPU's global rank, where `relocate_rollout_traces` put it in the name."""
    engine: Engine

    @property
    def name(self) -> str:
        return Path(self.rel).name


ArtifactKind = Literal["nsys", "npu", "vllm_op_table", "trace", "clock_records", "unknown"]


class Artifact(BaseModel):
    """Something in save_path that is not merged: another tool's output, or not recognised."""

    model_config = ConfigDict(frozen=True)

    rel: str
    kind: ArtifactKind
    verl_step: int | None = None
    """verl's step, where its path names one."""
    why: str
    """What it is and why it is not merged."""


class VerlLayout(BaseModel):
    """Everything recognised in one save_path."""

    root: str
    trainer: list[TrainerTrace]
    rollout: list[RolloutTrace]
    other: list[Artifact]

    @property
    def empty(self) -> bool:
        """No trace of verl's at all."""
        return not self.trainer and not self.rollout


def parse_trainer_name(name: str) -> TrainerTrace | None:
    """The parts of a trainer trace's name (None: not a name verl's torch profiler writes)."""
    m = _TRAINER.match(name)
    if m is None:
        return None
    parallel = m["parallel"]
    mb_first = m["mb_first"]
    return TrainerTrace(
        name=name,
        labels=tuple(p for p in m["labels"].split("_") if p),
        step=None if m["step"] is None else int(m["step"]),
        rank=int(m["rank"]),
        world_size=None if m["world_size"] is None else int(m["world_size"]),
        parallel={p[:2]: int(p[2:]) for p in parallel.split("-")} if parallel else {},
        pid=int(m["pid"]),
        written=m["written"],
        part=None if m["part"] is None else int(m["part"]),
        mini_batches=None if mb_first is None else (int(mb_first), int(m["mb_last"] or mb_first)),
    )


def engine_of(name: str) -> Engine | None:
    """Which engine's profiler names a trace so (None: neither vLLM's nor SGLang's)."""
    if _SGLANG.search(name):
        return "sglang"
    if _VLLM.search(name):
        return "vllm"
    return None


def step_of(verl_step: int, sync_every: int) -> int:
    """This project's step (the version the trainer step produces) of verl's trainer step S, when
    `sync_every` (verl's `trigger_parameter_sync_step`) trainer steps make one parameter version:
    version k is made by steps (k-1)·T+1 .. k·T (docs/design.md#step-semantics)."""
    if verl_step < 1 or sync_every < 1:
        raise ValueError(f"verl step {verl_step} and trigger_parameter_sync_step {sync_every} must be at least 1")
    return (verl_step - 1) // sync_every + 1


def scan_layout(save_path: Path, exclude: Path | None = None) -> VerlLayout:
    """Read save_path's names (no file is opened): verl's trainer and rollout traces, and the
    rest. This project's own outputs there (`step_<k>/`, `index.html`, lock files, and the
    directory holding `exclude`, an output directory inside save_path) are left out."""
    trainer: list[TrainerTrace] = []
    rollout: list[RolloutTrace] = []
    other: list[Artifact] = []
    for path in sorted(save_path.iterdir()):
        name = path.name
        if _OUTPUTS.match(name) or (exclude is not None and exclude.is_relative_to(path)):
            continue
        if path.is_dir():
            if m := ROLLOUT_DIR.match(name):
                _replica_dir(path, save_path, int(m.group(1)), rollout, other)
            else:
                other += _npu_dirs(path, save_path)
            continue
        if (t := parse_trainer_name(name)) is not None:
            trainer.append(t)
        elif m := _RELOCATED.match(name):
            _rollout_file(path, save_path, int(m.group(1)), m.group(2), m.group(3), rollout, other)
        else:
            other.append(_other_file(name))
    return VerlLayout(root=str(save_path), trainer=trainer, rollout=rollout, other=other)


def _replica_dir(path: Path, root: Path, replica: int, rollout: list[RolloutTrace], other: list[Artifact]) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            _rollout_file(f, root, replica, None, f.name, rollout, other)


def _rollout_file(
    path: Path,
    root: Path,
    replica: int,
    global_rank: str | None,
    engine_name: str,
    rollout: list[RolloutTrace],
    other: list[Artifact],
) -> None:
    rel = str(path.relative_to(root))
    engine = engine_of(engine_name)
    if engine is not None:
        rank = None if global_rank is None else int(global_rank)
        rollout.append(RolloutTrace(rel=rel, replica=replica, global_rank=rank, engine=engine))
    elif engine_name.endswith(".profiler_out.txt"):
        other.append(
            Artifact(
                rel=rel,
                kind="vllm_op_table",
                why=f"vLLM's op table of replica {replica}, rewritten at every stop (its last window only): not merged",
            )
        )
    elif is_trace_name(engine_name):
        other.append(
            Artifact(
                rel=rel,
                kind="trace",
                why=f"a JSON file of replica {replica} not named as vLLM's or SGLang's window traces "
                "(e.g. SGLang's CUDA-graph capture): not merged",
            )
        )
    else:
        other.append(Artifact(rel=rel, kind="unknown", why=f"not a trace of replica {replica}: not merged"))


def _npu_dirs(path: Path, root: Path) -> list[Artifact]:
    """torch_npu's `*_ascend_pt` directories at or under `path` (verl's NPU profiler writes them
    under `[<step>/][<role>/]`), or `path` as not recognised."""
    found = [path] if path.name.endswith("_ascend_pt") else [p for p in sorted(path.rglob("*_ascend_pt")) if p.is_dir()]
    if not found:
        return [
            Artifact(rel=path.name + "/", kind="unknown", why="a directory verl's profilers do not write: not read")
        ]
    out = []
    for d in found:
        parts = d.relative_to(root).parts[:-1]
        steps = [int(m.group(1)) for p in parts if (m := _NPU_STEP.match(p))]
        out.append(
            Artifact(
                rel=str(d.relative_to(root)) + "/",
                kind="npu",
                verl_step=steps[0] if steps else None,
                why="torch_npu's profiler output (msprof data, not a Chrome trace of its own): not merged",
            )
        )
    return out


def _other_file(name: str) -> Artifact:
    if name.endswith((".nsys-rep", ".qdstrm")):
        return Artifact(rel=name, kind="nsys", why="an Nsight Systems report (no step in its name): not merged")
    if name == CLOCKS_FILE:
        return Artifact(
            rel=name, kind="clock_records", why="the trainer ranks' clocks the plugin recorded: read, not merged"
        )
    return Artifact(rel=name, kind="unknown", why="not a name verl's profilers write: not read")
