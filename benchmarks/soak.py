"""Soak: many start/stop cycles under steady generation load, with periodic weight updates.

Each cycle profiles one step: start(k) -> a short window of generation -> stop(k). Every
`update_every` cycles the stop pauses and a weight update follows (as the trainer does). All
the while `clients` concurrent clients keep generating. At the end it reports failed requests
(goal 0), cycles whose manifest is not complete (goal 0), the stop's critical-path time (p50/p99,
HTTP round trip as the trainer sees it), and the file descriptors, threads and RSS of the app's
processes (replicas, ingress, controller, engine processes) sampled every tenth of the run (no growth trend:
the RSS slope is reported).

    python benchmarks/soak.py [--cycles 1000] [--clients 8] [--update-every 10] [--replica-env K=V]
                              [--config config/serve.vllm.yaml]   # another engine

Control calls go through the trainer's RolloutClient, so a start refused with 429 (earlier
steps' traces still exporting: the app's export backlog bound) is waited out as the trainer
would; the time starts spent waiting is reported. tests/integration/test_soak.py runs 100 cycles.
Figures from a 1000-cycle run: docs/operations.md, "Soak".
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Annotated

import httpx
import typer
from pydantic import BaseModel

from profiling.analysis.auto import MERGE_COMMAND
from profiling.store import TraceStore
from trainer.client import RolloutClient

PROMPTS = ["The rollout server answers", "Red green blue", "One two three", "The quick brown fox"]


class ProcessStats(BaseModel):
    """Summed over the app's Serve replica processes (rollout replicas, ingress and controller) and
    the engine processes they started (vLLM's EngineCore and workers); background merges, which
    come and go, are left out."""

    processes: int
    fds: int
    threads: int
    rss_mb: float


class StatsSample(BaseModel):
    """Process stats once `cycle` cycles (after warm-up) were done and every export had settled:
    sampled mid-export, RSS would swing by the recordings in flight, not by any trend."""

    cycle: int
    stats: ProcessStats


class SoakReport(BaseModel):
    cycles: int
    updates: int
    requests_ok: int
    requests_failed: int
    failures: list[str]
    incomplete_manifests: list[int]
    stop_p50_ms: float
    stop_p99_ms: float
    start_p50_ms: float
    start_p99_ms: float
    """Includes waiting out 429s while the export backlog is full."""
    samples: list[StatsSample]
    """After warm-up, every tenth of the run, and at the end."""
    rss_slope_mb_per_100_cycles: float
    """Least-squares slope of the samples' summed RSS over the second half of the run (the
    first half includes the allocators' climb to their working size)."""
    seconds: float

    @property
    def warm(self) -> ProcessStats:
        return self.samples[0].stats

    @property
    def end(self) -> ProcessStats:
        return self.samples[-1].stats


def _read_processes() -> dict[int, tuple[int, bytes, dict[str, str]]]:
    """pid -> (parent pid, argv as NUL-joined bytes, /proc status fields)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line)
            found[int(proc.name)] = (int(status["PPid"]), (proc / "cmdline").read_bytes(), status)
        except (FileNotFoundError, ProcessLookupError, PermissionError, KeyError):
            continue  # a process that ended while we looked
    return found


def app_process_stats(app_name: str) -> ProcessStats:
    """fds, threads and RSS of this machine's Serve replica processes of `app_name` and of the
    engine processes under them (/proc)."""
    marker = f"ray::ServeReplica:{app_name}:".encode()
    merge = b"\0".join(arg.encode() for arg in MERGE_COMMAND)
    processes = _read_processes()
    counted = {pid for pid, (_, argv, _) in processes.items() if argv.startswith(marker)}
    grew = True
    while grew:  # add descendants until none is left to add
        new = {pid for pid, (ppid, argv, _) in processes.items() if ppid in counted and merge not in argv}
        grew = bool(new - counted)
        counted |= new
    fds = threads = rss_kb = 0
    for pid in counted:
        status = processes[pid][2]
        try:
            fds += len(list(Path(f"/proc/{pid}/fd").iterdir()))
        except (FileNotFoundError, PermissionError):
            continue
        threads += int(status["Threads"].strip())
        rss_kb += int(status.get("VmRSS", "0 kB").split()[0])
    return ProcessStats(processes=len(counted), fds=fds, threads=threads, rss_mb=rss_kb / 1024)


async def _generate_forever(
    c: httpx.AsyncClient, i: int, stop: asyncio.Event, counts: dict, failures: list[str]
) -> None:
    n = 0
    while not stop.is_set():
        body = {"prompt": PROMPTS[(i + n) % len(PROMPTS)], "max_tokens": 8, "seed": n}
        n += 1
        try:
            r = await c.post("/v1/completions", json=body)
            if r.status_code == 200:
                counts["ok"] += 1
                continue
            failures.append(f"completion {r.status_code}: {r.text[:200]}")
        except httpx.HTTPError as e:
            failures.append(f"completion failed: {e!r}")
        counts["failed"] += 1


def _percentiles(samples: list[float]) -> tuple[float, float]:
    """p50 and p99 in milliseconds."""
    ordered = sorted(samples)
    return statistics.median(ordered) * 1000, ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000


async def soak(
    url: str,
    app_name: str,
    save_path: Path,
    weights_file: Path,
    weights_dir: Path,
    *,
    cycles: int,
    clients: int = 8,
    update_every: int = 10,
    window_s: float = 0.05,
    warmup_cycles: int = 5,
    first_step: int = 1,
    on_cycle=None,
) -> SoakReport:
    """Run the soak against a running app; `weights_file` is copied as each new version."""
    store = TraceStore(save_path)
    counts = {"ok": 0, "failed": 0}
    failures: list[str] = []
    stop_times: list[float] = []
    start_times: list[float] = []
    samples: list[StatsSample] = []
    sample_every = max(1, cycles // 10)
    done = asyncio.Event()
    t_start = time.perf_counter()
    limits = httpx.Limits(max_connections=clients + 4)
    async with (
        httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as c,
        RolloutClient(url, timeout_s=120.0) as control,
    ):
        gens = [asyncio.create_task(_generate_forever(c, i, done, counts, failures)) for i in range(clients)]
        version, updates = (await control.status()).weight_version, 0
        steps = []
        try:
            for i in range(warmup_cycles + cycles):
                done_cycles = i - warmup_cycles
                if done_cycles >= 0 and done_cycles % sample_every == 0:
                    await _wait_exports_settled(control)
                    samples.append(StatsSample(cycle=done_cycles, stats=app_process_stats(app_name)))
                step = first_step + i
                update = (i + 1) % update_every == 0
                t0 = time.perf_counter()
                await control.start_profile(step)
                t1 = time.perf_counter()
                await asyncio.sleep(window_s)
                t2 = time.perf_counter()
                await control.stop_profile(step, pause=update)
                if i >= warmup_cycles:
                    start_times.append(t1 - t0)
                    stop_times.append(time.perf_counter() - t2)
                    steps.append(step)
                if update:
                    version += 1
                    path = weights_dir / f"v{version}.safetensors"
                    shutil.copyfile(weights_file, path)
                    await control.update_weights(version, str(path))
                    (weights_dir / f"v{version - 1}.safetensors").unlink(missing_ok=True)
                    updates += 1
                if on_cycle:
                    on_cycle(i)
        finally:
            done.set()
            await asyncio.gather(*gens)
    incomplete = await asyncio.to_thread(_wait_manifests, store, steps)
    samples.append(StatsSample(cycle=cycles, stats=app_process_stats(app_name)))
    stop_p50, stop_p99 = _percentiles(stop_times)
    start_p50, start_p99 = _percentiles(start_times)
    return SoakReport(
        cycles=cycles,
        updates=updates,
        requests_ok=counts["ok"],
        requests_failed=counts["failed"],
        failures=failures[:20],
        incomplete_manifests=incomplete,
        stop_p50_ms=stop_p50,
        stop_p99_ms=stop_p99,
        start_p50_ms=start_p50,
        start_p99_ms=start_p99,
        samples=samples,
        rss_slope_mb_per_100_cycles=_rss_slope(samples[len(samples) // 2 :]) * 100,
        seconds=time.perf_counter() - t_start,
    )


async def _wait_exports_settled(control: RolloutClient, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(r.state == "exporting" for r in (await control.status()).replicas):
        if time.monotonic() > deadline:
            raise TimeoutError(f"replicas still exporting after {timeout_s:.0f} s")
        await asyncio.sleep(0.2)


def _rss_slope(samples: list[StatsSample]) -> float:
    """MB per cycle (0 with fewer than two samples)."""
    if len(samples) < 2:
        return 0.0
    return statistics.linear_regression([s.cycle for s in samples], [s.stats.rss_mb for s in samples]).slope


def _wait_manifests(store: TraceStore, steps: list[int], timeout_s: float = 300.0) -> list[int]:
    """Steps whose manifest is not `complete` once every export has settled (or timed out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        manifests = {k: store.read_manifest(k) for k in steps}
        settled = all(m is not None and m.status in ("complete", "partial") for m in manifests.values())
        if settled or time.monotonic() > deadline:
            return [k for k, m in manifests.items() if m is None or m.status != "complete"]
        time.sleep(0.5)


def main(
    cycles: int = typer.Option(1000, min=1),
    clients: int = typer.Option(8, min=1),
    update_every: int = typer.Option(10, min=1),
    replicas: int = typer.Option(2, min=1),
    config: Annotated[
        str,
        typer.Option(
            help="Serve config whose first application is soaked (e.g. config/serve.vllm.yaml); "
            "the soak sets its paths, model and replica count."
        ),
    ] = "config/serve.yaml",
    replica_env: Annotated[
        list[str] | None,
        typer.Option("--replica-env", help="KEY=VALUE for the replica processes, e.g. LD_PRELOAD=<libjemalloc.so.2>."),
    ] = None,
) -> None:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from serve_app.tiny_model import ensure_tiny_model
    from trainer.local_app import local_rollout_app

    console = Console()
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    model = ensure_tiny_model(cache_dir=tmp / "model")
    weights_dir = tmp / "weights"
    weights_dir.mkdir()
    overrides = {
        "num_replicas": replicas,
        "save_path": str(tmp / "traces"),
        "weights_dir": str(weights_dir),
        "model_path": str(model),
        "min_free_disk_mb": 1,
        "replica_env": dict(kv.split("=", 1) for kv in replica_env or []),
    }
    with local_rollout_app(config, overrides) as app, Progress(console=console) as progress:
        task = progress.add_task("soak cycles", total=cycles + 5)
        report = asyncio.run(
            soak(
                app.base_url,
                app.name,
                tmp / "traces",
                model / "model.safetensors",
                weights_dir,
                cycles=cycles,
                clients=clients,
                update_every=update_every,
                on_cycle=lambda _: progress.advance(task),
            )
        )
    table = Table(
        title=f"soak: {config} (engine {app.args.get('engine', 'transformers')}), {cycles} cycles, "
        f"{clients} clients, update every {update_every}"
    )
    table.add_column("measure")
    table.add_column("value")
    table.add_row(
        "failed requests (goal 0)", f"{report.requests_failed} of {report.requests_ok + report.requests_failed}"
    )
    table.add_row("incomplete manifests (goal 0)", str(len(report.incomplete_manifests)))
    table.add_row("weight updates", str(report.updates))
    table.add_row("stop p50 / p99 (ms)", f"{report.stop_p50_ms:.1f} / {report.stop_p99_ms:.1f}")
    table.add_row("start p50 / p99 (ms, incl. backlog waits)", f"{report.start_p50_ms:.1f} / {report.start_p99_ms:.1f}")
    for sample in report.samples:
        s = sample.stats
        table.add_row(
            f"cycle {sample.cycle}: fds / threads / RSS MB ({s.processes} procs)",
            f"{s.fds} / {s.threads} / {s.rss_mb:.0f}",
        )
    table.add_row("RSS slope, second half (MB per 100 cycles)", f"{report.rss_slope_mb_per_100_cycles:+.1f}")
    table.add_row("wall time (s)", f"{report.seconds:.0f}")
    console.print(table)
    for f in report.failures:
        console.print(f"[red]{f}[/red]")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    typer.run(main)
