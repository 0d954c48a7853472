"""The cost of the forward-step markers in vLLM's worker (serve_app/engines/vllm/worker.py):
output tokens/s with and without them, side by side in one run.

One `AsyncLLM` on the tiny model in this process, built with the project's worker extension plus
a benchmark-only switch (benchmarks/vllm_marker_ext.py). Four modes, each round running every
mode once in an order that alternates between rounds (forward, then reversed: no drift bias):

* `window`: a real window (`rollout_profiler_start` ... `rollout_profiler_stop`): the torch
  backend records and every engine iteration runs inside its `forward_step#<i>` range;
* `plain`: the same torch backend with the same options records, with no window open: the
  wrapper counts passes but marks none. window / plain is the markers' cost while profiling;
* `counting`: nothing records; the wrapper is installed and counts each pass by weight version,
  as on every iteration a replica runs unprofiled;
* `bare`: vLLM's own `execute_model`, the wrapper removed. counting / bare is what the extension
  costs an unprofiled engine.

The load is a closed loop of `--clients` requests in flight, each one prompt of fixed tokens,
`--max-tokens` tokens with `ignore_eos`, for `--seconds`; a round's figure is output tokens over
the time until its last request finishes. Starting and stopping a recording, and its export
(waited for before the next round), are outside the figures. Windows are unbounded
(`max_forward_steps: null`): one window per round, ended by the stop.

At the end, two probes timed on the worker's thread, without load: an empty forward-step range
while the backend records (a marker's own cost), and the wrapper around a no-op `execute_model`
outside any window (the counting's cost). Each, times the engine iterations per second of the
window rounds, is the share of the engine's time it takes, free of the load's run-to-run noise
(on a shared machine, the load's figures resolve a few percent at best).

    python benchmarks/vllm_marker_cost.py [--rounds 10] [--seconds 5] [--clients 8]
        [--max-tokens 64] [--omp-threads 1] [--quick]
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from pydantic import BaseModel
from rich.console import Console
from rollout_throughput import VLLM_ENV, rounds_table

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

console = Console()
HERE = Path(__file__).resolve().parent
MODES = ("window", "plain", "counting", "bare")
RATIOS = (("window", "plain"), ("counting", "bare"))
OPTIONS = {"activities": ["cpu"], "max_forward_steps": None, "max_duration_s": None, "max_trace_mb": None}
"""The recording of `window` and `plain`: the shipped config's, unbounded."""


class Round(BaseModel):
    tokens: int
    seconds: float
    forward_steps: int | None = None
    """Markers written (window rounds)."""
    trace_mb: float | None = None
    """The recording's trace JSON, as exported (window and plain rounds)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _prompts(clients: int) -> list[list[int]]:
    """One fixed prompt per client: 8 token ids of the tiny model's 512-token vocabulary."""
    return [[1 + (7 * c + j) % 500 for j in range(8)] for c in range(clients)]


async def _load(llm: AsyncLLM, prompts: list[list[int]], max_tokens: int, seconds: float) -> tuple[int, float]:
    """Closed loop: each client sends its next request when the previous one finishes; none
    after `seconds`; the time runs until the last one finishes. Returns (tokens, seconds)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0,
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    tokens = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds

    async def client(prompt: list[int]) -> None:
        nonlocal tokens
        while time.perf_counter() < deadline:
            async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=uuid.uuid4().hex):
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)

    await asyncio.gather(*(client(p) for p in prompts))
    return tokens, time.perf_counter() - t0


async def _wait_file(path: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the worker wrote no export record {path} within {timeout_s:.0f} s")
        await asyncio.sleep(0.05)


async def _round(
    llm: AsyncLLM, mode: str, n: int, work: Path, prompts: list[list[int]], max_tokens: int, seconds: float
) -> Round:
    """One round of `mode`; recordings are exported (and deleted) before it returns."""
    from serve_app.engines.vllm.worker import WorkerExport, export_record

    await llm.collective_rpc("marker_cost_wrapper", args=(mode != "bare",))
    prefix = f"{mode}{n}"
    if mode == "window":
        await llm.collective_rpc(
            "rollout_profiler_start", kwargs={"step": n, "options": OPTIONS, "prefix": prefix, "trace_dir": str(work)}
        )
    elif mode == "plain":
        await llm.collective_rpc("marker_cost_plain_start", args=(OPTIONS,))
    tokens, took = await _load(llm, prompts, max_tokens, seconds)
    result = Round(tokens=tokens, seconds=took)
    if mode == "window":
        (stopped, *_) = await llm.collective_rpc("rollout_profiler_stop")
        result.forward_steps = stopped["forward_steps"]
        record_path = export_record(work, prefix, 0)
        await _wait_file(record_path)
        record = WorkerExport.model_validate_json(record_path.read_text())
        if record.error is not None:
            raise RuntimeError(record.error)
        result.trace_mb = (record.trace_bytes or 0) / 2**20
        for p in work.glob(f"{prefix}.*"):
            p.unlink()
    elif mode == "plain":
        (size, *_) = await llm.collective_rpc("marker_cost_plain_stop", args=(str(work / prefix),))
        result.trace_mb = size / 2**20
    return result


def _build(model_dir: Path) -> AsyncLLM:
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm_marker_ext import EXTENSION

    return AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=str(model_dir),
            dtype="float32",
            max_model_len=256,
            enforce_eager=True,
            worker_extension_cls=EXTENSION,
        )
    )


class Probe(BaseModel):
    """The marker's own cost, timed in the worker away from the load."""

    us_per_marker: list[float]
    us_per_count: list[float]
    """What the wrapper adds to an iteration outside any window."""


