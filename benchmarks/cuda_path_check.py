"""The trainer-side CUDA path of profiling/, checked for real on a GPU, with numbers.

    python benchmarks/cuda_path_check.py OUT_DIR [--cpu] [--steps 4] [--profile 1 --profile 2] ...

One process trains a small transformer built here (no model hub) and drives this project's
profiling library the way a trainer rank does (trainer/profiled_sync.py, without the app): a
`StepSchedule` over the versions, a `ProfileSession` per rank whose window for step k opens when
version k-1 is published and closes at the sync publishing version k, every mini-batch inside
`ProfileSession.forward_step`, all of it on one model thread. It checks, in this order:

1. fork rule, before CUDA is initialised: `forked.can_fork()` holds and `run_forked` forks.
2. schedule: the profiled steps' windows (tool torch, activities [cpu, cuda]) make complete
   manifests whose traces hold CUDA kernels, every kernel launched inside a forward-step range
   and run inside its step's window on the wall clock (the trace mapped by the session's own
   clock markers); `python -m profiling verify`, `summarize`, `merge` and `list` on the output.
3. nsys backend: `tool: nsys` through a ProfileSession (cudaProfilerStart/Stop, NVTX ranges);
   optionally the same under an `nsys` binary, whose failure fails nothing.
4. fork rule on the device: once CUDA is initialised `can_fork()` is False, `run_forked` refuses
   (the torch export then runs in the process, which is counted), and a child forked anyway
   cannot use CUDA (why the rule exists).
5. overhead: windows of mini-batches with and without profiling, alternated, as a ratio of the
   median step times, plus the mini-batches run while a window's export is still being written.

OUT_DIR receives summary.json (also printed), each profiled step's manifest and trace (flat: at
most 8 small files, no sub-folders) and nsys_capture.json. The exit status is 1 when a check that
should hold failed, else 0; the optional nsys binary and the overhead ratio are reported only.
`--cpu` runs the same with activities [cpu] (and no CUDA-only checks) on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from profiling.analysis.clocks import ClockProbe, wall_ns
from profiling.backends import forked, torch_profiler
from profiling.backends.torch_profiler import init_kineto, quiet_kineto_env
from profiling.clock_exchange import own_offset
from profiling.config import Activity, ProfileOptions
from profiling.manifest import ManifestEntry, StepManifest, SyncCost, TrainerRecord
from profiling.markers import FORWARD_STEP, parse_forward_step
from profiling.schedule import StepSchedule
from profiling.session import ProfileSession, SessionSpec
from profiling.store import TraceStore

ROOT = Path(__file__).resolve().parents[1]
RANK = 0
CLI_TIMEOUT_S = 120
NSYS_TIMEOUT_S = 60
IMPORTER_TIMEOUT_S = 45
MAX_COPY_BYTES = 15 * 2**20
"""Files larger than this are not copied into OUT_DIR (a device run returns files up to 16 MiB)."""
NSYS_GLOBS = (
    "/opt/nvidia/nsight-systems*/bin/nsys",
    "/opt/nvidia/nsight-systems*/*/bin/nsys",
    "/usr/local/cuda*/bin/nsys",
    "/opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys",
)
"""Where an nsys binary may be when it is not on PATH (the device image had one only inside
Nsight Compute's folder)."""


# -- results ------------------------------------------------------------------------------------


@dataclass
class Results:
    """The checks in the order they ran, and the numbers beside them (summary.json)."""

    checks: list[dict[str, Any]] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def expect(self, ok: bool, name: str, detail: str) -> bool:
        """A check that should hold: its failure fails the run."""
        self.checks.append({"name": name, "status": "PASS" if ok else "FAIL", "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        return ok

    def info(self, name: str, detail: str) -> None:
        """Reported only (optional parts, measurements)."""
        self.checks.append({"name": name, "status": "INFO", "detail": detail})
        print(f"INFO {name}: {detail}", flush=True)

    @property
    def failed(self) -> list[str]:
        return [c["name"] for c in self.checks if c["status"] == "FAIL"]


@contextmanager
def guarded(results: Results, name: str, *, required: bool = True) -> Iterator[None]:
    """Run one part; an exception in it becomes a failed check (or, for an optional part, a note)
    instead of ending the script, so the later parts still run and report."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - reported as the part's outcome
        detail = f"raised {e!r}: {traceback.format_exc(limit=4).strip().splitlines()[-3:]}"
        if required:
            results.expect(False, name, detail)
        else:
            results.info(name, detail)


# -- the model and its training step ------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """The tiny transformer and its mini-batch."""

    d_model: int
    layers: int
    heads: int
    batch: int
    seq: int
    vocab: int


class TinyLM(nn.Module):
    """A small causal transformer LM (embedding, encoder layers with a causal mask, head)."""

    def __init__(self, s: Shape):
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.d_model)
        layer = nn.TransformerEncoderLayer(s.d_model, s.heads, 4 * s.d_model, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, s.layers, enable_nested_tensor=False)
        self.head = nn.Linear(s.d_model, s.vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(s.seq), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids), mask=self.mask, is_causal=True))


class Trainer:
    """One rank's model, optimizer and data; `fit_step` is one mini-batch."""

    def __init__(self, s: Shape, device: torch.device):
        torch.manual_seed(0)
        self.device = device
        self.model = TinyLM(s).to(device).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.ids = torch.randint(0, s.vocab, (s.batch, s.seq + 1), device=device)
        # bf16 autocast on the GPU, as a trainer runs; plain float32 on the CPU.
        self.autocast = device.type == "cuda"

    def fit_step(self) -> float:
        """Forward, backward, optimizer step; `.item()` waits for the GPU, as logging the loss does,
        so the step's kernels finish inside its range."""
        x, y = self.ids[:, :-1], self.ids[:, 1:]
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(x)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.item())


# -- clocks, sessions -----------------------------------------------------------------------------


def new_session(store: TraceStore, exporter: ThreadPoolExecutor) -> ProfileSession:
    """A trainer rank's session, as ProfiledWeightSync makes it."""
    return ProfileSession(store=store, entry_identity=ManifestEntry(role="trainer", rank=RANK), exporter=exporter)


def mark_ranks(store: TraceStore, label: int) -> None:
    """The driving rank's ranks record at a window's start (ProfiledWeightSync._start_trainer)."""
    record = TrainerRecord(ranks=[RANK], world_size=1, driver_rank=RANK)
    store.update_trainer_record(label, lambda r: record.model_copy(update={"failures": r.failures}))


class ExportSpy:
    """Counts how the torch backend's exports ran: in a forked child, or handed back to the
    process (`ForkUnavailable`), by wrapping the `run_forked` it calls."""

    def __init__(self) -> None:
        self.forked = 0
        self.in_process: list[str] = []
        self._original = torch_profiler.run_forked

    def install(self) -> None:
        def spy(work: Callable[[], dict[str, Any]], timeout_s: float) -> dict[str, Any]:
            try:
                result = self._original(work, timeout_s)
            except forked.ForkUnavailable as e:
                self.in_process.append(str(e))
                raise
            self.forked += 1
            return result

        torch_profiler.run_forked = spy

    def as_dict(self) -> dict[str, Any]:
        reasons = sorted(set(self.in_process))
        return {"forked": self.forked, "in_process": len(self.in_process), "in_process_reasons": reasons}


# -- part 2: the step schedule --------------------------------------------------------------------


def run_schedule(
    trainer: Trainer, store: TraceStore, options: ProfileOptions, steps: int, profiled: list[int], fit_steps: int
) -> dict[str, Any]:
    """Versions 1..steps, `fit_steps` mini-batches each, windows as the schedule says; on the model
    thread. Returns per-step wall times and the sync costs."""
    schedule = StepSchedule(profiled)
    exporter = ThreadPoolExecutor(1, thread_name_prefix="trainer-export")
    session = new_session(store, exporter)
    step_ms: dict[int, list[float]] = {}
    syncs: dict[int, dict[str, Any]] = {}
    try:
        if (label := schedule.begin()) is not None:
            mark_ranks(store, label)
            session.start(SessionSpec(step=label, steps=list(schedule.window_steps(label)), options=options), 0)
        for version in range(1, steps + 1):
            times = []
            for _ in range(fit_steps):
                t0 = time.perf_counter()
                with session.forward_step(version - 1):
                    trainer.fit_step()
                times.append((time.perf_counter() - t0) * 1e3)
            step_ms[version] = times
            plan = schedule.sync(version)
            cost = SyncCost(began_at=time.time())
            if plan.stop_step is not None:
                t0 = time.perf_counter()
                session.stop(plan.stop_step)
                cost.stop_s = time.perf_counter() - t0
                session.annotate(plan.stop_step, sync=cost, clock_offset=own_offset())
            if plan.start_step is not None:
                label = plan.start_step
                mark_ranks(store, label)
                t0 = time.perf_counter()
                session.start(
                    SessionSpec(step=label, steps=list(schedule.window_steps(label)), options=options), version
                )
                cost.start_s = time.perf_counter() - t0
            syncs[version] = {"plan": plan.model_dump(), "stop_s": cost.stop_s, "start_s": cost.start_s}
        for label in [w[0] for w in schedule.windows]:
            session.wait_exported(label, timeout=CLI_TIMEOUT_S)
    finally:
        exporter.shutdown(wait=True)
    return {
        "step_ms_median": {v: round(statistics.median(t), 3) for v, t in step_ms.items()},
        "step_ms": {v: [round(x, 3) for x in t] for v, t in step_ms.items()},
        "syncs": syncs,
    }


def load_trace(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    data = json.loads(gzip.decompress(raw) if path.name.endswith(".gz") else raw)
    return data if isinstance(data, dict) else {"traceEvents": data}


def trace_stats(entry: ManifestEntry, rel: str, trace: dict[str, Any], step: int, cuda: bool) -> dict[str, Any]:
    """What one trace holds on the GPU and where: kernels, copies, and whether each kernel was
    launched inside a forward-step range and ran inside the window on the wall clock."""
    events = [e for e in trace["traceEvents"] if isinstance(e, dict)]
    by_cat: dict[str, int] = {}
    for e in events:
        by_cat[str(e.get("cat"))] = by_cat.get(str(e.get("cat")), 0) + 1
    forwards = [
        e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(FORWARD_STEP)
    ]
    markers = [parse_forward_step(str(e["name"])) for e in forwards]
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in forwards)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    launches = {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }

    def inside(t0: float, t1: float) -> bool:
        return any(a <= t0 and t1 <= b for a, b in spans)

    launched_in = sum(
        1 for k in kernels if (ts := launches.get(k.get("args", {}).get("correlation"))) is not None and inside(ts, ts)
    )
    ran_in = sum(1 for k in kernels if inside(float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0))))
    # The wall-clock window: the trace mapped to this process's clock by the session's own clock
    # markers (profiling.analysis.clocks, what the merge uses), against the entry's started_at and
    # stopped_at, give or take the mapping's uncertainty.
    probe = ClockProbe(entry)
    for e in events:
        probe.see(e)
    base = trace.get("baseTimeNanoseconds")
    base_ns = int(base) if isinstance(base, int | float) else None
    align = probe.alignment(rel, base_ns)
    slack_ns = (align.uncertainty_ns or 0) + 1_000  # 1 µs: the trace's own rounding
    assert entry.started_at is not None and entry.stopped_at is not None
    lo, hi = entry.started_at * 1e9 - slack_ns, entry.stopped_at * 1e9 + slack_ns
    kernel_wall = [
        (wall_ns(float(k["ts"]), base_ns, align), wall_ns(float(k["ts"]) + float(k.get("dur", 0)), base_ns, align))
        for k in kernels
    ]
    in_window = sum(1 for a, b in kernel_wall if lo <= a and b <= hi)
    gpu_busy_us = sum(float(k.get("dur", 0)) for k in kernels)
    return {
        "file": rel,
        "trace_mb_json": entry.trace_mb,
        "events": len(events),
        "categories": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])[:12]),
        "forward_ranges": len(forwards),
        "forward_ranges_of_this_step": sum(1 for m in markers if m is not None and m.step == step),
        "kernels": len(kernels),
        "kernel_names_distinct": len({k.get("name") for k in kernels}),
        "kernels_launched_in_forward_ranges": launched_in,
        "kernels_run_in_forward_ranges": ran_in,
        "kernels_in_window_wall_clock": in_window,
        "kernels_per_forward_range": round(len(kernels) / len(forwards), 1) if forwards else None,
        "gpu_memcpy": by_cat.get("gpu_memcpy", 0),
        "gpu_memset": by_cat.get("gpu_memset", 0),
        "gpu_kernel_busy_ms": round(gpu_busy_us / 1e3, 3),
        "window_s": round(entry.stopped_at - entry.started_at, 4),
        "clock_alignment": {"source": align.source, "uncertainty_ns": align.uncertainty_ns, "drift_ns": align.drift_ns},
        "cuda_expected": cuda,
    }


