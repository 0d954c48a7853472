"""`python -m profiling`: drive the app's profiling and analyse recorded steps.

\b
    status --url URL                   the app's profiling state, per replica
    start  --url URL --step K          start profiling step K on every replica
    stop   --url URL --step K          stop step K (traces are exported in the background)
    list DIR                           the steps under a save path
    summarize DIR [--step K]           per-process and cross-replica summaries
    merge DIR [--step K]               step_<k>/merged.trace.json.gz (Perfetto)
    diff DIR --step A --step B         what got slower from step A to step B
    report DIR [--step K]              step_<k>/report.html and index.html
    ranks DIR [--step K]               rebuild step_<k>/ranks/: the step as ranks, for HTA and TensorBoard
    verify DIR [--step K]              check attribution: manifests, files, markers, clocks
    verl [SAVE_PATH]                   verl's own profiler output made into steps (merged, reported)

Exit codes: 0 done; 1 the operation failed (a merge or ranks view failed, the app refused the call, a
replica did not carry it out, or verify found a violation); 2 bad usage (unknown option, no such
directory or step); 3 the app could not be reached. `--json` prints machine-readable output on stdout; messages
and progress bars go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn, TypedDict

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from profiling.analysis.diff import StepDiff, diff_steps
from profiling.analysis.merge import MergeError, merge_step
from profiling.analysis.sources import find_inputs, load_manifest
from profiling.analysis.summary import StepSummary, summarize_step
from profiling.analysis.tool_view import ToolView, ViewError, build_tool_view
from profiling.analysis.trace_span import clock_text, span_text
from profiling.analysis.verify import Finding, VerifyReport, trace_bytes, verify_steps
from profiling.manifest import ManifestStatus, MergeRecord
from profiling.store import MERGED_TRACE, TraceStore

if TYPE_CHECKING:
    from profiling.verl_traces.ingest import IngestReport

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
APP_COMMANDS = "rollout_profiler.app_commands"
"""Entry-point group of the commands that talk to the app (status/start/stop). They live with
the HTTP client in `trainer/` (profiling/ stays free of HTTP) and are added here at start-up."""

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, rich_markup_mode=None)
# Piped output is read by people in logs and by scripts (with --json): tables wide, lines unwrapped.
_WIDTH = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160
out = Console(highlight=False, width=_WIDTH)
err = Console(stderr=True, highlight=False, width=_WIDTH)

Dir = Annotated[Path, typer.Argument(help="A save_path: the directory holding step_<k>/ directories.")]
Steps = Annotated[
    list[int] | None, typer.Option("--step", help="A step (repeat for several; default: every step).")
]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON on stdout (for scripts).")]


def main() -> None:
    """Entry point of `python -m profiling`."""
    app()


def _add_app_commands() -> None:
    for ep in entry_points(group=APP_COMMANDS):
        ep.load()(app)


def _fail(code: int, message: str) -> NoReturn:
    err.print(f"error: {message}", markup=False, soft_wrap=True)
    raise typer.Exit(code)


def _print_json(data: Any) -> None:
    if isinstance(data, BaseModel):
        text = data.model_dump_json(indent=2)
    elif isinstance(data, list) and all(isinstance(d, BaseModel) for d in data):
        text = "[" + ",".join(d.model_dump_json(indent=2) for d in data) + "]"
    else:
        text = json.dumps(data, indent=2)
    out.print(text, markup=False, soft_wrap=True)


def _store(directory: Path) -> TraceStore:
    if not directory.is_dir():
        _fail(
            EXIT_USAGE,
            f"{directory} is not a directory; pass the save_path that holds the step_<k>/ directories",
        )
    return TraceStore(directory)


def _steps(store: TraceStore, steps: list[int] | None) -> list[int]:
    have = store.steps()
    if not have:
        _fail(
            EXIT_USAGE,
            f"no step_<k> directories under {store.root}; is this the save_path of a profiled run?",
        )
    for k in steps or []:
        if k not in have:
            _fail(EXIT_USAGE, f"no step_{k} under {store.root} (steps there: {', '.join(map(str, have))})")
    return list(dict.fromkeys(steps)) if steps else have


@contextmanager
def _byte_progress(
    label: str, store: TraceStore, steps: list[int], quiet: bool
) -> Iterator[Callable[[int], None]]:
    """A bar over the on-disk size of the steps' trace files; yields its advance function."""
    total = 0
    for k in steps:
        inputs, _ = find_inputs(store.step_dir(k), load_manifest(store, k))
        total += sum(i.size for i in inputs)
    columns = (TextColumn(label), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True, disable=quiet or not err.is_terminal) as progress:
        task = progress.add_task(label, total=total)
        yield lambda n: progress.advance(task, n)