async def _main(rounds: int, seconds: float, clients: int, max_tokens: int) -> tuple[dict[str, list[Round]], Probe]:
    from serve_app.tiny_model import ensure_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench-marker-cost-"))
    prompts = _prompts(clients)
    llm = _build(ensure_tiny_model())
    try:
        await llm.collective_rpc("rollout_profiler_attach", args=(0,))
        console.print("warm-up: one short round of each mode, outside the figures")
        for mode in MODES:
            await _round(llm, mode, 0, work, prompts, max_tokens, min(seconds, 2.0))
        results: dict[str, list[Round]] = {m: [] for m in MODES}
        for i in range(rounds):
            order = MODES if i % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                r = await _round(llm, mode, i + 1, work, prompts, max_tokens, seconds)
                results[mode].append(r)
                extra = f", {r.forward_steps} markers" if r.forward_steps is not None else ""
                extra += f", trace {r.trace_mb:.0f} MB" if r.trace_mb is not None else ""
                console.print(f"  round {i + 1} {mode:8s} {r.tokens_per_s:8.1f} tok/s ({r.tokens} tokens{extra})")
        probe = Probe(
            us_per_marker=[
                (await llm.collective_rpc("marker_cost_mark_us", args=(OPTIONS, 20_000)))[0] for _ in range(3)
            ],
            us_per_count=[(await llm.collective_rpc("marker_cost_wrapper_us", args=(200_000,)))[0] for _ in range(3)],
        )
        return results, probe
    finally:
        llm.shutdown()
        del llm  # its __del__ shuts down again: now, not at interpreter exit, where it fails
        shutil.rmtree(work, ignore_errors=True)


def _print(results: dict[str, list[Round]], probe: Probe, clients: int, max_tokens: int, seconds: float) -> None:
    n = len(results[MODES[0]])
    title = f"Output tokens/s, {clients} requests in flight x {max_tokens} tokens, {n} rounds of {seconds:.0f} s"
    rows = [(mode, [r.tokens_per_s for r in rs], ".0f") for mode, rs in results.items()]
    rows += [
        (f"{a} / {b}", [x.tokens_per_s / y.tokens_per_s for x, y in zip(results[a], results[b], strict=True)], ".3f")
        for a, b in RATIOS
    ]
    console.print(rounds_table(title, "mode", "round ", rows))
    for a, b in RATIOS:
        med = statistics.median(r.tokens_per_s for r in results[a]) / statistics.median(
            r.tokens_per_s for r in results[b]
        )
        per_round = sorted(x.tokens_per_s / y.tokens_per_s for x, y in zip(results[a], results[b], strict=True))
        console.print(
            f"{a} / {b}: median of the per-round ratios [bold]{statistics.median(per_round):.3f}[/bold] (from "
            f"{per_round[0]:.3f} to {per_round[-1]:.3f}), ratio of the medians {med:.3f}; goal: at least 0.99"
        )
    steps = [r.forward_steps for r in results["window"] if r.forward_steps is not None]
    mb = {m: statistics.median(r.trace_mb for r in results[m] if r.trace_mb is not None) for m in ("window", "plain")}
    console.print(
        f"markers per window (median): {statistics.median(steps):.0f}; trace JSON per recording (median): "
        f"window {mb['window']:.0f} MB, plain {mb['plain']:.0f} MB"
    )
    rate = statistics.median(r.forward_steps / r.seconds for r in results["window"] if r.forward_steps is not None)
    for what, runs in (
        ("one marker while recording", probe.us_per_marker),
        ("the wrapper outside a window", probe.us_per_count),
    ):
        us = statistics.median(runs)
        console.print(
            f"{what}, timed in the worker: {us:.2f} us per iteration (runs: "
            + ", ".join(f"{u:.2f}" for u in runs)
            + f"); at {rate:.0f} engine iterations/s, {us * rate / 1e4:.3f}% of the engine's time"
        )


def main(
    rounds: int = typer.Option(10, min=1, help="Rounds; each runs every mode once, in alternating order."),
    seconds: float = typer.Option(5.0, min=1, help="Seconds of load per mode and round."),
    clients: int = typer.Option(8, min=1, help="Requests in flight (closed loop)."),
    max_tokens: int = typer.Option(64, min=1, help="Tokens per request (ignore_eos)."),
    omp_threads: int = typer.Option(1, min=1, help="OMP_NUM_THREADS of vLLM's engine (the shipped config's 1)."),
    quick: bool = typer.Option(False, help="A smoke run: 2 rounds of 3 s."),
) -> None:
    if quick:
        rounds, seconds = 2, 3.0
    os.environ.update({k: os.environ.get(k, v) for k, v in VLLM_ENV.items()})
    os.environ["OMP_NUM_THREADS"] = str(omp_threads)
    # vLLM imports the extension by name in its engine-core process (forked, or spawned where
    # CUDA is initialized): benchmarks/ on the path of both.
    sys.path.insert(0, str(HERE))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    results, probe = asyncio.run(_main(rounds, seconds, clients, max_tokens))
    _print(results, probe, clients, max_tokens, seconds)


if __name__ == "__main__":  # vLLM may spawn its engine process: the guard is required
    typer.run(main)