def check_schedule(
    results: Results, store: TraceStore, profiled: list[int], fit_steps: int, cuda: bool
) -> dict[int, StepManifest]:
    """The manifests and traces of the profiled steps, against what the run did."""
    manifests: dict[int, StepManifest] = {}
    results.expect(
        store.steps() == profiled,
        "schedule.step_dirs",
        f"step directories {store.steps()}, profiled steps {profiled}",
    )
    for k in profiled:
        m = store.read_manifest(k)
        if not results.expect(m is not None, f"schedule.step_{k}.manifest", "manifest.json present"):
            continue
        assert m is not None
        manifests[k] = m
        entry = next((e for e in m.entries if e.key == f"trainer/rank_{RANK}"), None)
        results.expect(
            m.status == "complete" and entry is not None and entry.status == "ok",
            f"schedule.step_{k}.status",
            f"status {m.status}, entries {[(e.key, e.status, e.error) for e in m.entries]}",
        )
        if entry is None or not entry.files:
            continue
        results.expect(
            entry.forward_steps == fit_steps and entry.weight_version == k - 1,
            f"schedule.step_{k}.entry",
            f"forward_steps {entry.forward_steps} (ran {fit_steps}), weight_version {entry.weight_version} "
            f"(expected {k - 1}), finalize_s {entry.finalize_s}, export_s {entry.export_s}",
        )
        rel = entry.files[0]
        stats = trace_stats(entry, rel, load_trace(store.step_dir(k) / rel), k, cuda)
        results.data.setdefault("traces", {})[k] = stats
        results.expect(
            stats["forward_ranges"] == fit_steps == stats["forward_ranges_of_this_step"],
            f"schedule.step_{k}.forward_ranges",
            f"{stats['forward_ranges']} forward-step ranges, all labelled step {k}",
        )
        if not cuda:
            results.info(f"schedule.step_{k}.kernels", f"cpu run: {stats['kernels']} kernel events (none expected)")
            continue
        n = stats["kernels"]
        results.expect(
            n > 0, f"schedule.step_{k}.kernels", f"{n} CUDA kernel events ({stats['kernel_names_distinct']} names)"
        )
        results.expect(
            n > 0 and stats["kernels_launched_in_forward_ranges"] == n,
            f"schedule.step_{k}.kernels_launched_in_steps",
            f"{stats['kernels_launched_in_forward_ranges']}/{n} kernels launched inside a forward-step range",
        )
        results.expect(
            n > 0 and stats["kernels_run_in_forward_ranges"] == n,
            f"schedule.step_{k}.kernels_ran_in_steps",
            f"{stats['kernels_run_in_forward_ranges']}/{n} kernels ran (GPU time) inside a forward-step range",
        )
        results.expect(
            n > 0 and stats["kernels_in_window_wall_clock"] == n,
            f"schedule.step_{k}.kernels_in_window",
            f"{stats['kernels_in_window_wall_clock']}/{n} kernels inside step {k}'s window on the wall clock "
            f"(alignment {stats['clock_alignment']})",
        )
    return manifests


