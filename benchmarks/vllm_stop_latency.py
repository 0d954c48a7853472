"""vLLM's `stop_profile` (it flushes the trace inline, on the weight-sync critical path) with our
profiler settings against vLLM's own defaults, measured side by side in one run.

Two `AsyncLLM` engines on the tiny model, built one after the other in this process: one with the
settings `engine: vllm` uses by default (no stack capture, no gzip, no key_averages table, no
frontend trace: we compress after the move, off the critical path), one with vLLM's defaults
(stack on, gzip on, table on, frontend traced). Each round records the same batch of requests
and times `stop_profile()`; rounds alternate between the engines.

    python benchmarks/vllm_stop_latency.py [--rounds 5] [--requests 16] [--max-tokens 32]
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from profiling.config import ProfileOptions
from serve_app.config import VllmOptions
from serve_app.engines.vllm_engine import VllmEngine
from serve_app.tiny_model import ensure_tiny_model

console = Console()
VLLM_DEFAULTS = VllmOptions(
    profiler_with_stack=True, profiler_use_gzip=True, profiler_dump_time_table=True, profile_frontend=True
)


def _build(model_dir: Path, trace_dir: Path, opts: VllmOptions):
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=str(model_dir),
            dtype="float32",
            max_model_len=256,
            enforce_eager=True,
            profiler_config=VllmEngine._profiler_config(ProfileOptions(), opts, trace_dir),
        )
    )


async def _generate(llm, n: int, max_tokens: int) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    async def one(i: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True)
        async for _ in llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7, 8 + i % 50]), params, request_id=uuid.uuid4().hex):
            pass

    await asyncio.gather(*(one(i) for i in range(n)))


async def _round(llm, trace_dir: Path, n: int, max_tokens: int, label: str) -> tuple[float, int]:
    await llm.start_profile(profile_prefix=label)
    await _generate(llm, n, max_tokens)
    t0 = time.perf_counter()
    await llm.stop_profile()
    took = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in trace_dir.iterdir())
    for p in trace_dir.iterdir():
        p.unlink()
    return took, size


async def _main(rounds: int, requests: int, max_tokens: int) -> None:
    model_dir = ensure_tiny_model()
    work = Path(tempfile.mkdtemp(prefix="vllm-stop-"))
    settings = {"ours": VllmOptions(), "vLLM defaults": VLLM_DEFAULTS}
    try:
        engines = {}
        for name, opts in settings.items():
            trace_dir = work / name.replace(" ", "_")
            console.print(f"building the engine with {name} ...")
            engines[name] = (_build(model_dir, trace_dir, opts), trace_dir)
        for llm, _ in engines.values():
            await _generate(llm, 2, 4)  # warm-up outside any recording
        times: dict[str, list[float]] = {k: [] for k in engines}
        sizes: dict[str, list[int]] = {k: [] for k in engines}
        for i in range(rounds):
            order = list(engines) if i % 2 == 0 else list(reversed(engines))
            for name in order:
                llm, trace_dir = engines[name]
                took, size = await _round(llm, trace_dir, requests, max_tokens, f"r{i}")
                times[name].append(took)
                sizes[name].append(size)
        table = Table(title=f"vLLM stop_profile, {rounds} rounds of {requests} requests x {max_tokens} tokens")
        for col in ("settings", "median stop (s)", "max stop (s)", "trace bytes (median)"):
            table.add_column(col)
        for name in engines:
            table.add_row(
                name,
                f"{statistics.median(times[name]):.3f}",
                f"{max(times[name]):.3f}",
                f"{int(statistics.median(sizes[name])):,}",
            )
        console.print(table)
        ratio = statistics.median(times["vLLM defaults"]) / statistics.median(times["ours"])
        console.print(f"vLLM defaults / ours (median stop): [bold]{ratio:.1f}x[/bold]")
        for llm, _ in engines.values():
            llm.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(
    rounds: int = typer.Option(5, min=1),
    requests: int = typer.Option(16, min=1),
    max_tokens: int = typer.Option(32, min=1),
) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    asyncio.run(_main(rounds, requests, max_tokens))


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    typer.run(main)
