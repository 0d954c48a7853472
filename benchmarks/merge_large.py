"""Merge a step with large synthetic traces and report peak memory and throughput.

Writes a step of one trainer rank and several rollout replicas (Kineto-shaped Chrome traces:
forward-step ranges with nested CPU ops, GPU kernels on streams, flow events, clock markers with
known clock errors) totalling at least --total-mb on disk, then merges it in a child process
(`python -m profiling merge`) and prints:

* peak RSS of the merging process (its own ru_maxrss, from wait4) over the largest input's size
  on disk (goal <= 3). The inputs are uncompressed `.pt.trace.json` files (as vLLM writes them
  without gzip), so the size on disk is the size of the JSON text a non-streaming merge would
  have to hold.
* throughput: input bytes on disk over the merge's wall time (MB/s), end to end (process start,
  imports, the clock-marker search, the copy, gzip output), and per core: over the CPU time
  (user + system) the merging process used (goal >= 100 MB/s per core).

    python benchmarks/merge_large.py [--total-mb 520] [--replicas 4] [--keep]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import typer
from rich.console import Console

from profiling.config import ProfileOptions
from profiling.manifest import (
    ClockSample,
    ClockSync,
    ManifestEntry,
    SessionRecord,
    SyncCost,
)
from profiling.markers import format_forward_step
from profiling.store import MERGED_TRACE, TraceStore

console = Console()
BASE_NS = 1_790_857_026_000_000_000
T0_NS = 1_795_000_000_000_000_000
OPS = [
    "aten::linear",
    "aten::addmm",
    "aten::mm",
    "aten::add",
    "aten::mul",
    "aten::silu",
    "aten::softmax",
    "aten::layer_norm",
    "aten::copy_",
    "aten::empty",
    "aten::view",
    "aten::transpose",
    "aten::cat",
]
KERNELS = ["ampere_sgemm_128x64_tn", "void at::native::vectorized_elementwise_kernel<4>", "flash_fwd_kernel"]


def _event(f: IO[str], first: list[bool], text: str) -> None:
    f.write(text if first[0] else ",\n" + text)
    first[0] = False


def write_trace(
    path: Path, pid: int, target_bytes: int, clock_error_ns: int, step: int, version: int
) -> dict:
    """A Kineto-shaped trace of about `target_bytes`, written as it is generated; returns its
    entry fields."""
    to_ts = lambda wall_ns: (wall_ns - clock_error_ns - BASE_NS) / 1000  # noqa: E731 - trace clock
    t = T0_NS + 1_000_000
    started = t
    first = [True]
    samples = {}
    with open(path, "w") as f:
        f.write('{\n  "schemaVersion": 1,\n  "deviceProperties": [],\n  "displayTimeUnit": "ms",\n')
        f.write(f'  "baseTimeNanoseconds": {BASE_NS},\n  "traceEvents": [\n')
        for name, value in (("process_name", '"python"'), ("process_labels", '"CPU"')):
            key = "name" if name == "process_name" else "labels"
            _event(
                f,
                first,
                f'  {{"ph": "M", "name": "{name}", "ts": {to_ts(t):.3f}, '
                f'"pid": {pid}, "tid": 0, "args": {{"{key}": {value}}}}}',
            )
        _event(
            f,
            first,
            f'  {{"ph": "M", "name": "process_labels", "ts": {to_ts(t):.3f}, '
            '"pid": 0, "tid": 0, "args": {"labels": "GPU 0"}}',
        )
        marker = f"clock_sync start pid={pid}"
        _event(
            f,
            first,
            f'  {{"ph": "X", "cat": "user_annotation", "name": "{marker}", '
            f'"pid": {pid}, "tid": {pid}, "ts": {to_ts(t):.3f}, "dur": 10.000}}',
        )
        samples["start"] = ClockSample(marker=marker, wall_before_ns=t - 20_000, wall_after_ns=t + 30_000)
        t += 100_000
        i = corr = 0
        while f.tell() < target_bytes:
            fwd_start = t
            body = []
            for j in range(40):
                op = OPS[(i + j) % len(OPS)]
                corr += 1
                body.append(
                    f'  {{\n    "ph": "X", "cat": "cpu_op", "name": "{op}", "pid": {pid}, "tid": {pid},\n'
                    f'    "ts": {to_ts(t):.3f}, "dur": 30.000,\n'
                    f'    "args": {{\n      "External id": {corr}, "Record function id": 0, "Ev Idx": {corr},\n'
                    f'      "Input Dims": [[8, 128], [128, 128]], "Input type": ["float", "float"]\n    }}\n  }}'
                )
                body.append(
                    f'  {{"ph": "X", "cat": "cpu_op", "name": "aten::empty", "pid": {pid}, "tid": {pid}, '
                    f'"ts": {to_ts(t + 2_000):.3f}, "dur": 5.000, "args": {{"External id": {corr}}}}}'
                )
                body.append(
                    f'  {{"ph": "X", "cat": "kernel", "name": "{KERNELS[j % 3]}", "pid": 0, "tid": 7, '
                    f'"ts": {to_ts(t + 10_000):.3f}, "dur": 18.000, '
                    f'"args": {{"correlation": {corr}, "stream": 7, "grid": [128, 1, 1]}}}}'
                )
                body.append(
                    f'  {{"ph": "s", "id": {corr}, "pid": {pid}, "tid": {pid}, '
                    f'"ts": {to_ts(t):.3f}, "cat": "ac2g", "name": "ac2g"}}'
                )
                body.append(
                    f'  {{"ph": "f", "id": {corr}, "pid": 0, "tid": 7, '
                    f'"ts": {to_ts(t + 10_000):.3f}, "cat": "ac2g", "name": "ac2g", "bp": "e"}}'
                )
                t += 40_000
            name = format_forward_step(i, step, version)
            _event(
                f,
                first,
                f'  {{"ph": "X", "cat": "user_annotation", "name": "{name}", "pid": {pid}, "tid": {pid}, '
                f'"ts": {to_ts(fwd_start - 1_000):.3f}, "dur": {(t - fwd_start + 2_000) / 1000:.3f}}}',
            )
            for text in body:
                _event(f, first, text)
            t += 50_000
            i += 1
        marker = f"clock_sync stop pid={pid}"
        _event(
            f,
            first,
            f'  {{"ph": "X", "cat": "user_annotation", "name": "{marker}", '
            f'"pid": {pid}, "tid": {pid}, "ts": {to_ts(t):.3f}, "dur": 10.000}}',
        )
        samples["stop"] = ClockSample(marker=marker, wall_before_ns=t - 20_000, wall_after_ns=t + 30_000)
        f.write("\n  ]\n}\n")
    return {
        "pid": pid,
        "forward_steps": i,
        "started_at": started / 1e9,
        "stopped_at": (t + 100_000) / 1e9,
        "clock": ClockSync(**samples),
        "weight_version": version,
        "weight_versions": [version],
    }


def build_step(root: Path, total_mb: int, replicas: int) -> TraceStore:
    """Step 1 under `root`: the trainer and `replicas` replicas, unequal sizes, ≥ total_mb."""
    store = TraceStore(root)
    weights = [1.0] + [1.0 + 0.5 * i for i in range(replicas)]  # the last replica's trace is largest
    sizes = [int(total_mb * 2**20 * w / sum(weights)) + 2**20 for w in weights]
    store.write_session(
        1,
        SessionRecord(
            step=1,
            steps=[1],
            tool="torch",
            options=ProfileOptions(),
            started_at=T0_NS / 1e9,
            stopped_at=T0_NS / 1e9 + 600,
            replicas=[f"r{i}" for i in range(replicas)],
        ),
    )
    name = "trace.pt.trace.json"
    identities = [ManifestEntry(role="trainer", rank=0)] + [
        ManifestEntry(role="rollout", replica_id=f"r{i}", node_id=f"node{i % 2}") for i in range(replicas)
    ]
    for n, (identity, size) in enumerate(zip(identities, sizes, strict=True)):
        out = store.entry_dir(1, identity)
        out.mkdir(parents=True, exist_ok=True)
        fields = write_trace(
            out / name, 4000 + n, size, clock_error_ns=(n - 2) * 3_000_000, step=1, version=0
        )
        entry = identity.model_copy(
            update={**fields, "files": [store.relative(1, out / name)], "bytes": (out / name).stat().st_size}
        )
        if identity.role == "trainer":
            entry.sync = SyncCost(
                stop_s=0.05, update_s=0.4, start_s=0.03, began_at=fields["stopped_at"] + 0.01
            )
        store.write_entry(1, entry)
    store.refresh_manifest(1)
    return store


def run_child(cmd: list[str]) -> tuple[float, float, int, int]:
    """(wall seconds, CPU seconds, peak RSS bytes, exit code) of one child process, measured by
    wait4."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    cpu = usage.ru_utime + usage.ru_stime
    return time.perf_counter() - t0, cpu, usage.ru_maxrss * 1024, proc.returncode  # Linux: ru_maxrss in KiB