def child_env() -> dict[str, str]:
    """This environment with the repository on PYTHONPATH, for the Python processes started here
    (a relative entry such as `.` would not survive another working directory)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def run_cli(args: list[str]) -> tuple[int, str, str]:
    """`python -m profiling ARGS`, as a user runs it."""
    done = subprocess.run(
        [sys.executable, "-m", "profiling", *args],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    return done.returncode, done.stdout, done.stderr


def check_cli(
    results: Results,
    save_path: Path,
    prefix: str,
    *,
    summarize: bool = True,
) -> None:
    """verify (exit 0: no violation), then summarize, merge and list (reported)."""
    rc, stdout, stderr = run_cli(["verify", str(save_path), "--json"])
    try:
        report = json.loads(stdout)
    except json.JSONDecodeError:
        report = {"unparsed_stdout": stdout[-2000:]}
    results.data[f"{prefix}verify"] = {"exit": rc, "report": report, "stderr_tail": stderr[-1500:]}
    violations = report.get("violations", []) if isinstance(report, dict) else []
    notes = report.get("notes", []) if isinstance(report, dict) else []
    detail = (
        f"python -m profiling verify exit {rc}: {len(violations)} violations, {len(notes)} notes"
        + (f"; first violation: {violations[0]}" if violations else "")
        + (f"; stderr: {stderr.strip()[-300:]}" if rc not in (0, 1) else "")
    )
    results.expect(rc == 0, f"{prefix}verify", detail)
    if not summarize:
        return
    rc, stdout, stderr = run_cli(["summarize", str(save_path), "--json"])
    brief: list[dict[str, Any]] = []
    if rc == 0:
        for s in json.loads(stdout):
            for p in s["processes"]:
                brief.append(
                    {
                        "step": s["step"],
                        "process": p["key"],
                        "forward_steps": p["forward_steps"],
                        "forward_mean_ms": p["forward_mean_ms"],
                        "forward_max_ms": p["forward_max_ms"],
                        "overhead": p["overhead"],
                        "top_ops": p["ops"][:5],
                        "alignment": [a["source"] for a in p["alignment"]],
                    }
                )
    results.data[f"{prefix}summarize"] = {"exit": rc, "processes": brief, "stderr_tail": stderr[-800:]}
    results.expect(
        rc == 0 and bool(brief),
        f"{prefix}summarize",
        f"python -m profiling summarize exit {rc}, {len(brief)} process summaries",
    )
    rc, stdout, stderr = run_cli(["merge", str(save_path), "--json"])
    merged = json.loads(stdout) if rc == 0 else []
    results.data[f"{prefix}merge"] = {
        "exit": rc,
        "records": [{k: r.get(k) for k in ("status", "events", "bytes_in", "bytes_out", "skipped")} for r in merged],
        "stderr_tail": stderr[-800:],
    }
    results.expect(
        rc == 0 and all(r.get("status") == "ok" for r in merged),
        f"{prefix}merge",
        f"python -m profiling merge exit {rc}, {[r.get('events') for r in merged]} events",
    )
    rc, stdout, _ = run_cli(["list", str(save_path), "--json"])
    results.data[f"{prefix}list"] = {"exit": rc, "rows": json.loads(stdout) if rc == 0 else stdout[-800:]}


# -- part 3: the nsys backend -----------------------------------------------------------------------


def exercise_nsys(trainer: Trainer, save_path: Path, fit_steps: int) -> dict[str, Any]:
    """One window (step 1) through the nsys backend: cudaProfilerStart at the start, an NVTX range
    per mini-batch, cudaProfilerStop at the stop, and the note it exports. On the model thread."""
    store = TraceStore(save_path)
    options = ProfileOptions(tool="nsys")
    exporter = ThreadPoolExecutor(1, thread_name_prefix="trainer-export")
    session = new_session(store, exporter)
    nvtx_depths: list[int] = []
    try:
        mark_ranks(store, 1)
        t0 = time.perf_counter()
        session.start(SessionSpec(step=1, steps=[1], options=options), 0)
        start_s = time.perf_counter() - t0
        for _ in range(fit_steps):
            with session.forward_step(0):
                trainer.fit_step()
        # A range of our own, to read what NVTX answers: the depth, or a negative code (-2,
        # NVTX_NO_PUSH_POP_TRACKING, where no tool such as nsys is attached). Recorded, not judged.
        nvtx_depths.append(int(torch.cuda.nvtx.range_push("cuda_path_check nvtx probe")))
        nvtx_depths.append(int(torch.cuda.nvtx.range_pop()))
        t0 = time.perf_counter()
        session.stop(1)
        stop_s = time.perf_counter() - t0
        session.annotate(1, clock_offset=own_offset())
        entry = session.wait_exported(1, timeout=CLI_TIMEOUT_S)
    finally:
        exporter.shutdown(wait=True)
    return {
        "start_s": round(start_s, 4),
        "stop_s": round(stop_s, 4),
        "nvtx_probe_push_pop": nvtx_depths,
        "entry": None if entry is None else entry.model_dump(include={"status", "error", "files", "forward_steps"}),
        "manifest_status": (m.status if (m := store.refresh_manifest(1)) else None),
    }


def find_nsys() -> str | None:
    found = shutil.which("nsys")
    if found:
        return found
    for pattern in NSYS_GLOBS:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def _run_tail(cmd: list[str], timeout_s: int, cwd: Path) -> dict[str, Any]:
    """A command under a time limit: its exit status (124: timed out) and its output's tail."""
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=timeout_s)
        rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        raw = (e.stdout or b"") + (e.stderr or b"")
        rc, out = 124, raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    except OSError as e:
        rc, out = 127, repr(e)
    return {"cmd": " ".join(cmd), "exit": rc, "wall_s": round(time.perf_counter() - t0, 1), "tail": out[-1500:]}