# -- steps on disk --------------------------------------------------------------------------------


class _StepRow(TypedDict):
    """One step in `list` (its JSON form as is)."""

    step: int
    steps: list[int]
    status: ManifestStatus
    rollout: int
    trainer: int
    forward_steps: int
    bytes: int
    merged: Literal["ok", "error"] | None
    merged_trace: str | None
    report: bool


@app.command("list")
def list_steps(directory: Dir, as_json: AsJson = False) -> None:
    """The steps under DIR: status, processes, forward steps, size, merged timeline and report."""
    store = _store(directory)
    rows: list[_StepRow] = []
    for k in store.steps():
        m = load_manifest(store, k)
        merge = m.merge or store.read_merge(k)
        step_dir = store.step_dir(k)
        rows.append(
            {
                "step": k,
                "steps": m.steps,
                "status": m.status,
                "rollout": sum(e.role == "rollout" for e in m.entries),
                "trainer": sum(e.role == "trainer" for e in m.entries),
                "forward_steps": sum(e.forward_steps for e in m.entries if e.role == "rollout"),
                "bytes": sum(e.bytes for e in m.entries),
                "merged": None if merge is None else merge.status,
                "merged_trace": str(step_dir / MERGED_TRACE) if (step_dir / MERGED_TRACE).is_file() else None,
                "report": (step_dir / "report.html").is_file(),
            }
        )
    if as_json:
        _print_json(rows)
        return
    if not rows:
        err.print(f"no steps under {store.root}", markup=False)
        return
    table = Table(title=f"steps under {store.root}")
    for col in (
        "step",
        "window",
        "status",
        "replicas",
        "trainer ranks",
        "rollout fwd steps",
        "MB",
        "merged",
        "report",
    ):
        table.add_column(col, justify="left" if col in ("status", "merged") else "right")
    for r in rows:
        table.add_row(
            str(r["step"]),
            ",".join(map(str, r["steps"])),
            r["status"],
            str(r["rollout"]),
            str(r["trainer"]),
            str(r["forward_steps"]),
            f"{r['bytes'] / 2**20:.1f}",
            r["merged"] or "-",
            "yes" if r["report"] else "-",
        )
    out.print(table)


@app.command()
def summarize(
    directory: Dir,
    step: Steps = None,
    top: Annotated[int, typer.Option(help="Ops shown per process.")] = 5,
    as_json: AsJson = False,
) -> None:
    """Per process: forward steps, top ops by self time, weight updates, overhead; across
    replicas: start/stop spread and the slowest replica. JSON: a list of step summaries."""
    store = _store(directory)
    steps = _steps(store, step)
    with _byte_progress("summarizing", store, steps, as_json) as advance:
        summaries = [summarize_step(store, k, advance) for k in steps]
    if as_json:
        _print_json(summaries)
        return
    for s in summaries:
        _print_summary(s, top)


@app.command()
def merge(directory: Dir, step: Steps = None, as_json: AsJson = False) -> None:
    """Merge each step's traces into step_<k>/merged.trace.json.gz: one Perfetto timeline of the
    trainer and every replica, clocks aligned. JSON: a list of merge records."""
    store = _store(directory)
    steps = _steps(store, step)
    records, failed = [], []
    with _byte_progress("merging", store, steps, as_json) as advance:
        for k in steps:
            try:
                record = merge_step(store, k, on_progress=advance)
            except MergeError as e:
                failed.append(str(e))
                continue
            assert record is not None
            records.append(record)
            if not as_json:
                _print_merge(store, k, record)
    if as_json:
        _print_json(records)
    if failed:
        _fail(EXIT_FAILED, "; ".join(failed))