def main(
    total_mb: int = typer.Option(520, help="Total size of the inputs on disk (MB)."),
    replicas: int = typer.Option(4, help="Rollout replicas (plus one trainer rank)."),
    keep: bool = typer.Option(False, help="Keep the generated step directory."),
) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-merge-"))
    free_mb = shutil.disk_usage(tmp).free / 2**20
    need_mb = total_mb * 2  # inputs, and at most as much again for the output
    if free_mb < need_mb:
        shutil.rmtree(tmp)
        console.print(
            f"[red]error:[/red] {tmp.parent} has {free_mb:.0f} MiB free, needs ~{need_mb} MiB; set TMPDIR elsewhere"
        )
        raise typer.Exit(2)
    try:
        t0 = time.perf_counter()
        store = build_step(tmp / "profile", total_mb, replicas)
        files = sorted(store.step_dir(1).rglob("trace.pt.trace.json"))
        sizes = {p: p.stat().st_size for p in files}
        total, largest = sum(sizes.values()), max(sizes.values())
        console.print(
            f"generated {len(files)} traces, {total / 1e6:.0f} MB on disk (largest {largest / 1e6:.0f} MB) "
            f"in {time.perf_counter() - t0:.0f} s under {tmp}"
        )
        env_python = [sys.executable, "-m", "profiling"]
        _, base_cpu, base_rss, _ = run_child([sys.executable, "-c", "import profiling.cli"])
        wall, cpu, rss, code = run_child([*env_python, "merge", str(store.root), "--step", "1"])
        if code != 0:
            console.print(f"[red]error:[/red] the merge exited {code}")
            raise typer.Exit(1)
        record = store.read_merge(1)
        merged = store.step_dir(1) / MERGED_TRACE
        offsets = ", ".join(f"{a.key} {a.offset_ns / 1e6:+.1f} ms" for a in record.processes)
        console.print(
            f"merged {record.events:,} events into {merged.stat().st_size / 1e6:.0f} MB in {wall:.1f} s; "
            f"clock offsets: {offsets}"
        )
        console.print(
            f"peak RSS of the merge: {rss / 2**20:.0f} MiB (imports alone: {base_rss / 2**20:.0f} MiB)"
        )
        console.print(
            f"peak RSS / largest input (uncompressed JSON on disk, {largest / 2**20:.0f} MiB): "
            f"[bold]{rss / largest:.2f}[/bold] (goal <= 3)"
        )
        console.print(
            f"throughput: [bold]{total / 1e6 / wall:.1f} MB/s[/bold] of input on disk, end to end; "
            f"per core: [bold]{total / 1e6 / cpu:.1f} MB/s[/bold] over {cpu:.2f} CPU s (goal >= 100; "
            f"{total / 1e6 / max(cpu - base_cpu, 1e-9):.1f} MB/s less the {base_cpu:.2f} CPU s of starting "
            "Python and importing)"
        )
    finally:
        if keep:
            console.print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    typer.run(main)