def try_nsys_binary(work: Path, script_args: list[str], deadline: float) -> dict[str, Any]:
    """Run this script's nsys part in a child under `nsys profile` (capture range from the
    backend's cudaProfilerStart/Stop), then whatever importer can make a report of what it wrote.
    Reported only: nothing here can fail the run."""
    nsys = find_nsys()
    if nsys is None:
        return {"binary": None, "note": "no nsys on PATH or in " + ", ".join(NSYS_GLOBS)}
    out_dir = work / "nsys_binary"
    out_dir.mkdir(parents=True, exist_ok=True)
    report = out_dir / "capture"
    child = [sys.executable, str(Path(__file__).resolve()), str(out_dir / "child"), "--nsys-child", *script_args]
    cmd = [
        "timeout", str(NSYS_TIMEOUT_S), nsys, "profile", "--capture-range=cudaProfilerApi",
        "--capture-range-end=stop", "--trace=cuda,nvtx", "--sample=none", "--cpuctxsw=none",
        "--force-overwrite=true", "-o", str(report), *child,
    ]  # fmt: skip
    result: dict[str, Any] = {"binary": nsys, "version": _run_tail([nsys, "--version"], 20, work)["tail"].strip()}
    result["profile"] = _run_tail(cmd, NSYS_TIMEOUT_S + 10, ROOT)
    files = {p.name: p.stat().st_size for p in sorted(out_dir.rglob("*")) if p.is_file()}
    result["files"] = files
    qdstrm = next(iter(sorted(out_dir.glob("*.qdstrm"))), None)
    rep = next(iter(sorted(out_dir.glob("*.nsys-rep"))), None)
    importers = sorted(Path(nsys).parent.glob("QdstrmImporter*")) or sorted(
        Path(p) for p in glob.glob("/opt/nvidia/**/QdstrmImporter*", recursive=True)
    )
    result["importers_found"] = [str(p) for p in importers]
    importer = importers[0] if importers else None
    if rep is None and qdstrm is not None and importer is not None and time.monotonic() < deadline:
        result["import"] = _run_tail([str(importer), "-i", str(qdstrm)], IMPORTER_TIMEOUT_S, out_dir)
        rep = next(iter(sorted(out_dir.glob("*.nsys-rep"))), None)
    if rep is not None and time.monotonic() < deadline:
        stats = [nsys, "stats", "--report", "cuda_gpu_kern_sum,nvtx_sum", "--format", "csv", str(rep)]
        result["stats"] = _run_tail(stats, IMPORTER_TIMEOUT_S, out_dir)
    result["report_made"] = rep is not None
    return result


