"""Control-plane latency, measured side by side in one run.

* start+stop over HTTP with 1 and with 4 replicas, and their ratio (goal <= 1.2), two ways:
  - replicas idle: each cycle begins once the previous step's traces are written, so the
    figure is the fan-out of the control calls themselves (the goal's measure);
  - back to back: each start follows the previous stop at once and so waits for that stop's
    profiler finalize on every replica (what a sync pays when nothing runs in between; the
    finalize itself is the row below);
* a broadcast control call (`GET /profile/status`): with the 1-replica app alone on the cluster
  (goal <= 10 ms), then with both apps up, 1 and 4 replicas alternating; beside each, `GET
  /health`, the same HTTP path without a broadcast;
* the stop route's latency (the sync's critical path) against what runs off it: the profiler's
  finalize and the background trace export, from the step manifests.

Medians. The two apps run side by side on one cluster and their calls alternate (this machine's
timings drift between runs). Background merges are off: they run in child processes and are
not the control plane.

    python benchmarks/control_plane.py [--rounds 20] [--status-calls 100]
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
SIZES = (1, 4)
WARMUP = 3


def _cycle(c: httpx.Client, step: int, load: int) -> tuple[float, float]:
    """One profiled step: (start seconds, stop seconds)."""
    t0 = time.perf_counter()
    c.post("/profile/start", json={"step": step}).raise_for_status()
    t1 = time.perf_counter()
    for _ in range(load):
        c.post("/v1/completions", json={"prompt": ["One two", "Red green"], "max_tokens": 8}).raise_for_status()
    t2 = time.perf_counter()
    c.post("/profile/stop", json={"step": step}).raise_for_status()
    return t1 - t0, time.perf_counter() - t2


def _wait_settled(store: TraceStore, steps: list[int], timeout_s: float = 300, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ms = [store.read_manifest(k) for k in steps]
        if all(m is not None and m.status in ("complete", "partial") for m in ms):
            return
        time.sleep(poll_s)
    raise TimeoutError(f"steps {steps} did not settle within {timeout_s:.0f}s")


def _alternating(rounds: int):
    """(round, size) pairs, the sizes' order alternating per round (no drift bias)."""
    for i in range(rounds):
        for n in SIZES if i % 2 == 0 else reversed(SIZES):
            yield i, n


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1000:.1f}" if xs else "-"


def _ratio(xs: dict[int, list[float]]) -> str:
    return f"{statistics.median(xs[4]) / statistics.median(xs[1]):.2f}"


def _timed_get(c: httpx.Client, path: str) -> float:
    t0 = time.perf_counter()
    c.get(path).raise_for_status()
    return time.perf_counter() - t0


def main(
    rounds: int = typer.Option(20, help="Cycles per app and way (after 3 warm-up cycles)."),
    status_calls: int = typer.Option(100, help="GET /profile/status calls per app (after 10 warm-up calls)."),
) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-control-"))
    model = ensure_tiny_model(cache_dir=tmp / "model")
    idle: dict[int, list[float]] = {n: [] for n in SIZES}
    back_to_back: dict[int, list[float]] = {n: [] for n in SIZES}
    stops: list[float] = []
    status: dict[int, list[float]] = {n: [] for n in SIZES}
    health: list[float] = []
    alone: list[float] = []
    alone_health: list[float] = []
    with local_cluster() as port:
        clients, stores = {}, {}
        for n in SIZES:
            save = tmp / f"traces{n}"
            url = run_app(
                port,
                f"r{n}",
                {
                    "num_replicas": n,
                    "replica_num_cpus": 0.25,
                    "save_path": str(save),
                    "weights_dir": str(tmp / "weights"),
                    "model_path": str(model),
                    "min_free_disk_mb": 1,
                    "merge_on_complete": False,
                },
                route_prefix=f"/r{n}",
            )
            clients[n], stores[n] = httpx.Client(base_url=url, timeout=60), TraceStore(save)
            if n == 1:  # before the 4-replica app exists: the goal's "with 1 replica"
                for i in range(10 + status_calls):
                    took, bare = _timed_get(clients[1], "/profile/status"), _timed_get(clients[1], "/health")
                    if i >= 10:
                        alone.append(took)
                        alone_health.append(bare)
        step = dict.fromkeys(SIZES, 0)

        def cycle(n: int) -> float:
            step[n] += 1
            start_s, stop_s = _cycle(clients[n], step[n], load=2)
            stops.append(stop_s)
            return start_s + stop_s

        for i, n in _alternating(WARMUP + rounds):
            if step[n]:
                _wait_settled(stores[n], [step[n]])
            took = cycle(n)
            if i >= WARMUP:
                idle[n].append(took)
        for i, n in _alternating(WARMUP + rounds):
            took = cycle(n)
            if i >= WARMUP:
                back_to_back[n].append(took)
        for n in SIZES:
            _wait_settled(stores[n], list(range(1, step[n] + 1)))
        for i, n in _alternating(10 + status_calls):
            took = _timed_get(clients[n], "/profile/status")
            if i >= 10:
                status[n].append(took)
                if n == 1:
                    health.append(_timed_get(clients[1], "/health"))
    entries = [e for n in SIZES for k in stores[n].steps() if (m := stores[n].read_manifest(k)) for e in m.entries]
    finalize = [e.finalize_s for e in entries if e.finalize_s is not None]
    export = [e.export_s for e in entries if e.export_s is not None]

    table = Table(title=f"Control plane, embedded engine, {rounds} cycles per app and way (medians)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("start+stop, replicas idle, 1 replica (ms)", _ms(idle[1]))
    table.add_row("start+stop, replicas idle, 4 replicas (ms)", _ms(idle[4]))
    table.add_row("  ratio 4 / 1 (goal <= 1.2)", _ratio(idle))
    table.add_row("start+stop, back to back, 1 replica (ms)", _ms(back_to_back[1]))
    table.add_row("start+stop, back to back, 4 replicas (ms)", _ms(back_to_back[4]))
    table.add_row("  ratio 4 / 1", _ratio(back_to_back))
    table.add_row("GET /profile/status, 1-replica app alone (ms, goal <= 10)", _ms(alone))
    table.add_row("  GET /health, no broadcast (ms)", _ms(alone_health))
    table.add_row("GET /profile/status, both apps up, 1 replica (ms)", _ms(status[1]))
    table.add_row("GET /profile/status, both apps up, 4 replicas (ms)", _ms(status[4]))
    table.add_row("  GET /health, no broadcast (ms)", _ms(health))
    table.add_row("stop route, HTTP round trip (ms)", _ms(stops))
    table.add_row("  off the critical path: profiler finalize (ms)", _ms(finalize))
    table.add_row("  off the critical path: trace export (ms)", _ms(export))
    console.print(table)


if __name__ == "__main__":
    typer.run(main)
