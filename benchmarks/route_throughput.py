"""Generation through vLLM's token-in, token-out `/inference/v1/generate` and SGLang's native
`/generate` against the app's own `/v1/completions` with the same token-id prompts and sampling,
on one app, under the load RL rollouts bring (hundreds of single-prompt requests in flight),
measured side by side.

The app is the first application of `--config` (default config/serve.yaml: the embedded engine,
2 replicas) on a private local Ray bound to 127.0.0.1. Each run is `--clients` closed-loop
clients, each sending one request at a time of one distinct token-id prompt (tokenized once
through `/tokenize`), `--max-tokens` tokens at temperature 1 with `ignore_eos`, for `--seconds`.
Runs alternate between the routes, each run's order the previous one's rotated (completions,
generate, SGLang; generate, SGLang, completions; ...) after a warm-up of each, so the machine's
drift favours none. It prints output tokens/s and requests/s per run, the medians, each route's
ratio to completions (goal at least 0.95), and each route's median request latency.

    python benchmarks/route_throughput.py [--runs 6] [--seconds 15] [--clients 256] [--max-tokens 16]
        [--config config/serve.yaml] [--quick]
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import typer
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from trainer.local_app import local_rollout_app

console = Console()
COMPLETIONS, GENERATE, SGLANG = "/v1/completions", "/inference/v1/generate", "/generate"
ROUTES = (COMPLETIONS, GENERATE, SGLANG)


class Run(BaseModel):
    route: str
    tokens: int
    requests: int
    errors: int
    seconds: float
    latency_s: float
    """Median request latency."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def body(route: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """The same generation asked through any of the routes."""
    sampling = {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}
    if route == COMPLETIONS:
        return {"prompt": prompt, **sampling}
    if route == SGLANG:
        renamed = {"max_new_tokens" if k == "max_tokens" else k: v for k, v in sampling.items()}
        return {"input_ids": prompt, "sampling_params": renamed}
    return {"token_ids": prompt, "sampling_params": sampling}


def completion_tokens(route: str, answer: dict[str, Any]) -> int:
    """The output tokens an answer counts (SGLang's in its `meta_info`)."""
    return answer["meta_info"]["completion_tokens"] if route == SGLANG else answer["usage"]["completion_tokens"]


async def load(url: str, route: str, prompts: list[list[int]], max_tokens: int, seconds: float) -> Run:
    """`len(prompts)` closed-loop clients, one request each at a time, for `seconds`."""
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    tokens = requests = errors = 0
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        deadline = time.perf_counter() + seconds

        async def client(prompt: list[int]) -> None:
            nonlocal tokens, requests, errors
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                r = await http.post(route, json=body(route, prompt, max_tokens))
                if r.status_code != 200:
                    errors += 1
                    continue
                latencies.append(time.perf_counter() - t0)
                requests += 1
                tokens += completion_tokens(route, r.json())

        t0 = time.perf_counter()
        await asyncio.gather(*(client(p) for p in prompts))
        elapsed = time.perf_counter() - t0
    return Run(
        route=route,
        tokens=tokens,
        requests=requests,
        errors=errors,
        seconds=elapsed,
        latency_s=statistics.median(latencies) if latencies else float("nan"),
    )


async def tokenized(url: str, clients: int) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        answers = [
            (await http.post("/tokenize", json={"prompt": f"The rollout server answers question {i}"})).json()
            for i in range(clients)
        ]
    return [a["tokens"] for a in answers]


def main(
    runs: int = typer.Option(6, help="Load runs per route, alternating."),
    seconds: float = typer.Option(15.0, help="Seconds per load run."),
    clients: int = typer.Option(256, help="Concurrent closed-loop clients (requests in flight)."),
    max_tokens: int = typer.Option(16, help="max_tokens per request."),
    config: str = typer.Option("config/serve.yaml", help="Serve config whose first application is measured."),
    quick: bool = typer.Option(False, help="A smoke run: 2 runs of 5 s each, 32 clients."),
) -> None:
    if quick:
        runs, seconds, clients = 2, 5.0, 32
    tmp = Path(tempfile.mkdtemp(prefix="bench-routes-"))
    overrides = {"save_path": str(tmp / "traces"), "weights_dir": str(tmp / "weights")}
    results: list[Run] = []
    with local_rollout_app(config, overrides) as app:
        prompts = asyncio.run(tokenized(app.base_url, clients))
        for route in ROUTES:  # warm-up
            asyncio.run(load(app.base_url, route, prompts, max_tokens, min(seconds, 5.0)))
        for i in range(runs):
            for route in ROUTES[i % len(ROUTES) :] + ROUTES[: i % len(ROUTES)]:
                run = asyncio.run(load(app.base_url, route, prompts, max_tokens, seconds))
                console.print(
                    f"run {i + 1} {route}: {run.tokens_per_s:.0f} tokens/s, {run.requests / run.seconds:.1f} "
                    f"requests/s, median latency {run.latency_s:.2f} s, {run.errors} errors"
                )
                results.append(run)
    table = Table(title=f"{clients} clients x 1 prompt x {max_tokens} tokens, {runs} runs of {seconds:g} s")
    table.add_column("route")
    for i in range(runs):
        table.add_column(f"run {i + 1}", justify="right")
    table.add_column("median tokens/s", justify="right")
    table.add_column("median latency s", justify="right")
    medians: dict[str, float] = {}
    for route in ROUTES:
        mine = [r for r in results if r.route == route]
        medians[route] = statistics.median(r.tokens_per_s for r in mine)
        latency = statistics.median(r.latency_s for r in mine)
        table.add_row(route, *(f"{r.tokens_per_s:.0f}" for r in mine), f"{medians[route]:.0f}", f"{latency:.2f}")
    console.print(table)
    errors = sum(r.errors for r in results)
    console.print(
        f"generate / completions: {medians[GENERATE] / medians[COMPLETIONS]:.3f}, SGLang's generate / completions: "
        f"{medians[SGLANG] / medians[COMPLETIONS]:.3f} (goal at least 0.95 each); {errors} failed requests"
    )


if __name__ == "__main__":
    typer.run(main)