# -- part 4: the fork rule --------------------------------------------------------------------------


def fork_probe() -> dict[str, Any]:
    """can_fork() now, and what run_forked does with trivial work."""
    probe: dict[str, Any] = {"cuda_initialized": torch.cuda.is_initialized(), "can_fork": forked.can_fork()}
    try:
        probe["run_forked"] = forked.run_forked(lambda: {"pid": os.getpid()}, timeout_s=30)
        probe["run_forked_in_child"] = probe["run_forked"]["pid"] != os.getpid()
    except forked.ForkUnavailable as e:
        probe["run_forked"] = f"ForkUnavailable: {e}"
    return probe


def _child_touches_cuda(conn: Any) -> None:
    try:
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        conn.send("ok: the forked child used CUDA")
    except Exception as e:  # noqa: BLE001 - sent to the parent, which reports it
        conn.send(f"{type(e).__name__}: {e}")


def forked_child_uses_cuda() -> dict[str, Any]:
    """Fork anyway after CUDA is initialised and use CUDA in the child: what the rule prevents."""
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_touches_cuda, args=(child_end,), daemon=True)
    proc.start()
    answer = parent_end.recv() if parent_end.poll(30) else "no answer within 30 s"
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
    return {"child_said": answer[:400], "child_exit": proc.exitcode}


