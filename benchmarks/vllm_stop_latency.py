"""The profiled weight sync's critical path on vLLM, this app against Ray Serve LLM, side by side in
one run: the app's `POST /profile/stop {"step": k, "pause": true}` followed at once by
`POST /profile/start {"step": k+1}` (the sync's stop + start; the weight update between them,
which both would pay, left out) against Ray Serve LLM's `stop_profile`, whose trace flush runs
inline in vLLM, on its critical path.

* the app: the first application of `--config` (default config/serve.vllm.yaml: `tool: torch`,
  the profiler in vLLM's workers) with `--replicas` replicas on a private local Ray bound to
  127.0.0.1 (`trainer/local_app.py`), driven by the trainer's own `RolloutClient`;
* Ray Serve LLM's development app on vLLM on CPU with vLLM's torch profiler on and
  `/start_profile`, `/stop_profile` routes (benchmarks/ray_serve_llm_app.py `--profile-dir`),
  `--replicas` replicas, run by the Python `--python` of an environment where `ray.serve.llm`
  imports with the vLLM its Ray pins, on its own private Ray; by default with vLLM's profiler
  settings closest to the app's (no stacks, no gzip, no time table, no frontend trace), with
  vLLM's defaults under `--vllm-profiler-defaults`.

Both serve the same tiny model with the config's engine settings and `replica_env`. Each round,
with both recording: the same batch of completions (`--requests` requests x `--max-tokens`
tokens, `ignore_eos`) through each, then, in an order that alternates between rounds, Ray Serve
LLM's stop and the app's stop (pause) + start. Then the app records one more batch and stops
without pause (the stop alone, timed) and starts (timed); records one more, stops with pause and
starts 0.5 s later (timed: a start that finds the stop's finalize done); and Ray Serve LLM starts
again (timed), for the next round.

    python benchmarks/vllm_stop_latency.py --python P [--rounds 6] [--replicas 1] [--requests 8]
        [--max-tokens 32] [--config config/serve.vllm.yaml] [--vllm-profiler-defaults]
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import httpx
import typer
import yaml
from rich.console import Console
from rollout_throughput import VLLM_ENV, Load, _wait_ready, ray_serve_llm_command, reference_server, rounds_table

from serve_app.app import parse_args
from serve_app.net import free_port
from serve_app.tiny_model import ensure_tiny_model
from trainer.client import RolloutClient
from trainer.local_app import local_cluster, run_app

console = Console()
APP, RSLLM = "app", "Ray Serve LLM"
SETTLE_S = 0.5
"""A start this long after a paused stop finds the stop's finalize done: it shows what a start
costs on its own."""
MEASURES = {
    "rsllm_stop": f"{RSLLM}: stop_profile",
    "app_stop_pause": f"{APP}: stop (pause)",
    "app_start": f"{APP}: start after it",
    "app_sync": f"{APP}: stop (pause) + start",
    "app_stop": f"{APP}: stop (no pause)",
    "app_start_after_stop": f"{APP}: start after that",
    "app_start_later": f"{APP}: start {SETTLE_S} s after a stop (pause)",
    "rsllm_start": f"{RSLLM}: start_profile",
}


async def _timed(call: Awaitable[Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = await call
    return time.perf_counter() - t0, out


async def _post(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> None:
    r = await http.post(path, json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{RSLLM}: {path} answered {r.status_code}: {r.text[:300]}")


async def _batch(http: httpx.AsyncClient, body: dict[str, Any], requests: int) -> None:
    async def one() -> None:
        r = await http.post("/v1/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{http.base_url}: /v1/completions answered {r.status_code}: {r.text[:300]}")

    await asyncio.gather(*(one() for _ in range(requests)))


def _trace_bytes(d: Path) -> int:
    """What vLLM wrote into its profile directory (emptied for the next round)."""
    files = [p for p in d.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    for p in files:
        p.unlink()
    return size


async def _measure(
    app_url: str, rsllm_url: str, model: str, body: dict[str, Any], rounds: int, requests: int, profile_dir: Path
) -> tuple[dict[str, list[float]], list[int], list[float]]:
    times: dict[str, list[float]] = {k: [] for k in MEASURES}
    rsllm_bytes: list[int] = []
    server_critical: list[float] = []
    limits = httpx.Limits(max_connections=requests + 2)
    timeout = httpx.Timeout(300, connect=10)
    async with (
        RolloutClient(app_url) as app,
        httpx.AsyncClient(base_url=app_url, timeout=timeout, limits=limits) as app_http,
        httpx.AsyncClient(base_url=rsllm_url, timeout=timeout, limits=limits) as rsllm,
    ):
        # Ray Serve LLM answers /v1/models before its engine is up: a completion waits for it.
        await _batch(rsllm, {**body, "max_tokens": 2}, 1)
        step = 1
        # Warm-up, outside the figures: both record a batch and stop once.
        await app.start_profile(step)
        await _post(rsllm, "/start_profile", {"model": model})
        await _batch(app_http, body, requests)
        await _batch(rsllm, body, requests)
        await app.stop_profile(step)
        await _post(rsllm, "/stop_profile", {"model": model})
        _trace_bytes(profile_dir)
        step += 1
        await app.start_profile(step)
        await _post(rsllm, "/start_profile", {"model": model})
        for i in range(rounds):
            await _batch(app_http, body, requests)
            await _batch(rsllm, body, requests)

            async def rsllm_stop() -> None:
                took, _ = await _timed(_post(rsllm, "/stop_profile", {"model": model}))
                times["rsllm_stop"].append(took)

            async def app_sync(k: int) -> None:
                stop_s, stopped = await _timed(app.stop_profile(k, pause=True))
                start_s, _ = await _timed(app.start_profile(k + 1))
                times["app_stop_pause"].append(stop_s)
                times["app_start"].append(start_s)
                times["app_sync"].append(stop_s + start_s)
                if stopped.critical_path_s is not None:
                    server_critical.append(stopped.critical_path_s)

            for part in (rsllm_stop(), app_sync(step)) if i % 2 == 0 else (app_sync(step), rsllm_stop()):
                await part
            step += 1
            rsllm_bytes.append(_trace_bytes(profile_dir))
            # The stop without pause, on the window the sync just opened.
            await _batch(app_http, body, requests)
            took, _ = await _timed(app.stop_profile(step))
            times["app_stop"].append(took)
            step += 1
            took, _ = await _timed(app.start_profile(step))
            times["app_start_after_stop"].append(took)
            await _batch(app_http, body, requests)
            await app.stop_profile(step, pause=True)
            await asyncio.sleep(SETTLE_S)
            step += 1
            took, _ = await _timed(app.start_profile(step))
            times["app_start_later"].append(took)
            took, _ = await _timed(_post(rsllm, "/start_profile", {"model": model}))
            times["rsllm_start"].append(took)
            console.print(
                f"  round {i + 1}: {RSLLM} stop {times['rsllm_stop'][-1]:.3f} s; {APP} stop (pause) "
                f"{times['app_stop_pause'][-1]:.3f} + start {times['app_start'][-1]:.3f} s, stop (no pause) "
                f"{times['app_stop'][-1]:.3f} s"
            )
        await app.stop_profile(step)
        await _post(rsllm, "/stop_profile", {"model": model})
    return times, rsllm_bytes, server_critical


def main(
    python: str = typer.Option(
        ..., help="The Python of an environment where ray.serve.llm imports with the vLLM its Ray pins."
    ),
    rounds: int = typer.Option(6, min=1, help="Measured rounds (after one warm-up)."),
    replicas: int = typer.Option(1, min=1, help="Replicas of each app."),
    requests: int = typer.Option(8, min=1, help="Completions recorded per window, all in flight at once."),
    max_tokens: int = typer.Option(32, min=1, help="max_tokens of each completion (ignore_eos)."),
    config: str = typer.Option("config/serve.vllm.yaml", help="The app's Serve config."),
    vllm_profiler_defaults: bool = typer.Option(
        False, help="Ray Serve LLM's vLLM profiler with vLLM's defaults (stacks, gzip, time table, frontend)."
    ),
) -> None:
    os.environ.update({k: os.environ.get(k, v) for k, v in VLLM_ENV.items()})
    spec = yaml.safe_load(Path(config).read_text())["applications"][0]
    cfg_args = spec.get("args", {})
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-stop-"))
    args = {
        **cfg_args,
        "num_replicas": replicas,
        "save_path": str(work / "traces"),
        "weights_dir": str(work / "weights"),
    }
    parsed = parse_args(args)
    args["model_path"] = parsed.model_path or str(ensure_tiny_model(parsed.tiny_model))
    profile_dir = work / "rsllm-profile"
    profile_dir.mkdir()
    rsllm_port = free_port()
    cmd = ray_serve_llm_command(
        python, args["model_path"], parsed.model_name, parsed.vllm, rsllm_port, parsed.replica_num_cpus
    )
    cmd += ["--num-replicas", str(replicas), "--profile-dir", str(profile_dir)]
    if vllm_profiler_defaults:
        cmd.append("--vllm-profiler-defaults")
    rsllm_url = f"http://127.0.0.1:{rsllm_port}"
    log = work / "ray_serve_llm.log"
    load = Load(clients=requests, prompts=1, max_tokens=max_tokens, logprobs=None)
    body = load.body(parsed.model_name, ignore_eos=True)
    console.print(f"starting the app ({config}) and {RSLLM}, {replicas} replica(s) each ...")
    # Ray first: its head gives up after 30 s when the machine is busy starting vLLM as well.
    with local_cluster() as port, reference_server(cmd, {**VLLM_ENV, **cfg_args.get("replica_env", {})}, log) as proc:
        app_url = run_app(port, spec.get("name", "rollout"), args)
        _wait_ready(rsllm_url, proc, log)
        times, rsllm_bytes, server_critical = asyncio.run(
            _measure(app_url, rsllm_url, parsed.model_name, body, rounds, requests, profile_dir)
        )
    _print(times, rsllm_bytes, server_critical, replicas, requests, max_tokens, vllm_profiler_defaults)
    console.print(f"(working directory {work}: the app's step directories, {RSLLM}'s log)")


def _print(
    times: dict[str, list[float]],
    rsllm_bytes: list[int],
    server_critical: list[float],
    replicas: int,
    requests: int,
    max_tokens: int,
    vllm_defaults: bool,
) -> None:
    n = len(times["rsllm_stop"])
    title = f"Seconds, {replicas} replica(s) each, windows of {requests} requests x {max_tokens} tokens, {n} rounds"
    rows = [(label, times[key], ".3f") for key, label in MEASURES.items()]
    ratios = [a / b for a, b in zip(times["app_sync"], times["rsllm_stop"], strict=True)]
    rows.append(("app stop+start / RSLLM stop", ratios, ".2f"))
    console.print(rounds_table(title, "call", "r", rows))
    ratio = statistics.median(times["app_sync"]) / statistics.median(times["rsllm_stop"])
    console.print(
        f"{APP} stop (pause) + start / {RSLLM} stop_profile (medians): [bold]{ratio:.2f}x[/bold] (goal <= 0.5); "
        f"{APP} stop without pause / {RSLLM} stop: "
        f"{statistics.median(times['app_stop']) / statistics.median(times['rsllm_stop']):.2f}x"
    )
    if server_critical:
        console.print(
            f"{APP}'s stop (pause) as its replicas report it (critical_path_s, median): "
            f"{statistics.median(server_critical):.3f} s"
        )
    settings = "vLLM's defaults" if vllm_defaults else "the app's settings (no stack, no gzip, no table, no frontend)"
    console.print(
        f"{RSLLM}'s vLLM profiler: {settings}; trace written per stop (median): "
        f"{statistics.median(rsllm_bytes) / 2**20:.1f} MB"
    )


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    typer.run(main)
