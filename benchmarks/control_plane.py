"""Control-plane latency, measured side by side in one run.

* median start+stop latency over HTTP with 1 and with 4 replicas, and their ratio (goal <= 1.5);
* the stop route's latency (the sync's critical path) against what runs off it: the profiler's
  finalize and the background trace export, from the step manifests.

    python benchmarks/control_plane.py [--rounds 20]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.table import Table

from profiling.store import TraceStore
from serve_app.tiny_model import ensure_tiny_model
from trainer.local_app import local_cluster, run_app

console = Console()


def _cycle(c: httpx.Client, step: int, load: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    c.post("/profile/start", json={"step": step}).raise_for_status()
    t1 = time.perf_counter()
    for _ in range(load):
        c.post("/v1/completions", json={"prompt": ["One two", "Red green"], "max_tokens": 8}).raise_for_status()
    t2 = time.perf_counter()
    c.post("/profile/stop", json={"step": step}).raise_for_status()
    return t1 - t0, time.perf_counter() - t2


def _wait_settled(store: TraceStore, steps: list[int], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ms = [store.read_manifest(k) for k in steps]
        if all(m is not None and m.status in ("complete", "partial") for m in ms):
            return
        time.sleep(0.5)


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1000:.1f}" if xs else "-"


def main(rounds: int = typer.Option(20, help="Cycles per app (after 3 warm-up cycles).")) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-control-"))
    model = ensure_tiny_model(cache_dir=tmp / "model")
    sizes = (1, 4)
    with local_cluster() as port:
        urls, stores = {}, {}
        for n in sizes:
            save = tmp / f"traces{n}"
            urls[n] = run_app(
                port, f"r{n}",
                {"num_replicas": n, "replica_num_cpus": 0.25, "save_path": str(save),
                 "weights_dir": str(tmp / "weights"), "model_path": str(model), "min_free_disk_mb": 1},
                route_prefix=f"/r{n}",
            )
            stores[n] = TraceStore(save)
        startstop: dict[int, list[float]] = {n: [] for n in sizes}
        stops: dict[int, list[float]] = {n: [] for n in sizes}
        steps: dict[int, list[int]] = {n: [] for n in sizes}
        clients = {n: httpx.Client(base_url=urls[n], timeout=60) for n in sizes}
        step = 0
        for i in range(3 + rounds):
            for n in sizes if i % 2 == 0 else reversed(sizes):  # alternate order: no drift bias
                step += 1
                steps[n].append(step)
                start_s, stop_s = _cycle(clients[n], step, load=2)
                if i >= 3:
                    startstop[n].append(start_s + stop_s)
                    stops[n].append(stop_s)
        for n in sizes:
            _wait_settled(stores[n], steps[n])
    entries = [
        e for n in sizes for k in stores[n].steps() if (m := stores[n].read_manifest(k)) for e in m.entries
    ]
    finalize = [e.finalize_s for e in entries if e.finalize_s is not None]
    export = [e.export_s for e in entries if e.export_s is not None]

    table = Table(title=f"Control plane, embedded engine, {rounds} cycles per app (medians)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("start+stop, 1 replica (ms)", _ms(startstop[1]))
    table.add_row("start+stop, 4 replicas (ms)", _ms(startstop[4]))
    ratio = statistics.median(startstop[4]) / statistics.median(startstop[1])
    table.add_row("ratio 4 / 1 (goal <= 1.5)", f"{ratio:.2f}")
    table.add_row("stop route, HTTP round trip (ms)", _ms(stops[1] + stops[4]))
    table.add_row("  off the critical path: profiler finalize (ms)", _ms(finalize))
    table.add_row("  off the critical path: trace export (ms)", _ms(export))
    console.print(table)


if __name__ == "__main__":
    typer.run(main)