# -- part 5: overhead --------------------------------------------------------------------------------


def measure_overhead(
    trainer: Trainer, save_path: Path, options: ProfileOptions, rounds: int, per_window: int
) -> dict[str, Any]:
    """Rounds of three windows of `per_window` mini-batches: off (no profiling, no export
    running), on (inside a profiled window), and after (no profiling, the previous window's
    export still being written: on CUDA it runs in this process and holds the GIL). Off and on
    alternate which comes first. On the model thread."""
    store = TraceStore(save_path)
    exporter = ThreadPoolExecutor(1, thread_name_prefix="trainer-export")
    session = new_session(store, exporter)
    ms: dict[str, list[float]] = {"off": [], "on": [], "after_stop": []}
    start_s: list[float] = []
    stop_s: list[float] = []
    entries: list[ManifestEntry] = []

    def steps(mode: str) -> None:
        for _ in range(per_window):
            t0 = time.perf_counter()
            with session.forward_step(0):
                trainer.fit_step()
            ms[mode].append((time.perf_counter() - t0) * 1e3)

    try:
        for i in range(rounds):
            label = 100 + i
            order = ("off", "on") if i % 2 == 0 else ("on", "off")
            for mode in order:
                if mode == "off":
                    steps("off")
                    continue
                t0 = time.perf_counter()
                session.start(SessionSpec(step=label, steps=[label], options=options), 0)
                start_s.append(time.perf_counter() - t0)
                steps("on")
                t0 = time.perf_counter()
                session.stop(label)
                stop_s.append(time.perf_counter() - t0)
                steps("after_stop")
                entry = session.wait_exported(label, timeout=CLI_TIMEOUT_S)
                if entry is not None:
                    entries.append(entry)
    finally:
        exporter.shutdown(wait=True)

    def med(xs: list[float]) -> float:
        return round(statistics.median(xs), 4)

    off, on, after = med(ms["off"]), med(ms["on"]), med(ms["after_stop"])
    finalize = [e.finalize_s for e in entries if e.finalize_s is not None]
    export = [e.export_s for e in entries if e.export_s is not None]
    return {
        "rounds": rounds,
        "steps_per_window": per_window,
        "step_ms_median": {"off": off, "on": on, "after_stop": after},
        "step_ms_mean": {k: round(statistics.fmean(v), 4) for k, v in ms.items()},
        "step_ms_p90": {k: round(statistics.quantiles(v, n=10)[-1], 4) for k, v in ms.items() if len(v) >= 2},
        "ratio_on_over_off_median": round(on / off, 4),
        "ratio_after_stop_over_off_median": round(after / off, 4),
        "ratio_on_over_off_mean": round(statistics.fmean(ms["on"]) / statistics.fmean(ms["off"]), 4),
        "window_start_s_median": med(start_s),
        "window_stop_s_median": med(stop_s),
        "finalize_s_median": med(finalize) if finalize else None,
        "export_s_median": med(export) if export else None,
        "trace_mb_json_median": med([e.trace_mb for e in entries if e.trace_mb is not None]) if entries else None,
        "windows_ok": sum(e.status == "ok" for e in entries),
        # Whole window, start and stop included, over the same mini-batches unprofiled.
        "ratio_window_with_start_stop": round(
            (on * per_window + 1e3 * (statistics.median(start_s) + statistics.median(stop_s))) / (off * per_window), 4
        ),
    }


