"""HTML reports: `step_<k>/report.html` per step (summary tables and the timeline picture,
embedded) and `index.html` over all steps at the save path. Self-contained: no scripts, no
external fonts or images, nothing fetched over the network."""

from __future__ import annotations

import base64
import html
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from profiling.analysis.breakdown import StepBreakdown
from profiling.analysis.picture import breakdown_png, timeline_png
from profiling.analysis.summary import ProcessSummary, StepSummary, summarize_step
from profiling.store import MERGED_TRACE, TraceStore, atomic_write_text

REPORT_FILE = "report.html"
INDEX_FILE = "index.html"
TOP_OPS = 10
_CSS = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th { background: #f1f3f5; }
td.l, th.l { text-align: left; }
img { max-width: 100%; border: 1px solid #ddd; }
.note { color: #666; font-size: 13px; }
.ops { display: flex; flex-wrap: wrap; gap: 0 2em; }
"""


class ReportResult(BaseModel):
    """What `write_reports` wrote."""

    index: Path
    pages: dict[int, Path]


def write_reports(
    store: TraceStore,
    steps: list[int] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> ReportResult:
    """Write `report.html` for `steps` (default: every step) and the index over every step that
    has a report. `on_step(k)` is called after each step's page."""
    pages = {}
    summaries = {}
    for k in steps if steps is not None else store.steps():
        summary = summarize_step(store, k)
        pages[k] = write_step_report(store, summary)
        summaries[k] = summary
        if on_step is not None:
            on_step(k)
    return ReportResult(index=write_index(store, summaries), pages=pages)


def write_step_report(store: TraceStore, summary: StepSummary) -> Path:
    """`step_<k>/report.html` for `summary`; returns its path."""
    step_dir = store.step_dir(summary.step)
    png = base64.b64encode(timeline_png(summary)).decode()
    merged = step_dir / MERGED_TRACE
    parts = [
        f"<h1>Step {summary.step}</h1>",
        f"<p>window steps {_e(', '.join(map(str, summary.steps)))}; status <b>{_e(summary.status)}</b>; "
        f"tool {_e(summary.tool)}; recorded {_e(_when(summary.started_at))} to {_e(_when(summary.stopped_at))}. "
        f'<a href="../{INDEX_FILE}">all steps</a></p>',
        (
            f'<p>Merged timeline: <a href="{MERGED_TRACE}">{MERGED_TRACE}</a> (open it in the Perfetto UI).</p>'
            if merged.is_file()
            else '<p class="note">No merged timeline yet: '
            f"<code>python -m profiling merge {_e(str(store.root))} --step {summary.step}</code></p>"
        ),
        f'<img alt="timeline of step {summary.step}" src="data:image/png;base64,{png}">',
        "<h2>RL step breakdown</h2>",
        *_breakdown_section(summary),
        "<h2>Processes</h2>",
        _processes_table(summary.processes),
        *_kept_notes(summary.processes),
        "<h2>Across replicas</h2>",
        _skew_table(summary),
        "<h2>Weight sync (trainer's control calls)</h2>",
        _sync_table(summary),
        f"<h2>Top ops by self time (top {TOP_OPS} per process)</h2>",
        '<div class="ops">',
        *[_ops_table(p) for p in summary.processes if p.ops],
        "</div>",
        "<h2>Clock alignment</h2>",
        _alignment_table(summary),
    ]
    if summary.skipped:
        parts += ["<h2>Files not read</h2><ul>", *[f"<li>{_e(s)}</li>" for s in summary.skipped], "</ul>"]
    path = step_dir / REPORT_FILE
    atomic_write_text(path, _page(f"step {summary.step}", parts))
    return path


def write_index(store: TraceStore, summaries: dict[int, StepSummary]) -> Path:
    """`index.html` at the save path: one row per step, linking each step's report."""
    rows = []
    for k in store.steps():
        step_dir = store.step_dir(k)
        s = summaries.get(k)
        report = step_dir / REPORT_FILE
        merged = step_dir / MERGED_TRACE
        link = f'<a href="step_{k}/{REPORT_FILE}">step {k}</a>' if report.is_file() else f"step {k}"
        trace = f'<a href="step_{k}/{MERGED_TRACE}">merged trace</a>' if merged.is_file() else "-"
        if s is None:
            rows.append(
                f'<tr><td class="l">{link}</td><td class="l" colspan="5">not summarized</td>'
                f'<td class="l">{trace}</td></tr>'
            )
            continue
        rollout = s.by_role("rollout")
        sync = "-" if s.sync is None else f"{s.sync.total_s * 1000:.0f}"
        rows.append(
            f'<tr><td class="l">{link}</td><td class="l">{_e(s.status)}</td><td>{len(rollout)}</td>'
            f"<td>{sum(p.forward_steps for p in rollout)}</td><td>{_num(_mean_of(rollout))}</td>"
            f'<td>{sync}</td><td class="l">{trace}</td></tr>'
        )
    parts = [
        "<h1>Profiled steps</h1>",
        f'<p class="note">{_e(str(store.root))} — written {_e(_when(time.time()))}</p>',
        "<table><tr><th class='l'>step</th><th class='l'>status</th><th>replicas</th><th>rollout forward steps</th>"
        "<th>mean forward step ms</th><th>sync ms</th><th class='l'>timeline</th></tr>",
        *rows,
        "</table>",
    ]
    path = store.root / INDEX_FILE
    atomic_write_text(path, _page("profiled steps", parts))
    return path


def _processes_table(processes: list[ProcessSummary]) -> str:
    head = (
        "<tr><th class='l'>process</th><th class='l'>status</th><th>weights</th><th>forward steps</th>"
        "<th>forward ms</th><th>mean ms</th><th>max ms</th><th>weight update ms</th>"
        "<th>finalize ms</th><th>export ms</th><th>kineto overhead ms</th><th>events</th></tr>"
    )
    rows = [
        f'<tr><td class="l">{_e(p.key)}</td><td class="l">{_e(p.status + (": " + p.error if p.error else ""))}</td>'
        f"<td>{_e(','.join(f'v{v}' for v in p.weight_versions))}</td><td>{p.forward_steps}</td>"
        f"<td>{_num(p.forward_ms)}</td><td>{_num(p.forward_mean_ms)}</td><td>{_num(p.forward_max_ms)}</td>"
        f"<td>{_num(p.weight_update_ms)}</td><td>{_num(p.overhead.finalize_ms)}</td><td>{_num(p.overhead.export_ms)}</td>"
        f"<td>{_num(p.overhead.kineto_ms)}</td><td>{p.events}</td></tr>"
        for p in processes
    ]
    return "<table>" + head + "".join(rows) + "</table>"


def _kept_notes(processes: list[ProcessSummary]) -> list[str]:
    """One line per process whose trace holds less than its window ran."""
    return [f'<p class="note kept"><b>{_e(p.key)}</b>: {_e(p.kept)}</p>' for p in processes if p.kept]


def _skew_table(s: StepSummary) -> str:
    k = s.skew
    rows = [
        ("replicas", str(k.replicas)),
        (
            "start spread ms (first → last)",
            f"{_num(k.start_spread_ms)} ({_e(k.first_to_start or '-')} → {_e(k.last_to_start or '-')})",
        ),
        (
            "stop spread ms (first → last)",
            f"{_num(k.stop_spread_ms)} ({_e(k.first_to_stop or '-')} → {_e(k.last_to_stop or '-')})",
        ),
        (
            "slowest replica (mean forward step ms)",
            f"{_e(k.slowest_replica or '-')} ({_num(k.slowest_forward_mean_ms)})",
        ),
        ("fastest mean forward step ms", _num(k.fastest_forward_mean_ms)),
    ]
    return _facts(rows)


def _sync_table(s: StepSummary) -> str:
    if not s.control:
        return '<p class="note">No control-call timings for this step (no trainer entry with a sync).</p>'
    rows = "".join(
        f'<tr><td class="l">{_e(c.name)}</td><td class="l">{_e(c.caller)}</td>'
        f'<td>{_e(_when(c.start))}</td><td>{c.dur_s * 1000:.1f}</td></tr>'
        for c in s.control
    )
    return (
        "<table><tr><th class='l'>call</th><th class='l'>by</th><th>sent at</th><th>ms</th></tr>"
        + rows
        + "</table>"
    )


def _breakdown_section(s: StepSummary) -> list[str]:
    b = s.breakdown
    png = breakdown_png(s)
    parts = [] if png is None else [
        f'<img alt="breakdown of step {s.step}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
    ]
    return [
        *parts,
        _replicas_table(b),
        _trainer_table(b),
        _pipeline_table(b),
        _facts_table(b),
        _slowest_table(b),
        '<p class="note">In the window, generating: a request in flight and admission open; held: admission '
        "held (a weight load, or a sync inside a continuous window); idle: neither. Held for the sync: from "
        "the stop that ended the step to the start that released the replica; the profiler's finalize runs "
        "within it, and exporting follows in the background. Imbalance: the largest replica's figure over "
        "the mean.</p>",
    ]


def _replicas_table(b: StepBreakdown) -> str:
    head = (
        "<tr><th class='l'>replica</th><th>window s</th><th>generating s</th><th>held s</th><th>idle s</th>"
        "<th>held for the sync s</th><th>finalizing s</th><th>exporting s</th>"
        "<th>requests</th><th>failed</th><th>prompt tokens</th>"
        "<th>output tokens</th><th>slowest s</th><th class='l'>versions served</th></tr>"
    )
    rows = "".join(
        f'<tr><td class="l">{_e(r.replica_id)}</td><td>{_num(r.window_s)}</td><td>{_num(r.generating_s)}</td>'
        f"<td>{_num(r.held_s)}</td><td>{_num(r.idle_s)}</td><td>{_num(r.sync_held_s)}</td><td>{_num(r.finalizing_s)}</td>"
        f"<td>{_num(r.exporting_s)}</td><td>{r.requests}</td><td>{r.failed}</td><td>{r.prompt_tokens}</td>"
        f'<td>{r.output_tokens}</td><td>{_num(r.slowest_s)}</td>'
        f'<td class="l">{_e(_versions(r.weight_versions))}</td></tr>'
        for r in b.replicas
    )
    return "<table>" + head + rows + "</table>"


def _trainer_table(b: StepBreakdown) -> str:
    if not b.trainer:
        return '<p class="note">No trainer entry in this step.</p>'
    head = (
        "<tr><th class='l'>trainer rank</th><th>window s</th><th>training s</th><th>sync s</th>"
        "<th>other s</th><th>finalizing s</th><th>exporting s</th></tr>"
    )
    rows = "".join(
        f'<tr><td class="l">{_e(t.name)}</td><td>{_num(t.window_s)}</td>'
        f'<td>{_num(t.training_s)}</td><td>{_num(t.sync_s)}</td>'
        f"<td>{_num(t.other_s)}</td><td>{_num(t.finalizing_s)}</td><td>{_num(t.exporting_s)}</td></tr>"
        for t in b.trainer
    )
    return "<table>" + head + rows + "</table>"


def _pipeline_table(b: StepBreakdown) -> str:
    if not b.pipeline:
        return ""
    head = (
        "<tr><th class='l'>pipeline stage</th><th class='l'>ranks</th><th>training s</th><th>compute s</th>"
        "<th>bubble s</th><th>bubble share</th></tr>"
    )
    rows = "".join(
        f'<tr><td class="l">pp{st.stage}</td><td class="l">{", ".join(map(str, st.ranks))}</td>'
        f"<td>{_num(st.training_s)}</td><td>{_num(st.compute_s)}</td><td>{_num(st.bubble_s)}</td>"
        f"<td>{'-' if st.bubble_share is None else f'{st.bubble_share:.0%}'}</td></tr>"
        for st in b.pipeline
    )
    note = (
        '<p class="note">Per pipeline stage, the mean of its ranks: the bubble is the time its mini-batches '
        "waited in point-to-point sends and receives on the neighbouring stages; compute is the rest.</p>"
    )
    return "<table>" + head + rows + "</table>" + note


def _facts_table(b: StepBreakdown) -> str:
    i, st = b.imbalance, b.staleness
    rows = [
        ("requests answered (output tokens)", f"{b.requests} ({b.output_tokens})"),
        ("weight versions served (requests)", _e(_versions(b.weight_versions_served)) or "-"),
        (
            "imbalance: generating, tokens, requests (max / mean)",
            f"{_num(i.generating_max_over_mean)}, "
            f"{_num(i.output_tokens_max_over_mean)}, {_num(i.requests_max_over_mean)}",
        ),
        ("busiest → least busy replica", f"{_e(i.busiest or '-')} → {_e(i.least_busy or '-')}"),
        (
            "staleness of consumed samples: mean, max (samples, dropped)",
            "-" if st is None else f"{_num(st.mean)}, {st.max} ({st.samples}, {st.dropped})",
        ),
        (
            "staleness histogram (versions behind: samples)",
            "-" if st is None else _e(", ".join(f"{k}: {n}" for k, n in st.histogram.items())),
        ),
    ]
    return _facts(rows)


def _slowest_table(b: StepBreakdown) -> str:
    if not b.slowest_requests:
        return '<p class="note">No requests were answered in this step\'s windows.</p>'
    rows = "".join(
        f'<tr><td class="l">{_e(r.replica_id or "-")}</td><td>{r.latency_s:.3f}</td><td>{r.prompt_tokens}</td>'
        f'<td>{r.output_tokens}</td><td class="l">{_e(",".join(f"v{v}" for v in r.weight_versions))}</td>'
        f"<td>{_e(_when(r.finished_at))}</td></tr>"
        for r in b.slowest_requests
    )
    return (
        "<h3>Slowest requests</h3><table><tr><th class='l'>replica</th><th>latency s</th><th>prompt tokens</th>"
        "<th>output tokens</th><th class='l'>versions</th><th>finished at</th></tr>" + rows + "</table>"
    )


def _versions(counts: dict[int, int]) -> str:
    return ", ".join(f"v{v}: {n}" for v, n in counts.items())


def _ops_table(p: ProcessSummary) -> str:
    rows = "".join(
        f'<tr><td class="l">{_e(o.name)}</td><td>{o.count}</td><td>{o.self_ms:.3f}</td></tr>'
        for o in p.ops[:TOP_OPS]
    )
    return (
        f"<div><h3>{_e(p.key)}</h3><table><tr><th class='l'>op</th><th>calls</th><th>self ms</th></tr>"
        f"{rows}</table></div>"
    )


def _alignment_table(s: StepSummary) -> str:
    rows = "".join(
        f'<tr><td class="l">{_e(a.key)}</td><td class="l">{_e(a.file)}</td><td class="l">{_e(a.source)}</td>'
        f"<td>{a.offset_ns / 1000:.1f}</td>"
        f"<td>{_num(None if a.uncertainty_ns is None else a.uncertainty_ns / 1000)}</td>"
        f"<td>{_num(None if a.drift_ns is None else a.drift_ns / 1000)}</td>"
        f"<td>{a.reference_offset_ns / 1000:.1f}</td>"
        f"<td>{_num(None if a.reference_bound_ns is None else a.reference_bound_ns / 1000)}</td></tr>"
        for p in s.processes
        for a in p.alignment
    )
    return (
        "<table><tr><th class='l'>process</th><th class='l'>file</th><th class='l'>source</th><th>offset µs</th>"
        "<th>± µs</th><th>drift µs</th><th>clock vs app µs</th><th>± µs</th></tr>" + rows + "</table>"
        '<p class="note">clock_sync: offset measured from markers bracketed by wall-clock readings; '
        "baseTimeNanoseconds: the trace's own time taken as wall clock (not measured). "
        "clock vs app: the process's wall clock against the app controller's, measured by a clock "
        "exchange (- : not measured, taken as the same clock); it is part of the offset, and its "
        "bound part of the ±.</p>"
    )


def _facts(rows: list[tuple[str, str]]) -> str:
    """A two-column table: a fact's name, its value."""
    return "<table>" + "".join(f'<tr><th class="l">{a}</th><td>{b}</td></tr>' for a, b in rows) + "</table>"


def _page(title: str, parts: list[str]) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>\n"
        + "\n".join(parts)
        + "\n</body></html>\n"
    )


def _mean_of(processes: list[ProcessSummary]) -> float | None:
    means = [p.forward_mean_ms for p in processes if p.forward_mean_ms is not None]
    return sum(means) / len(means) if means else None


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _when(t: float | None) -> str:
    return (
        "-"
        if t is None
        else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"
    )


def _e(text: str) -> str:
    return html.escape(text, quote=True)