@app.command()
def diff(
    directory: Dir,
    step: Annotated[list[int], typer.Option("--step", help="Give exactly two: --step A --step B.")],
    top: Annotated[int, typer.Option(help="Ops listed.")] = 15,
    as_json: AsJson = False,
) -> None:
    """What changed from step A to step B: phases and ops by self time per forward step."""
    if len(step) != 2:
        _fail(EXIT_USAGE, f"diff needs exactly two steps (--step A --step B), got {len(step)}")
    if step[0] == step[1]:
        _fail(EXIT_USAGE, f"--step A and --step B are both {step[0]}; give two different steps")
    store = _store(directory)
    a, b = _steps(store, step)
    with _byte_progress("summarizing", store, [a, b], as_json) as advance:
        result = diff_steps(summarize_step(store, a, advance), summarize_step(store, b, advance), top=top)
    if as_json:
        _print_json(result)
        return
    _print_diff(result)


@app.command()
def report(directory: Dir, step: Steps = None) -> None:
    """Write step_<k>/report.html (tables and a timeline picture, self-contained) and an
    index.html over all steps."""
    from profiling.analysis.report import (
        write_reports,  # matplotlib: slow to import, only needed here
    )

    store = _store(directory)
    steps = _steps(store, step)
    columns = (TextColumn("reports"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"))
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task("reports", total=len(steps))
        result = write_reports(store, steps, on_step=lambda _: progress.advance(task))
    for k, page in result.pages.items():
        out.print(f"step {k}: {page}", markup=False)
    out.print(f"index: {result.index}", markup=False)


@app.command()
def ranks(directory: Dir, step: Steps = None, as_json: AsJson = False) -> None:
    """(Re)write step_<k>/ranks/: every trace of the step as one rank (a unique
    distributedInfo.rank), the directory Holistic Trace Analysis and TensorBoard's profiler
    plugin load. The background merge (merge_on_complete) writes it for every settled step; this
    rebuilds it. JSON: a list of views."""
    store = _store(directory)
    views, failed = [], []
    for k in _steps(store, step):
        try:
            v = build_tool_view(store, k)
        except ViewError as e:
            failed.append(str(e))
            continue
        assert v is not None  # only an `only_if_stale` build returns None
        views.append(v)
        if not as_json:
            _print_view(v)
    if as_json:
        _print_json(views)
    if failed:
        _fail(EXIT_FAILED, "; ".join(failed))


def _print_view(v: ToolView) -> None:
    linked = sum(f.how == "link" for f in v.files)
    out.print(
        f"step {v.step}: {v.world_size} rank(s) ({linked} linked, {v.world_size - linked} rewritten, "
        f"{v.rewritten_bytes / 2**20:.1f} MB) in {v.duration_s:.1f} s: {v.directory}",
        markup=False,
    )
    for note in v.skipped:
        err.print(f"  skipped {note}", markup=False)


@app.command()
def verify(directory: Dir, step: Steps = None, as_json: AsJson = False) -> None:
    """Check that each step's traces hold what its manifest says: the manifest settled (or its
    failures explained), every listed file present and parsing, every forward step on the step's
    weights (a continuous window: its versions in order, each after its weight update), as many
    forward steps as counted, none on those weights outside the window, and clocks aligned.
    Exit 1 on any violation. JSON: the report (steps, violations, notes)."""
    store = _store(directory)
    steps = _steps(store, step)
    columns = (TextColumn("verifying"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True, disable=as_json or not err.is_terminal) as progress:
        task = progress.add_task("verifying", total=trace_bytes(store, steps))
        result = verify_steps(store, steps, lambda n: progress.advance(task, n))
    if as_json:
        _print_json(result)
    else:
        print_verify_report(out, result)
    if not result.ok:
        raise typer.Exit(EXIT_FAILED)


@app.command("verl")
def verl(
    save_path: Annotated[
        Path | None,
        typer.Argument(
            help="verl's global_profiler.save_path (default: $VERL_PROFILE_SAVE_PATH, which verl sets for its "
            "finish_hook_cmd).",
            show_default=False,
        ),
    ] = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Where the step_<k>/ directories go (default: SAVE_PATH).")
    ] = None,
    app_save_path: Annotated[
        Path | None,
        typer.Option(
            "--app-save-path",
            help="The app's save_path, where verl ran through this project's plugin and the app wrote its "
            "step_<k>/ elsewhere than SAVE_PATH: its steps get verl's trainer traces (they are built there).",
        ),
    ] = None,
    trigger_parameter_sync_step: Annotated[
        int,
        typer.Option(
            min=1,
            help="verl's async_training.trigger_parameter_sync_step: trainer steps per parameter version "
            "(1 for verl's synchronous trainer).",
        ),
    ] = 1,
    as_json: AsJson = False,
) -> None:
    """Make verl's own profiler output (global_profiler.tool: torch) into this project's steps:
    step_<k>/ with the trainer's traces of the steps producing version k and each rollout replica's
    recording whose stop lies in that trainer window, then merge each step, write its ranks view, report it.
    Runs as written as verl's global_profiler.finish_hook_cmd. JSON: the ingest report."""
    from profiling.verl_traces.ingest import NoVerlTraces, ingest  # the reports import matplotlib

    if save_path is None:
        env = os.environ.get("VERL_PROFILE_SAVE_PATH")
        if not env:
            _fail(
                EXIT_USAGE,
                "no SAVE_PATH: pass verl's global_profiler.save_path, or run this as verl's finish_hook_cmd, "
                "which sets $VERL_PROFILE_SAVE_PATH",
            )
        save_path = Path(env)
    if not save_path.is_dir():
        _fail(EXIT_USAGE, f"{save_path} is not a directory; pass verl's global_profiler.save_path")
    if out_dir is not None and app_save_path is not None and out_dir.resolve() != app_save_path.resolve():
        _fail(
            EXIT_USAGE,
            f"--out {out_dir} and --app-save-path {app_save_path} differ: the app's steps are completed where "
            "they are; give only --app-save-path",
        )
    quiet = as_json or not err.is_terminal
    try:
        report = ingest(
            save_path,
            out_dir or app_save_path,
            trigger_parameter_sync_step,
            on_step=None if quiet else lambda message: err.print(message, markup=False),
        )
    except NoVerlTraces as e:
        _fail(EXIT_USAGE, str(e))
    except OSError as e:
        _fail(EXIT_FAILED, f"{e}; check that {out_dir or app_save_path or save_path} is writable and has room")
    if as_json:
        _print_json(report)
    else:
        _print_ingest(report)
    if not report.steps:
        why = (
            "every step found is a directory this command did not write (see 'left as is')"
            if report.left
            else "no trainer trace names a verl step, and recordings are placed in steps by the trainer's windows: "
            "profile the trainer too (its role's profiler.enable with global_profiler.steps)"
        )
        _fail(EXIT_FAILED, f"no step built from {report.save_path}: {why}")
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)


# -- printing --------------------------------------------------------------------------------------


def _print_ingest(r: IngestReport) -> None:
    def say(text: str, console: Console = out) -> None:
        console.print(text, markup=False, soft_wrap=True)

    say(
        f"verl traces under {r.save_path}: {r.trainer_files} trainer and {r.rollout_files} rollout trace file(s); "
        f"trigger_parameter_sync_step {r.trigger_parameter_sync_step}"
    )
    for s in r.steps:
        window = "-" if s.trainer_window is None else span_text(*(round(t * 1e9) for t in s.trainer_window))
        whose = ", the app's step: trainer entries added" if s.app_step else ""
        verl_steps = ", ".join(map(str, s.trainer_steps))
        say(f"step {s.step} ({s.status}{whose}): verl steps {verl_steps}, trainer window {window}")
        placed = {f"rollout/{p.replica_id}": p for p in s.rollout}
        for key, names in s.files.items():
            line = f"  {key}: {len(names)} file(s): {', '.join(names)}"
            if (p := placed.get(key)) is not None:
                line += (
                    f"; stopped at {clock_text(round(p.stopped_at * 1e9))}, {p.margin_s:.3f} s inside the trainer "
                    "window (its clock and the trainer's taken to agree)"
                )
            say(line)
        for line in (*s.errors, *(f"{k}: the app's own entry, kept" for k in s.kept)):
            say(f"  {line}")
        for line in s.not_merged:
            say(f"  not merged: {line}")
        if s.merge is not None:
            say(
                f"  merged: {s.merge.events} events from {len(s.merge.processes)} trace file(s): "
                f"{Path(r.out) / f'step_{s.step}' / MERGED_TRACE}"
            )
        for line in s.failed:
            say(f"  failed: {line}", err)
    for line in r.unassigned:
        say(f"not assigned to a step: {line}")
    for line in r.not_assigned:
        say(f"not merged, no step: {line}")
    for line in (*r.unreadable, *r.clock_problems):
        say(f"unreadable: {line}", err)
    for line in r.left:
        say(f"left as is: {line}", err)
    for line in r.removed:
        say(f"removed: {line}")
    if r.index:
        say(f"report: {r.index}")


def print_verify_report(console: Console, report: VerifyReport, notes: bool = True) -> None:
    """The violations (and, with `notes`, the notes) as tables, then one summary line:
    `N steps verified: M violations`."""
    for title, findings in (("violations", report.violations), ("notes", report.notes if notes else [])):
        if findings:
            console.print(_findings_table(title, findings))
    n, m = len(report.steps), len(report.violations)
    console.print(
        f"{n} step{'s' * (n != 1)} verified: {m} violation{'s' * (m != 1)}"
        + (f", {len(report.notes)} note{'s' * (len(report.notes) != 1)}" if notes and report.notes else ""),
        markup=False,
    )


def _findings_table(title: str, findings: list[Finding]) -> Table:
    table = Table(title=f"verify: {title}")
    for col in ("step", "entry", "check", "problem" if title == "violations" else "note"):
        table.add_column(col, justify="right" if col == "step" else "left", overflow="fold")
    for f in findings:
        table.add_row(str(f.step), f.entry, f.check, f.message)
    return table


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _print_summary(s: StepSummary, top: int) -> None:
    table = Table(title=f"step {s.step} ({s.status}): processes")
    for col in (
        "process",
        "weights",
        "fwd steps",
        "fwd ms",
        "mean ms",
        "max ms",
        "weight upd ms",
        "finalize ms",
        "export ms",
        "clock",
    ):
        table.add_column(col, justify="left" if col in ("process", "clock") else "right")
    for p in s.processes:
        table.add_row(
            p.key + ("" if p.status == "ok" else f" [{p.status}]"),
            ",".join(f"v{v}" for v in p.weight_versions),
            str(p.forward_steps),
            _ms(p.forward_ms),
            _ms(p.forward_mean_ms),
            _ms(p.forward_max_ms),
            _ms(p.weight_update_ms),
            _ms(p.overhead.finalize_ms),
            _ms(p.overhead.export_ms),
            ",".join(a.source for a in p.alignment) or "-",
        )
    out.print(table)
    for p in s.processes:
        if p.kept:
            out.print(f"{p.key}: {p.kept}", markup=False)
    k = s.skew
    out.print(
        f"replicas {k.replicas}: start spread {_ms(k.start_spread_ms)} ms, stop spread {_ms(k.stop_spread_ms)} ms, "
        f"slowest {k.slowest_replica or '-'} ({_ms(k.slowest_forward_mean_ms)} ms/forward step)",
        markup=False,
    )
    if s.control:
        out.print("sync: " + ", ".join(f"{c.name} {c.dur_s * 1000:.1f} ms" for c in s.control), markup=False)
    _print_breakdown(s)
    ops = Table(title=f"step {s.step}: top {top} ops by self time")
    for col in ("process", "op", "calls", "self ms"):
        ops.add_column(col, justify="left" if col in ("process", "op") else "right")
    for p in s.processes:
        for o in p.ops[:top]:
            ops.add_row(p.key, o.name, str(o.count), f"{o.self_ms:.3f}")
    out.print(ops)
    for note in s.skipped:
        err.print(f"skipped {note}", markup=False)


def _print_breakdown(s: StepSummary) -> None:
    b = s.breakdown
    table = Table(title=f"step {s.step}: RL step breakdown (seconds)")
    cols = ("process", "generating", "held", "idle", "sync hold", "finalizing", "exporting", "requests", "out tokens")
    for col in (*cols, "slowest"):
        table.add_column(col, justify="left" if col == "process" else "right")
    for r in b.replicas:
        table.add_row(
            f"rollout/{r.replica_id}",
            *(_s(v) for v in (r.generating_s, r.held_s, r.idle_s, r.sync_held_s, r.finalizing_s, r.exporting_s)),
            str(r.requests),
            str(r.output_tokens),
            _s(r.slowest_s),
        )
    out.print(table)
    if b.trainer:
        ranks = Table(title=f"step {s.step}: trainer ranks (seconds)")
        for col in ("process", "training", "sync", "other", "finalizing", "exporting"):
            ranks.add_column(col, justify="left" if col == "process" else "right")
        for t in b.trainer:
            ranks.add_row(
                t.name,
                *(_s(v) for v in (t.training_s, t.sync_s, t.other_s, t.finalizing_s, t.exporting_s)),
            )
        out.print(ranks)
    if b.pipeline:
        stages = Table(title=f"step {s.step}: pipeline stages (seconds, mean of each stage's ranks)")
        for col in ("stage", "ranks", "training", "compute", "bubble", "bubble share"):
            stages.add_column(col, justify="left" if col == "stage" else "right")
        for row in b.pipeline:
            share = "-" if row.bubble_share is None else f"{row.bubble_share:.0%}"
            ranks_of = ", ".join(map(str, row.ranks))
            stages.add_row(f"pp{row.stage}", ranks_of, _s(row.training_s), _s(row.compute_s), _s(row.bubble_s), share)
        out.print(stages)
    i, st = b.imbalance, b.staleness
    served = ", ".join(f"v{v}: {n}" for v, n in b.weight_versions_served.items()) or "-"
    out.print(
        f"imbalance (max/mean): generating {_s(i.generating_max_over_mean)}, tokens "
        f"{_s(i.output_tokens_max_over_mean)}; versions served (requests): {served}",
        markup=False,
    )
    if st is not None:
        hist = ", ".join(f"{k}: {n}" for k, n in st.histogram.items())
        out.print(
            f"staleness of consumed samples: mean {_s(st.mean)}, max {st.max}, {st.samples} samples "
            f"({hist}), {st.dropped} dropped",
            markup=False,
        )


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _print_merge(store: TraceStore, k: int, r: MergeRecord) -> None:
    sources = ", ".join(sorted({f"{a.key}: {a.source}" for a in r.processes}))
    out.print(
        f"step {k}: {r.events} events from {len(r.processes)} trace file(s), {r.bytes_in / 2**20:.1f} MB -> "
        f"{r.bytes_out / 2**20:.1f} MB in {r.duration_s:.1f} s: {store.step_dir(k) / MERGED_TRACE}",
        markup=False,
    )
    out.print(f"  clocks: {sources or '-'}", markup=False)
    for note in r.skipped:
        err.print(f"  skipped {note}", markup=False)


def _print_diff(d: StepDiff) -> None:
    phases = Table(title=f"step {d.a} -> step {d.b}: phases (ms)")
    for col in ("role", "phase", f"step {d.a}", f"step {d.b}", "delta", "ratio"):
        phases.add_column(col, justify="left" if col in ("role", "phase") else "right")
    for row in d.phases:
        phases.add_row(
            row.role or "-",
            row.name,
            _ms(row.a_ms),
            _ms(row.b_ms),
            _ms(row.delta_ms),
            "-" if row.ratio is None else f"{row.ratio:.2f}x",
        )
    out.print(phases)
    changes = Table(title=f"step {d.a} -> step {d.b}: RL step breakdown")
    for col in ("figure", "unit", f"step {d.a}", f"step {d.b}", "delta", "ratio"):
        changes.add_column(col, justify="left" if col in ("figure", "unit") else "right")
    for c in d.breakdown:
        changes.add_row(
            c.name, c.unit, _s(c.a), _s(c.b), _s(c.delta), "-" if c.ratio is None else f"{c.ratio:.2f}x"
        )
    out.print(changes)
    basis = ", ".join(f"{role}: {b}" for role, b in d.ops_basis.items())
    ops = Table(title=f"ops by self time, most slowed-down first ({basis}; ms)")
    for col in ("role", "op", f"step {d.a}", f"step {d.b}", "delta", "ratio"):
        ops.add_column(col, justify="left" if col in ("role", "op") else "right")
    for row in d.ops:
        ops.add_row(
            row.role or "-",
            row.name,
            f"{row.a_ms:.4f}",
            f"{row.b_ms:.4f}",
            f"{row.delta_ms:+.4f}",
            "-" if row.ratio is None else f"{row.ratio:.2f}x",
        )
    out.print(ops)


_add_app_commands()