# -- the run ------------------------------------------------------------------------------------------


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder for summary.json and the copied traces (made if missing)")
    p.add_argument("--cpu", action="store_true", help="no GPU: activities [cpu], CUDA-only checks skipped")
    p.add_argument("--steps", type=int, default=4, help="versions trained (steps of the schedule)")
    p.add_argument("--profile", type=int, action="append", help="a profiled step (repeat; default 1 and 2)")
    p.add_argument("--fit-steps", type=int, default=8, help="mini-batches per step")
    p.add_argument("--rounds", type=int, default=12, help="overhead rounds")
    p.add_argument("--per-window", type=int, default=8, help="mini-batches per overhead window")
    p.add_argument("--d-model", type=int, default=None, help="default 1024 on the GPU, 64 on the CPU")
    p.add_argument("--layers", type=int, default=None, help="default 4 on the GPU, 2 on the CPU")
    p.add_argument("--batch", type=int, default=None, help="default 16 on the GPU, 4 on the CPU")
    p.add_argument("--seq", type=int, default=None, help="default 512 on the GPU, 32 on the CPU")
    p.add_argument("--work", type=Path, default=None, help="scratch folder for the save paths (default: a temp dir)")
    p.add_argument("--no-nsys-binary", action="store_true", help="skip running under an nsys binary")
    p.add_argument("--budget-s", type=float, default=240.0, help="optional parts are skipped past this")
    p.add_argument("--nsys-child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _shape(a: argparse.Namespace, cuda: bool) -> Shape:
    d = a.d_model or (1024 if cuda else 64)
    return Shape(
        d_model=d,
        layers=a.layers or (4 if cuda else 2),
        heads=max(1, d // 64),
        batch=a.batch or (16 if cuda else 4),
        seq=a.seq or (512 if cuda else 32),
        vocab=8192 if cuda else 512,
    )


def _copy_out(results: Results, store: TraceStore, manifests: dict[int, StepManifest], out: Path) -> None:
    """Each profiled step's manifest and trace into OUT_DIR, flat, if small enough."""
    copied = results.data.setdefault("files", [])
    for k, m in manifests.items():
        sources = [(store.step_dir(k) / "manifest.json", f"step_{k}.manifest.json")]
        sources += [(store.step_dir(k) / f, f"step_{k}.{Path(f).name}") for e in m.entries for f in e.files]
        for src, name in sources:
            if src.is_file() and src.stat().st_size <= MAX_COPY_BYTES:
                shutil.copyfile(src, out / name)
                copied.append({"name": name, "bytes": src.stat().st_size})


def nsys_child(a: argparse.Namespace) -> int:
    """The process `nsys profile` starts (try_nsys_binary): the nsys window, nothing else."""
    device = torch.device("cuda")
    trainer = Trainer(_shape(a, True), device)
    trainer.fit_step()  # warm-up outside the capture range
    print(json.dumps(exercise_nsys(trainer, a.out, 4), default=str), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.nsys_child:
        return nsys_child(a)
    t_begin = time.monotonic()
    deadline = t_begin + a.budget_s
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    work = a.work or Path(tempfile.mkdtemp(prefix="cuda-path-check-"))
    work.mkdir(parents=True, exist_ok=True)
    results = Results()
    cuda = not a.cpu
    profiled = sorted(set(a.profile or [1, 2]))

    # Part 4, first half: nothing has touched CUDA yet, so a fork is allowed and works.
    with guarded(results, "fork.before_cuda"):
        before = fork_probe()
        results.data["fork_before_cuda"] = before
        results.expect(
            not before["cuda_initialized"] and before["can_fork"] and before.get("run_forked_in_child") is True,
            "fork.before_cuda",
            f"cuda initialised {before['cuda_initialized']}, can_fork {before['can_fork']}, "
            f"run_forked {before['run_forked']}",
        )

    if cuda and not torch.cuda.is_available():
        results.expect(False, "device", "torch sees no CUDA device; run with --cpu on a machine without one")
        return _finish(results, out, t_begin)
    device = torch.device("cuda" if cuda else "cpu")
    results.data["device"] = {
        "name": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "host_cpus": os.cpu_count(),
    }
    results.info("device", json.dumps(results.data["device"]))
    quiet_kineto_env()
    init_kineto()  # on the thread that imported torch, before a profiler starts on the model thread
    spy = ExportSpy()
    spy.install()
    activities: list[Activity] = ["cpu", "cuda"] if cuda else ["cpu"]
    options = ProfileOptions(tool="torch", activities=activities)
    shape = _shape(a, cuda)
    results.data["shape"] = shape.__dict__
    model_thread = ThreadPoolExecutor(1, thread_name_prefix="trainer-model")
    trainer = model_thread.submit(Trainer, shape, device).result()
    results.data["parameters_m"] = round(sum(p.numel() for p in trainer.model.parameters()) / 1e6, 2)
    for _ in range(3):  # warm-up: allocator, cuBLAS handles, autotuning, outside any window
        model_thread.submit(trainer.fit_step).result()

    # Part 2: the step schedule, profiled as a trainer rank profiles it.
    store = TraceStore(work / "schedule")
    manifests: dict[int, StepManifest] = {}
    with guarded(results, "schedule.run"):
        ran = model_thread.submit(run_schedule, trainer, store, options, a.steps, profiled, a.fit_steps).result()
        results.data["schedule"] = {"steps": a.steps, "profiled": profiled, "fit_steps": a.fit_steps, **ran}
        medians = ran["step_ms_median"]
        results.info(
            "schedule.step_ms",
            "median mini-batch ms per step: "
            + ", ".join(f"{v}{'*' if v in profiled else ''}={t}" for v, t in medians.items())
            + " (* profiled)",
        )
    with guarded(results, "schedule.traces"):
        manifests = check_schedule(results, store, profiled, a.fit_steps, cuda)
    with guarded(results, "cli"):
        check_cli(results, store.root, "cli.")
    with guarded(results, "copy"):
        _copy_out(results, store, manifests, out)

    # Part 4, second half: CUDA is initialised now (on the GPU), so the rule must refuse a fork.
    with guarded(results, "fork.after_cuda"):
        after = fork_probe()
        exports = spy.as_dict()
        results.data["fork_after_cuda"] = after
        results.data["torch_exports"] = exports
        if cuda:
            results.expect(
                after["cuda_initialized"]
                and not after["can_fork"]
                and str(after["run_forked"]).startswith("ForkUnavailable"),
                "fork.after_cuda",
                f"cuda initialised {after['cuda_initialized']}, can_fork {after['can_fork']}, "
                f"run_forked {after['run_forked']}",
            )
            results.expect(
                exports["forked"] == 0 and exports["in_process"] >= len(profiled),
                "fork.torch_exports_in_process",
                f"torch exports so far: {exports}",
            )
            child = forked_child_uses_cuda()
            results.data["fork_child_uses_cuda"] = child
            results.info("fork.child_uses_cuda", f"a child forked anyway: {child}")
        else:
            results.info("fork.after_cuda", f"cpu run: {after}; torch exports so far: {exports}")

    # Part 3: the nsys backend's calls on the real device.
    if cuda:
        with guarded(results, "nsys.backend"):
            nsys = model_thread.submit(exercise_nsys, trainer, work / "nsys", a.fit_steps).result()
            results.data["nsys_backend"] = nsys
            entry = nsys["entry"] or {}
            results.expect(
                entry.get("status") == "ok"
                and entry.get("forward_steps") == a.fit_steps
                and nsys["manifest_status"] == "complete",
                "nsys.backend",
                f"cudaProfilerStart/Stop and {a.fit_steps} NVTX ranges ran: start {nsys['start_s']} s, "
                f"stop {nsys['stop_s']} s, NVTX probe push/pop returned {nsys['nvtx_probe_push_pop']} "
                f"(-2: no NVTX tool attached), entry {entry}, "
                f"manifest {nsys['manifest_status']}",
            )
            note = work / "nsys" / "step_1" / "trainer" / f"rank_{RANK}" / "nsys_capture.json"
            if note.is_file():
                shutil.copyfile(note, out / "nsys_capture.json")
            check_cli(results, work / "nsys", "nsys.", summarize=False)
        if a.no_nsys_binary or time.monotonic() > deadline - 2 * NSYS_TIMEOUT_S:
            results.info("nsys.binary", "skipped (--no-nsys-binary or too little time left)")
        else:
            with guarded(results, "nsys.binary", required=False):
                child_args = [f"--{k}={v}" for k, v in (("d-model", a.d_model), ("layers", a.layers)) if v]
                binary = try_nsys_binary(work, child_args, deadline)
                results.data["nsys_binary"] = binary
                results.info(
                    "nsys.binary",
                    f"{binary.get('binary')}: exit {binary.get('profile', {}).get('exit')}, "
                    f"files {binary.get('files')}, report made {binary.get('report_made')}",
                )
    else:
        results.info("nsys.backend", "cpu run: tool nsys needs a CUDA device (skipped)")

    # Part 5: the profiler's cost on the step time.
    with guarded(results, "overhead"):
        over = model_thread.submit(
            measure_overhead, trainer, work / "overhead", options, a.rounds, a.per_window
        ).result()
        results.data["overhead"] = over
        results.info(
            "overhead",
            f"median mini-batch ms off {over['step_ms_median']['off']}, on {over['step_ms_median']['on']}, "
            f"right after a stop {over['step_ms_median']['after_stop']}; ratio on/off "
            f"{over['ratio_on_over_off_median']}, after/off {over['ratio_after_stop_over_off_median']}; "
            f"window start {over['window_start_s_median']} s, stop {over['window_stop_s_median']} s, "
            f"export {over['export_s_median']} s",
        )
        results.expect(
            over["windows_ok"] == a.rounds,
            "overhead.windows",
            f"{over['windows_ok']}/{a.rounds} profiled overhead windows exported ok",
        )
    results.data["torch_exports_final"] = spy.as_dict()
    model_thread.shutdown(wait=True)
    return _finish(results, out, t_begin)


def _finish(results: Results, out: Path, t_begin: float) -> int:
    results.data["wall_s"] = round(time.monotonic() - t_begin, 1)
    summary = {
        "ok": not results.failed,
        "failed": results.failed,
        "checks": results.checks,
        **results.data,
    }
    text = json.dumps(summary, indent=2, default=str)
    (out / "summary.json").write_text(text + "\n")
    print(text, flush=True)
    return 1 if results.failed else 0


if __name__ == "__main__":
    sys.exit(main())
