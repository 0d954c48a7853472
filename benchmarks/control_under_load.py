"""Control calls under many concurrent RL rollout clients, and what the syncs cost generation:
the app against vLLM's own OpenAI server, side by side in one run.

* the app: `--engine transformers` serves config/serve.yaml (2 replicas of the embedded engine),
  `--engine vllm` config/serve.vllm.yaml with 1 replica (one vLLM engine, to compare with one
  vLLM server), profiler idle between windows, on a private local Ray bound to 127.0.0.1
  (`trainer/local_app.py`); the load goes to the replicas' own listener (`replica_listener`,
  docs/operations.md#replica-listener), or with `--generation-via port` to Serve's HTTP port;
* vLLM's server (`--against vllm`, the default on engine vllm): `python -m
  vllm.entrypoints.openai.api_server` on the same tiny model with the app's `dtype`,
  `max_model_len`, `enforce_eager` and `OMP_NUM_THREADS` (`rollout_throughput.py`'s helpers), with
  `VLLM_SERVER_DEV_MODE=1`, which adds vLLM's RL routes `POST /pause`, `POST /resume` and
  `GET /is_paused` (vllm/entrypoints/rl/online/api_router.py). `--against none`: the app alone.

The load, for each N of `--clients`: N closed-loop clients, each sending `/v1/completions` back to
back, one RL-style prompt of about 40 tokens per request (distinct per request), `max_tokens`
32, `ignore_eos`, temperature 1, `--n` choices (a GRPO group). Every request's outcome is
recorded: 200, 200 with fewer tokens than asked, 503 with or without Retry-After (a client
waits Retry-After out, then sends its next request), any other status, transport errors, and
hung: requests still unanswered when the drain after the run ends, which is once every request
is answered, after `--drain-s`, or after 60 s in which nothing was answered (a queue that still
moves gets the time it needs). No outcome ends a run.

Meanwhile, on the app, the trainer's weight syncs through `trainer.profiled_sync.ProfiledWeightSync`
and `trainer.client.RolloutClient`, one every `--sync-every-s` seconds (spread evenly over the
run), each publishing a new version: the tiny model's state dict with a small perturbation per
version, one safetensors file per version in `weights_dir`, as trainer/loop.py publishes. The
profiled steps are 2, 3, 6, 7, 10, 11, ... so the syncs cycle through every kind a trainer makes
(docs/design.md#schedule): an opening sync (update, start), the profiled sync (stop with pause ->
update with the hold kept -> start), a closing sync (stop, update) and a plain weight update (no
profiling call). Each run makes whole cycles, so no window is open outside the runs with syncs.
`GET /health` is sampled every 0.5 s throughout. On vLLM's server, at the same cadence:
`POST /pause?mode=keep` then `POST /resume`, and `GET /health` (which, unlike the app's, asks the
engine). Every control call is measured idle (before any load) and under load, as the caller's
HTTP round trip, failed calls included. Time stays bounded however slow the control plane is:
each HTTP attempt of a control call gives up after 30 s (/health after 10 s), a whole sync after
120 s (then whatever window it left open is stopped, and the next sync opens a new cycle), and a
sync that comes due after the run's time (the ones before it ran late) is not made.

Generation tokens/s with the syncs against runs without them: runs alternate (with, without,
without, with, ...; this machine's throughput moves by +-40% between runs) and so do the servers.
A run's tokens/s counts the completion tokens of answers received while the run lasted (its
drain excluded). It prints per N: each control call's median and p99 (nearest rank: the largest
sample below 100 samples) idle and loaded, for the app and for vLLM's server; tokens/s and
requests/s per run and their medians with and without the syncs, and the ratios; every
request's outcome by kind with the 200s' latency; the CPU each process used (busy cores, from
/proc); then the goals, met or not, and the path of a JSON file holding every raw figure.

The load generator runs in a child process (spawned), so that its event loop does not delay the
control calls it measures; it uses aiohttp, not httpx. Measured on this 2-core machine against a
trivial aiohttp server answering after a fixed delay: aiohttp 3.14 spent 0.19 to 0.21 CPU ms per
request at 4096 connections (0.15 at 256); httpx 0.28 spent 20 ms at 4096 (9 ms at 256), a load
generator that alone would take a core per 50 requests/s. Both servers' processes and the load
generator hold a socket per client, so the soft RLIMIT_NOFILE is raised (up to the hard limit)
before anything starts, and inherited.

    python benchmarks/control_under_load.py [--engine transformers|vllm] [--clients 8,256,1024,4096]
        [--seconds 30] [--rounds 3] [--sync-every-s 2] [--against vllm|none] [--n 1]
        [--max-tokens 32] [--drain-s 300] [--json PATH] [--control-via listener|port]
        [--generation-via listener|port] [--no-profiling] [--max-forward-steps N] [--quick]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import torch
import typer
import yaml
from pydantic import BaseModel, Field
from rich.console import Console
from rich.table import Table
from rollout_throughput import (
    APP,
    OTHERS,
    VLLM,
    VLLM_ENV,
    _wait_ready,
    cpu_by_role,
    reference_server,
    replica_omp_threads,
    replica_pids,
    rounds_table,
    vllm_server_command,
)
from safetensors.torch import load_file, save_file

from profiling.schedule import StepSchedule
from serve_app.app import parse_args
from serve_app.net import free_port, http_url
from serve_app.tiny_model import ensure_tiny_model
from trainer.client import RolloutClient, RolloutError
from trainer.local_app import local_cluster, run_app
from trainer.profiled_sync import ProfiledWeightSync

console = Console(width=None if sys.stdout.isatty() else 160)  # a log file gets the tables whole, not 80 columns
CONFIGS = {"transformers": "config/serve.yaml", "vllm": "config/serve.vllm.yaml"}
SYNCS, NO_SYNCS = "syncs", "no syncs"
HEALTH = "GET /health"
HEALTH_SERVE_PORT = "GET /health on Serve's port"
"""With the control listener, /health is sampled on both: HEALTH on the listener, this on Serve's port."""
HEALTH_CALLS = (HEALTH, HEALTH_SERVE_PORT)
CYCLE = 4
"""Syncs per cycle of the schedule: opening, profiled, closing, plain."""
HEALTH_EVERY_S = 0.5
IDLE_HEALTH_EVERY_S = 0.25
IDLE_SPACING_S = 1.0
"""Between idle control cycles: the previous stop's finalize is done, as under a real trainer."""
CONTROL_TIMEOUT_S = 30.0
"""Each HTTP attempt of a control call (the trainer's client retries a timed-out one twice)."""
TICK_TIMEOUT_S = 120.0
"""A whole control step (a sync's calls, their retries included): a run's time stays bounded
however slow the app's control plane is under load."""
HEALTH_TIMEOUT_S = 10.0
STALL_S = 60.0
"""A drain in which nothing is answered for this long ends: what is still in flight is hung."""
ERROR_BACKOFF_S = 0.5
"""A client's wait after an error without Retry-After: no hot loop against a failing server."""
WARMUP_S = 5.0
QUIET_CORES = 0.3
"""A run starts once the machine is this quiet (busy cores over QUIET_SAMPLE_S): what the last
run left running (trace exports, merges, queued requests) must not count in this one's figures."""
QUIET_SAMPLE_S = 0.5
QUIET_MAX_S = 60.0
"""The longest a run waits for that; then it starts anyway (its `settle_s` says so)."""
PERTURBATION = 1e-3
"""Scale of the noise added to every weight per version: new weights, the same model."""
_SENTENCES = (
    "The trainer learns from the answers.",
    "Red green blue yellow orange purple.",
    "One two three four five six seven.",
    "The quick brown fox jumps over the lazy dog.",
    "Every replica keeps its own trace directory.",
    "Numbers: 3 5 7 11 13 17 19.",
    "A weight update publishes a new version.",
)

# -- the load: closed-loop clients in a child process ---------------------------------------


def rl_prompt(i: int) -> str:
    """Request `i`'s prompt, about 40 tokens of the tiny model's vocabulary: a numbered task with
    two lines of context, distinct per request as an RL batch's prompts are."""
    return f"Problem {i}: {_SENTENCES[i % 7]} {_SENTENCES[(3 * i + 1) % 7]} Answer in one line:"


class LoadSpec(BaseModel):
    url: str
    body: dict[str, Any]
    """Every request's body but its prompt."""
    clients: int
    expect_tokens: int
    """Completion tokens of a whole answer (n x max_tokens: `ignore_eos` lets none stop early)."""
    drain_s: float
    """After the run, the longest the requests in flight may take to be answered before they count
    as hung (the drain ends sooner when nothing is answered for STALL_S)."""


class LoadResult(BaseModel):
    started_at: float
    """Unix seconds when the clients began."""
    stopped_at: float
    """Unix seconds when the run ended: no request is sent after it."""
    tokens: int
    """Completion tokens of the 200s received before `stopped_at`."""
    answered: int
    """200s received before `stopped_at`."""
    outcomes: dict[str, int]
    """Every request sent, by outcome, those answered during the drain and the hung included."""
    latency_s: dict[str, float]
    """p50, p90, p99, max of the 200s' latency (send to the whole answer), drain included."""
    drained_s: float
    """How long the drain of the requests in flight at `stopped_at` took."""
    samples: dict[str, str]
    """One answer text per outcome other than a 200, for the report."""
    cpu_s: float
    """The load generator's own CPU seconds during the run."""

    @property
    def window_s(self) -> float:
        return self.stopped_at - self.started_at

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.window_s

    @property
    def requests_per_s(self) -> float:
        return self.answered / self.window_s


class _Tally:
    """What the clients of one run saw."""

    def __init__(self, expect_tokens: int):
        self.expect_tokens = expect_tokens
        self.tokens = self.answered = self.ended = 0
        self.outcomes: dict[str, int] = {}
        self.samples: dict[str, str] = {}
        self.latencies: list[float] = []
        self.in_flight: set[int] = set()
        """Clients whose request is sent and not answered: those left when the drain ends are hung."""

    def count(self, outcome: str, sample: str = "") -> None:
        self.ended += 1
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if sample and outcome not in self.samples:
            self.samples[outcome] = sample[:300]

    def answer(self, status: int, retry_after: str | None, data: bytes, took: float) -> float:
        """Count one answer; returns how long its client waits before its next request."""
        if status == 200:
            try:
                tokens = int(json.loads(data)["usage"]["completion_tokens"])
            except (ValueError, KeyError, TypeError):
                self.count("200 unreadable", data.decode(errors="replace"))
                return ERROR_BACKOFF_S
            self.count("200" if tokens >= self.expect_tokens else "200 short", f"{tokens} tokens")
            self.tokens += tokens
            self.answered += 1
            self.latencies.append(took)
            return 0.0
        text = data.decode(errors="replace")
        if status == 503:
            wait = _seconds(retry_after)
            if wait is None:
                self.count("503 without Retry-After", text)
                return ERROR_BACKOFF_S
            self.count("503 + Retry-After", f"Retry-After: {retry_after}: {text}")
            return wait
        self.count(f"HTTP {status}", text)
        return ERROR_BACKOFF_S


def _seconds(retry_after: str | None) -> float | None:
    """Retry-After in seconds (None: absent, or not a number of seconds)."""
    try:
        return max(0.0, float(retry_after)) if retry_after is not None else None
    except ValueError:
        return None


async def _wait_unless(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def _client(session: aiohttp.ClientSession, spec: LoadSpec, i: int, stop: asyncio.Event, tally: _Tally) -> None:
    """One closed-loop client: its next request once the last is answered (or Retry-After later)."""
    k = 0
    while not stop.is_set():
        body = {**spec.body, "prompt": rl_prompt(i + spec.clients * k)}
        k += 1
        tally.in_flight.add(i)
        t0 = time.perf_counter()
        try:
            async with session.post("/v1/completions", json=body) as r:
                data = await r.read()
                status, retry_after = r.status, r.headers.get("Retry-After")
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            tally.in_flight.discard(i)
            tally.count(f"transport: {type(e).__name__}", repr(e))
            await _wait_unless(stop, ERROR_BACKOFF_S)
            continue
        tally.in_flight.discard(i)
        if wait := tally.answer(status, retry_after, data, time.perf_counter() - t0):
            await _wait_unless(stop, wait)


def _percentile(values: list[float], q: float) -> float:
    """Nearest rank: with fewer than 1/(1-q) values, the largest."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


async def _generate(spec: LoadSpec, conn: Connection) -> LoadResult:
    """Run the clients from now until the parent says stop, then drain them."""
    tally = _Tally(spec.expect_tokens)
    stop = asyncio.Event()
    cpu0 = time.process_time()
    # No client timeout: a request is hung when the drain ends, whatever it waited on.
    connector = aiohttp.TCPConnector(limit=spec.clients)
    async with aiohttp.ClientSession(spec.url, connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        tasks = [asyncio.create_task(_client(http, spec, i, stop, tally)) for i in range(spec.clients)]
        started = time.time()
        conn.send(started)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # the parent's stop
        stopped = time.time()
        stop.set()
        tokens, answered = tally.tokens, tally.answered
        pending = await _drain(set(tasks), spec.drain_s, tally)
        drained = time.time() - stopped
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if tally.in_flight:
        tally.outcomes["hung"] = len(tally.in_flight)
    lat = tally.latencies or [math.nan]
    return LoadResult(
        started_at=started,
        stopped_at=stopped,
        tokens=tokens,
        answered=answered,
        outcomes=tally.outcomes,
        latency_s={f"p{q}": _percentile(lat, q / 100) for q in (50, 90, 99)} | {"max": max(lat)},
        drained_s=drained,
        samples=tally.samples,
        cpu_s=time.process_time() - cpu0,
    )


async def _drain(tasks: set[asyncio.Task[None]], drain_s: float, tally: _Tally) -> set[asyncio.Task[None]]:
    """Wait for the clients' last requests until all are answered, `drain_s` passed, or nothing
    was answered for STALL_S (a server whose queue still moves is given the time it needs);
    returns the clients still waiting."""
    deadline = time.monotonic() + drain_s
    ended, progress_at = tally.ended, time.monotonic()
    while tasks and time.monotonic() < min(deadline, progress_at + STALL_S):
        _, tasks = await asyncio.wait(tasks, timeout=1.0)
        if tally.ended != ended:
            ended, progress_at = tally.ended, time.monotonic()
    return tasks


def _load_process(conn: Connection) -> None:
    """The load generator's process: runs each LoadSpec the parent sends (None ends it)."""
    with contextlib.suppress(EOFError, KeyboardInterrupt):  # the parent went away: end quietly
        while (msg := conn.recv()) is not None:
            result = asyncio.run(_generate(LoadSpec.model_validate(msg), conn))
            conn.send(result.model_dump())


class LoadGenerator:
    """The child process running the clients. Spawned, not forked: it starts without this
    process's Ray driver and threads."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_load_process, args=(child,), name="load-generator", daemon=True)
        self._proc.start()
        child.close()

    @property
    def pid(self) -> int:
        assert self._proc.pid is not None  # started in __init__
        return self._proc.pid

    def start(self, spec: LoadSpec) -> float:
        """Start the clients; returns the unix time they began."""
        self._conn.send(spec.model_dump())
        started: float = self._conn.recv()
        return started

    def stop(self) -> LoadResult:
        """End the run; returns once the drain is over."""
        self._conn.send("stop")
        return LoadResult.model_validate(self._conn.recv())

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join()


@contextlib.contextmanager
def load_generator() -> Iterator[LoadGenerator]:
    gen = LoadGenerator()
    try:
        yield gen
    finally:
        gen.close()


def raise_open_files_limit(needed: int) -> str:
    """Raise this process's soft RLIMIT_NOFILE to `needed` (the hard limit at most); what it
    started inherits it. Returns what was done, for the report."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        new = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < needed:
            console.print(f"[yellow]open files: hard limit {hard} < {needed} needed; connections may fail[/yellow]")
        return f"soft {soft} -> {new} (hard {hard})"
    return f"soft {soft} (hard {hard}), enough for {needed}"


# -- the control side ---------------------------------------------------------------------


class Samples(BaseModel):
    """Seconds per control call, by call, every call's round trip, failed ones included (a call
    that timed out counts its timeout); the failures' messages, by call."""

    times: dict[str, list[float]] = Field(default_factory=dict)
    errors: dict[str, list[str]] = Field(default_factory=dict)

    def add(self, call: str, seconds: float) -> None:
        self.times.setdefault(call, []).append(seconds)

    def fail(self, call: str, error: str) -> None:
        self.errors.setdefault(call, []).append(error[:500])


class Side:
    """A server under test: its URL, the completions body it gets, its control calls."""

    name: str
    calls: tuple[str, ...]
    """The calls `tick` measures, in the order the tables show them."""

    def __init__(self, url: str, body: dict[str, Any], control_url: str | None = None):
        """`control_url`: where the control calls and /health go (None: `url`, which the load gets)."""
        self.url, self.body = url, body
        self.http = httpx.AsyncClient(base_url=control_url or url, timeout=CONTROL_TIMEOUT_S, trust_env=False)

    async def tick(self, out: Samples) -> None:
        """One control cadence step."""
        raise NotImplementedError

    async def settle(self) -> None:
        """Leave nothing open that would load the next run."""

    async def request(
        self, call: str, method: str, path: str, out: Samples, timeout_s: float, http: httpx.AsyncClient | None = None
    ) -> float | None:
        """One timed control call (on `http`, default the side's control client); its seconds
        (None: it failed, which `out` records too)."""
        t0 = time.perf_counter()
        try:
            r = await (http or self.http).request(method, path, timeout=timeout_s)
        except httpx.HTTPError as e:
            out.add(call, time.perf_counter() - t0)
            out.fail(call, repr(e))
            return None
        took = time.perf_counter() - t0
        out.add(call, took)
        if r.status_code != 200:
            out.fail(call, f"{r.status_code}: {r.text[:200]}")
            return None
        return took

    async def health(self, out: Samples) -> None:
        await self.request(HEALTH, "GET", "/health", out, HEALTH_TIMEOUT_S)

    async def aclose(self) -> None:
        await self.http.aclose()


class WeightsPublisher:
    """The trainer's side of a file sync: each version's weights as one safetensors file in
    weights_dir, the tiny model's with a small perturbation, the previous version kept (the
    desired state may still name it)."""

    def __init__(self, model_dir: str, weights_dir: Path):
        self._base = load_file(str(Path(model_dir) / "model.safetensors"))
        self._dir = weights_dir
        weights_dir.mkdir(parents=True, exist_ok=True)

    def path(self, version: int) -> Path:
        return self._dir / f"v{version}.safetensors"

    def write(self, version: int) -> Path:
        g = torch.Generator().manual_seed(version)
        state = {k: t + PERTURBATION * torch.randn(t.shape, generator=g, dtype=t.dtype) for k, t in self._base.items()}
        save_file(state, str(self.path(version)))
        self.path(version - 2).unlink(missing_ok=True)
        return self.path(version)


PROFILED, OPENING, CLOSING, PLAIN = "profiled sync", "opening sync", "closing sync", "plain update"
SYNC_CALLS = {
    PROFILED: f"{PROFILED}: stop -> update -> start",
    PLAIN: f"{PLAIN}: /weights/update",
    OPENING: f"{OPENING}: update -> start",
    CLOSING: f"{CLOSING}: stop -> update",
}
"""Each kind of sync, as a whole (what the trainer waits for)."""
PUBLISH = "publish (write the file, off the critical path)"
APP_CALLS = ("stop (pause)", "update (hold kept)", "start", "start + stop", *SYNC_CALLS.values(), PUBLISH)


def profiled_steps(syncs: int) -> list[int]:
    """Steps 2, 3, 6, 7, ...: the sync publishing v opens a window (v = 1 mod 4), stops one and
    starts the next (2), stops one (3), only updates (0)."""
    return [s for j in range(syncs // CYCLE + 1) for s in (CYCLE * j + 2, CYCLE * j + 3)]


class AppSide(Side):
    name = APP
    calls = APP_CALLS

    def __init__(
        self,
        url: str,
        body: dict[str, Any],
        syncs: int,
        publisher: WeightsPublisher,
        control_url: str | None,
        serve_url: str,
        profiling: bool = True,
    ):
        """`url`: where the load goes (Serve's port or the replica listener); `control_url`: the
        app's control listener (None: control calls go to Serve's port, `serve_url`); without
        `profiling` every sync is a plain update."""
        super().__init__(url, body, control_url or serve_url)
        self.client = RolloutClient(serve_url, control_url=control_url, timeout_s=CONTROL_TIMEOUT_S)
        self._serve_port = (
            httpx.AsyncClient(base_url=serve_url, timeout=CONTROL_TIMEOUT_S, trust_env=False) if control_url else None
        )
        steps = profiled_steps(syncs) if profiling else []
        self.sync = ProfiledWeightSync(StepSchedule(steps), self.client, save_path=None)
        self._publisher = publisher
        self.version = 0

    async def tick(self, out: Samples) -> None:
        """The trainer's next sync, timed call by call as ProfiledWeightSync measures them."""
        self.version += 1
        v = self.version
        plan = self.sync.schedule.sync(v)
        kind = (
            PROFILED
            if plan.control_calls == 2
            else OPENING
            if plan.start_step
            else CLOSING
            if plan.stop_step
            else PLAIN
        )

        async def publish() -> Path:
            return await asyncio.to_thread(self._publisher.write, v)

        t0 = time.perf_counter()
        try:
            cost = (await asyncio.wait_for(self.sync.sync(v, publish), TICK_TIMEOUT_S)).cost
        except (RolloutError, httpx.HTTPError, OSError, TimeoutError) as e:
            out.add(SYNC_CALLS[kind], time.perf_counter() - t0)
            why = f"no answer within {TICK_TIMEOUT_S:.0f} s" if isinstance(e, TimeoutError) else repr(e)
            out.fail(SYNC_CALLS[kind], f"version {v}: {why}")
            if problem := await self._recover(failed_version=v):
                out.fail(SYNC_CALLS[kind], f"version {v}, recovering: {problem}")
            return
        out.add(PUBLISH, cost.publish_s or 0.0)
        if kind == PROFILED:
            assert cost.stop_s is not None and cost.update_s is not None and cost.start_s is not None
            out.add("stop (pause)", cost.stop_s)
            out.add("update (hold kept)", cost.update_s)
            out.add("start", cost.start_s)
            out.add("start + stop", cost.start_s + cost.stop_s)
        out.add(SYNC_CALLS[kind], cost.total_s)

    async def _recover(self, failed_version: int | None = None) -> str | None:
        """Stop whatever window is open (`end` never raises for the app's refusals) and go on
        from the next cycle's opening sync (a later version: versions only have to grow). After
        a failed sync, also end any admission hold it left (an update with `resume: false` whose
        start failed holds generation for `hold_timeout_s`, into the next run): the same version
        again, resuming, as a trainer retrying its sync would. Returns what failed, if anything."""
        self.version = (self.version // CYCLE + 1) * CYCLE
        try:
            await asyncio.wait_for(self.sync.end(), TICK_TIMEOUT_S)
        except TimeoutError:
            return f"the stop did not answer within {TICK_TIMEOUT_S:.0f} s"
        if failed_version is None or not (path := self._publisher.path(failed_version)).exists():
            return None
        try:
            await asyncio.wait_for(self.client.update_weights(failed_version, str(path)), TICK_TIMEOUT_S)
        except (RolloutError, TimeoutError) as e:
            return f"the resuming update: {'no answer' if isinstance(e, TimeoutError) else repr(e)}"
        return None

    async def settle(self) -> None:
        if self.sync.active is not None:
            await self._recover()

    async def health(self, out: Samples) -> None:
        await super().health(out)
        if self._serve_port is not None:
            await self.request(HEALTH_SERVE_PORT, "GET", "/health", out, HEALTH_TIMEOUT_S, self._serve_port)

    async def aclose(self) -> None:
        await self.sync.end()
        self.sync.shutdown()
        await self.client.aclose()
        if self._serve_port is not None:
            await self._serve_port.aclose()
        await super().aclose()


class VllmSide(Side):
    name = VLLM
    calls = ("POST /pause?mode=keep", "POST /resume", "pause + resume")

    async def tick(self, out: Samples) -> None:
        """vLLM's own hold for a weight update: pause keeping the requests, then resume (always
        sent, so a failed pause never leaves the server paused)."""
        paused = await self.request(self.calls[0], "POST", "/pause?mode=keep", out, CONTROL_TIMEOUT_S)
        resumed = await self.request(self.calls[1], "POST", "/resume", out, CONTROL_TIMEOUT_S)
        if paused is not None and resumed is not None:
            out.add("pause + resume", paused + resumed)


async def _sleep_until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.monotonic()))


async def _sample_health(side: Side, every_s: float, stop: asyncio.Event, out: Samples) -> None:
    t0 = time.monotonic()
    i = 0
    while not stop.is_set():
        await side.health(out)
        i += 1
        await _wait_unless(stop, t0 + i * every_s - time.monotonic())


# -- runs ---------------------------------------------------------------------------------


class Plan(BaseModel):
    seconds: float
    ticks: int
    """Control steps in a run with syncs: whole cycles."""

    @property
    def spacing_s(self) -> float:
        return self.seconds / self.ticks


class RunRecord(BaseModel):
    side: str
    mode: str
    clients: int
    round: int
    ticks: int
    """Control steps made (syncs, or vLLM's pause + resume)."""
    ticks_planned: int
    """Those due in the run: fewer were made when they ran late."""
    load: LoadResult
    control: Samples
    cpu_s: dict[str, float]
    """CPU seconds by process role (`cpu_by_role`) from the load's start to the drain's end."""
    cpu_window_s: float
    loadavg: tuple[float, float, float]
    """The machine's load average after the run."""
    settle_s: float = 0.0
    """How long the run waited, before it began, for the machine to be quiet (QUIET_CORES)."""


class IdleRecord(BaseModel):
    side: str
    control: Samples


class Goal(BaseModel):
    what: str
    value: float | None
    """None: not measured in this run."""
    limit: float
    at_most: bool
    unit: str
    failures: int = 0
    """Calls that failed where the measure is taken (for start + stop, any sync: a failed one
    keeps the profiled sync from being reached): the goal is not met while any did."""

    @property
    def met(self) -> bool | None:
        if self.failures:
            return False
        if self.value is None or math.isnan(self.value):
            return None
        return self.value <= self.limit if self.at_most else self.value >= self.limit


class Report(BaseModel):
    engine: str
    config: str
    against: str
    control_via: str
    """listener: the trainer's control calls went to the app's control listener; port: to Serve's port."""
    generation_via: str = "port"
    """listener: the load went to the replicas' own listener; port: to Serve's port."""
    clients: list[int]
    seconds: float
    rounds: int
    sync_every_s: float
    sync_spacing_s: float
    n: int
    max_tokens: int
    omp_threads: str
    profiling: bool = True
    """False: every sync was a plain weight update (--no-profiling)."""
    max_forward_steps: int | None = None
    """The profiler's window bound the app ran with."""
    source: str
    """Where the app's code came from, with its git commit when known."""
    machine: dict[str, Any]
    idle: list[IdleRecord] = Field(default_factory=list)
    runs: list[RunRecord] = Field(default_factory=list)
    goals: list[Goal] = Field(default_factory=list)


_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    """CPU seconds every core of this machine spent busy since boot (/proc/stat: user, nice,
    system, irq, softirq, steal)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) * _TICK_S


class CpuMeter:
    """`cpu_by_role` with this benchmark's processes named, and other users' CPU taken from the
    machine's busy time: their processes come and go during a run (a shared machine's test
    runs), and what an exited process used vanishes from /proc/<pid>."""

    def __init__(self, ref_root: int, replicas: list[int], load_pid: int):
        self._ref_root, self._replicas = ref_root, replicas
        self._named = {load_pid: "load generator (child process)", os.getpid(): "control calls (this process)"}

    def sample(self) -> dict[str, float]:
        cpu = cpu_by_role(VLLM, self._ref_root, self._replicas, self._named)
        cpu[OTHERS] = _machine_busy_s() - sum(v for role, v in cpu.items() if role != OTHERS)
        return cpu


async def _run(
    side: Side, mode: str, spec: LoadSpec, load: LoadGenerator, plan: Plan, cpu: CpuMeter, rnd: int
) -> RunRecord:
    """One load run of `plan.seconds`, with the side's control ticks (mode SYNCS) or without,
    /health sampled throughout. A tick is due every `plan.spacing_s`; one that comes due after
    `plan.seconds` (the ticks before it ran late) is not sent, and the run lasts until the last
    one sent has ended."""
    out = Samples()
    settle_s = await _quiet()
    before, c0 = cpu.sample(), time.monotonic()
    await asyncio.to_thread(load.start, spec)
    t0 = time.monotonic()
    stop = asyncio.Event()
    health = asyncio.create_task(_sample_health(side, HEALTH_EVERY_S, stop, out))
    ticks = 0
    if mode == SYNCS:
        for i in range(plan.ticks):
            if time.monotonic() >= t0 + plan.seconds:
                break
            await _sleep_until(t0 + (i + 0.5) * plan.spacing_s)
            await side.tick(out)
            ticks += 1
        await side.settle()
    await _sleep_until(t0 + plan.seconds)
    stop.set()
    await health
    result = await asyncio.to_thread(load.stop)
    after, c1 = cpu.sample(), time.monotonic()
    return RunRecord(
        side=side.name,
        mode=mode,
        clients=spec.clients,
        round=rnd,
        ticks=ticks,
        ticks_planned=plan.ticks if mode == SYNCS else 0,
        load=result,
        control=out,
        cpu_s={role: after[role] - before.get(role, 0.0) for role in after},
        cpu_window_s=c1 - c0,
        loadavg=os.getloadavg(),
        settle_s=settle_s,
    )


async def _quiet() -> float:
    """Wait until the machine's busy cores fall below QUIET_CORES (at most QUIET_MAX_S); the
    seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < QUIET_MAX_S:
        b0 = _machine_busy_s()
        await asyncio.sleep(QUIET_SAMPLE_S)
        if (_machine_busy_s() - b0) / QUIET_SAMPLE_S < QUIET_CORES:
            break
    return time.monotonic() - t0


async def _idle(side: Side, ticks: int) -> IdleRecord:
    """The side's control calls with no load, /health sampled meanwhile."""
    out = Samples()
    stop = asyncio.Event()
    health = asyncio.create_task(_sample_health(side, IDLE_HEALTH_EVERY_S, stop, out))
    t0 = time.monotonic()
    for i in range(ticks):
        await _sleep_until(t0 + i * IDLE_SPACING_S)
        await side.tick(out)
    await asyncio.sleep(IDLE_SPACING_S)
    stop.set()
    await health
    return IdleRecord(side=side.name, control=out)


def _order(rnd: int, sides: list[Side]) -> Iterator[tuple[Side, str]]:
    """Round `rnd`'s runs: servers and modes both alternate from round to round, so neither is
    favoured by the machine's drift."""
    servers = sides if rnd % 2 == 0 else sides[::-1]
    modes = (SYNCS, NO_SYNCS) if rnd % 2 == 0 else (NO_SYNCS, SYNCS)
    for side in servers:
        for mode in modes:
            yield side, mode


async def _measure(
    report: Report, sides: list[Side], load: LoadGenerator, cpu: CpuMeter, plan: Plan, idle_ticks: int,
    drain_s: float, expect_tokens: int, save: Path,
) -> None:  # fmt: skip
    for side in sides:
        console.print(f"idle: {side.name}, {idle_ticks} control steps ...")
        report.idle.append(await _idle(side, idle_ticks))
    for n_clients in report.clients:
        specs = {
            s.name: LoadSpec(url=s.url, body=s.body, clients=n_clients, expect_tokens=expect_tokens, drain_s=drain_s)
            for s in sides
        }
        warm = Plan(seconds=min(WARMUP_S, plan.seconds), ticks=1)
        for side in sides:  # outside the figures: connections, the engines' first batches at this N
            r = await _run(side, NO_SYNCS, specs[side.name], load, warm, cpu, -1)
            console.print(f"  N={n_clients:5d} {side.name:12s} warm-up : {_run_line(r)}")
        for rnd in range(report.rounds):
            for side, mode in _order(rnd, sides):
                r = await _run(side, mode, specs[side.name], load, plan, cpu, rnd)
                report.runs.append(r)
                save.write_text(report.model_dump_json(indent=1))
                console.print(f"  N={n_clients:5d} {side.name:12s} {mode:8s}: {_run_line(r)}")


# -- the report ---------------------------------------------------------------------------


def _run_line(r: RunRecord) -> str:
    """A run's figures as it ends, with what went wrong in red."""
    lost = {k: v for k, v in r.load.outcomes.items() if k not in ("200", "503 + Retry-After")}
    errors = sum(map(len, r.control.errors.values()))
    return (
        f"{r.load.tokens_per_s:7.0f} tok/s {r.load.requests_per_s:6.1f} req/s, 200: {r.load.outcomes.get('200', 0)}, "
        f"503+RA: {r.load.outcomes.get('503 + Retry-After', 0)}, drain {r.load.drained_s:.0f} s, "
        f"quiet after {r.settle_s:.1f} s"
        + (f", control steps {r.ticks}/{r.ticks_planned}" if r.ticks_planned else "")
        + (f", [red]{lost}[/red]" if lost else "")
        + (f", [red]{errors} control calls failed[/red]" if errors else "")
    )


def _runs(report: Report, side: str, n: int, mode: str | None = None) -> list[RunRecord]:
    return [r for r in report.runs if r.side == side and r.clients == n and (mode is None or r.mode == mode)]


def _loaded(report: Report, side: str, n: int, call: str) -> list[float]:
    """A call's samples under load at `n` clients: /health from every run, the rest from the runs
    with syncs."""
    runs = _runs(report, side, n, None if call in HEALTH_CALLS else SYNCS)
    return [t for r in runs for t in r.control.times.get(call, [])]


def _idle_samples(report: Report, side: str, call: str) -> list[float]:
    return [t for i in report.idle if i.side == side for t in i.control.times.get(call, [])]


def _ms(values: list[float], q: float | None) -> str:
    if not values:
        return "-"
    return f"{(statistics.median(values) if q is None else _percentile(values, q)) * 1000:.0f}"


def _median_tps(runs: list[RunRecord]) -> float:
    return statistics.median(r.load.tokens_per_s for r in runs) if runs else math.nan


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


def _paired_ratios(runs: list[RunRecord]) -> list[float]:
    """tokens/s with syncs over without, per round (the two runs of a side that were adjacent)."""
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        by_round.setdefault(r.round, {})[r.mode] = r.load.tokens_per_s
    return [m[SYNCS] / m[NO_SYNCS] for m in by_round.values() if SYNCS in m and NO_SYNCS in m and m[NO_SYNCS]]


def _print_n(report: Report, n: int, sides: list[str], calls: dict[str, tuple[str, ...]]) -> None:
    t = Table(
        title=f"Control calls, ms: idle, and under {n} clients (p99: nearest rank, the largest below 100 samples)"
    )
    for col in ("server", "call", "idle median", "idle p99", "loaded median", "loaded p99", "samples idle/loaded",
                "errors idle/loaded"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("server", "call") else "right")
    for side in sides:
        for call in (*calls[side], *HEALTH_CALLS):
            idle, loaded = _idle_samples(report, side, call), _loaded(report, side, n, call)
            idle_errors = sum(len(i.control.errors.get(call, [])) for i in report.idle if i.side == side)
            errors = sum(len(r.control.errors.get(call, [])) for r in _runs(report, side, n))
            if idle or loaded or idle_errors or errors:
                t.add_row(
                    side, call, _ms(idle, None), _ms(idle, 0.99), _ms(loaded, None), _ms(loaded, 0.99),
                    f"{len(idle)}/{len(loaded)}", f"{idle_errors}/{errors}" if idle_errors or errors else "",
                )  # fmt: skip
    console.print(t)
    rows = []
    for side in sides:
        for mode in (SYNCS, NO_SYNCS):
            if runs := _runs(report, side, n, mode):
                label = f"{side}, {mode if side == APP or mode == NO_SYNCS else 'pause + resume'}"
                rows.append((f"{label}: tok/s", [r.load.tokens_per_s for r in runs], ".0f"))
                rows.append((f"{label}: req/s", [r.load.requests_per_s for r in runs], ".1f"))
    if rows:
        console.print(
            rounds_table(f"Generation, {n} clients, runs of {report.seconds:.0f} s", "server, mode", "run ", rows)
        )
    ratios = Table(title=f"Ratios, {n} clients (tokens/s)")
    for col in ("what", "of the medians", "per round (median)"):
        ratios.add_column(col, justify="left" if col == "what" else "right")
    for side in sides:
        runs = _runs(report, side, n)
        with_, without = _median_tps(_runs(report, side, n, SYNCS)), _median_tps(_runs(report, side, n, NO_SYNCS))
        paired = _paired_ratios(runs)
        ratios.add_row(
            f"{side}: with control calls / without",
            f"{_ratio(with_, without):.3f}",
            f"{statistics.median(paired):.3f}" if paired else "-",
        )
    if len(sides) == 2:
        for mode in (NO_SYNCS, SYNCS):
            a, b = _median_tps(_runs(report, APP, n, mode)), _median_tps(_runs(report, VLLM, n, mode))
            ratios.add_row(
                f"app / {VLLM}, {mode if mode == NO_SYNCS else 'each with its control calls'}",
                f"{_ratio(a, b):.3f}",
                "",
            )
    console.print(ratios)
    kinds = sorted({k for r in report.runs if r.clients == n for k in r.load.outcomes}, key=_outcome_order)
    o = Table(title=f"Every request's outcome, {n} clients (all runs), and the 200s' latency")
    for col in ("server, mode", *kinds, "latency p50 s (median run)", "p99 s (worst run)", "drain s (max)"):
        o.add_column(col, justify="left" if col == "server, mode" else "right")
    for side in sides:
        for mode in (SYNCS, NO_SYNCS):
            if runs := _runs(report, side, n, mode):
                o.add_row(
                    f"{side}, {mode}",
                    *(str(sum(r.load.outcomes.get(k, 0) for r in runs)) for k in kinds),
                    f"{statistics.median(r.load.latency_s['p50'] for r in runs):.2f}",
                    f"{max(r.load.latency_s['p99'] for r in runs):.2f}",
                    f"{max(r.load.drained_s for r in runs):.1f}",
                )
    console.print(o)
    _print_cpu(report, n, sides)


def _outcome_order(kind: str) -> tuple[int, str]:
    first = ("200", "200 short", "503 + Retry-After", "503 without Retry-After")
    return (first.index(kind), kind) if kind in first else (len(first) + (kind == "hung"), kind)


def _print_cpu(report: Report, n: int, sides: list[str]) -> None:
    cols = [(side, mode) for side in sides for mode in (SYNCS, NO_SYNCS) if _runs(report, side, n, mode)]
    busy = {
        col: [{role: v / r.cpu_window_s for role, v in r.cpu_s.items()} for r in _runs(report, col[0], n, col[1])]
        for col in cols
    }
    roles = sorted({role for runs in busy.values() for b in runs for role in b}, key=lambda r: (r == OTHERS, r))
    t = Table(
        title=f"Busy cores by process, {n} clients (median over runs; each run from its start to its drain's end)"
    )
    t.add_column("process")
    for side, mode in cols:
        t.add_column(f"{side}, {mode}", justify="right")
    for role in roles:
        values = [statistics.median(b.get(role, 0.0) for b in busy[col]) for col in cols]
        if max(values) >= 0.01:
            t.add_row(role, *(f"{v:.2f}" for v in values))
    t.add_row("[bold]all[/bold]", *(f"{statistics.median(sum(b.values()) for b in busy[col]):.2f}" for col in cols))
    console.print(t)


def _failures(report: Report, n: int, call: str) -> int:
    return sum(len(r.control.errors.get(call, [])) for r in _runs(report, APP, n))


def _goals(report: Report) -> list[Goal]:
    """The issue's goals for this machine (2 cores), for whichever engine ran."""
    goals = []
    ran = set(report.clients)
    ss = _loaded(report, APP, 1024, "start + stop") if 1024 in ran else []
    goals.append(
        Goal(what="start + stop under 1024 clients, median (app)", value=statistics.median(ss) if ss else None,
             limit=1.0, at_most=True, unit="s",
             failures=sum(_failures(report, 1024, call) for call in SYNC_CALLS.values()))
    )  # fmt: skip
    for n in report.clients:
        h = _loaded(report, APP, n, HEALTH)
        goals.append(
            Goal(what=f"GET /health under {n} clients, p99 (app)", value=_percentile(h, 0.99) if h else None,
                 limit=0.1, at_most=True, unit="s", failures=_failures(report, n, HEALTH))
        )  # fmt: skip
    for n in report.clients:
        with_, without = _median_tps(_runs(report, APP, n, SYNCS)), _median_tps(_runs(report, APP, n, NO_SYNCS))
        goals.append(
            Goal(what=f"tokens/s with syncs / without, {n} clients (app, medians)", value=_ratio(with_, without),
                 limit=0.95, at_most=False, unit="x")
        )  # fmt: skip
    if report.engine == "vllm":
        for n, limit in ((1024, 0.9), (8, 1.0)):
            value = None
            if report.against == "vllm" and n in ran:
                value = _ratio(
                    _median_tps(_runs(report, APP, n, NO_SYNCS)), _median_tps(_runs(report, VLLM, n, NO_SYNCS))
                )
            goals.append(
                Goal(what=f"app / {VLLM} tokens/s, {n} clients, no control calls (medians)", value=value,
                     limit=limit, at_most=False, unit="x")
            )  # fmt: skip
    return goals


def _print_goals(goals: list[Goal]) -> None:
    t = Table(title="Goals (this 2-core machine)")
    for col in ("goal", "value", "limit", ""):
        t.add_column(col, justify="left" if col == "goal" else "right")
    for g in goals:
        value = ("-" if g.value is None else f"{g.value:.3f} {g.unit}") + (
            f", {g.failures} failed" if g.failures else ""
        )
        status = {None: "not measured", True: "[green]met[/green]", False: "[red]not met[/red]"}[g.met]
        t.add_row(g.what, value, f"{'<=' if g.at_most else '>='} {g.limit} {g.unit}", status)
    console.print(t)


def _print_problems(report: Report) -> None:
    """Control errors and one sample answer per outcome other than a 200, as evidence."""
    for idle in report.idle:
        for call, errs in idle.control.errors.items():
            console.print(f"[red]idle {idle.side}: {call}: {len(errs)} failed, e.g. {errs[0]}[/red]")
    seen: set[tuple[str, str]] = set()
    for r in report.runs:
        for call, errs in r.control.errors.items():
            console.print(f"[red]N={r.clients} {r.side} {r.mode} round {r.round}: {call}: {errs[0]}[/red]")
        for outcome, text in r.load.samples.items():
            if outcome not in ("200", "200 short") and (r.side, outcome) not in seen:
                seen.add((r.side, outcome))
                console.print(f"{r.side}: first '{outcome}' answer: {text}")


def _source() -> str:
    import serve_app

    root = Path(serve_app.__file__).resolve().parents[1]
    commit = subprocess.run(
        ["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return f"{root} ({commit or 'no git'})"


def main(
    engine: str = typer.Option("transformers", help="The app's engine: transformers (config/serve.yaml, 2 replicas) "
                               "or vllm (config/serve.vllm.yaml, 1 replica)."),
    clients: str = typer.Option("8,256,1024,4096", help="Concurrent closed-loop clients, one load per N (8: the "
                                "throughput goal at low load)."),
    seconds: float = typer.Option(30.0, min=4, help="Seconds per load run."),
    rounds: int = typer.Option(3, min=1, help="Rounds per N; each runs every server with and without control calls."),
    sync_every_s: float = typer.Option(2.0, min=0.1, help="Seconds between syncs (spread over the run in whole cycles "
                                       "of 4)."),
    against: str | None = typer.Option(None, help="vllm (vLLM's own server beside the app) or none; default: vllm "
                                       "on engine vllm, none on transformers."),
    n: int = typer.Option(1, min=1, help="Choices per request (a GRPO group)."),
    max_tokens: int = typer.Option(32, min=1, help="max_tokens of each request (ignore_eos: every choice makes them)."),
    drain_s: float = typer.Option(300.0, min=1, help="After a run, the longest requests in flight may take before "
                                  "they count as hung (sooner when nothing is answered for 60 s)."),
    json_path: str | None = typer.Option(None, "--json", help="Where the raw figures go (default: in the working "
                                          "directory)."),
    control_via: str = typer.Option("listener", help="listener: the trainer's control calls and /health go to the "
                                    "app's control listener (/health sampled on Serve's port too); port: to Serve's "
                                    "HTTP port."),
    generation_via: str = typer.Option("listener", help="listener: the load goes to the replicas' own listener "
                                       "(replica_listener); port: to Serve's HTTP port."),
    quick: bool = typer.Option(False, help="A smoke run: 64 clients (unless --clients says otherwise), 1 round of "
                               "8 s, a sync every second."),
    profiling: bool = typer.Option(True, help="--no-profiling: every sync is a plain weight update (what the sync "
                                   "costs generation without the profiler's recording)."),
    max_forward_steps: int | None = typer.Option(None, min=1, help="The app's profiler.max_forward_steps (default: "
                                                 "the config's): a window's bound in engine steps."),
) -> None:  # fmt: skip
    if engine not in CONFIGS:
        raise typer.BadParameter(f"--engine {engine!r}: give transformers or vllm")
    against = against or ("vllm" if engine == "vllm" else "none")
    if against not in ("vllm", "none"):
        raise typer.BadParameter(f"--against {against!r}: give vllm or none")
    if control_via not in ("listener", "port"):
        raise typer.BadParameter(f"--control-via {control_via!r}: give listener or port")
    if generation_via not in ("listener", "port"):
        raise typer.BadParameter(f"--generation-via {generation_via!r}: give listener or port")
    if quick:
        seconds, rounds, sync_every_s = 8.0, 1, 1.0
        clients = "64" if clients == "8,256,1024,4096" else clients
    ns = [int(c) for c in clients.split(",")]
    cycles = max(1, round(seconds / (CYCLE * sync_every_s)))
    plan = Plan(seconds=seconds, ticks=CYCLE * cycles)
    idle_ticks = CYCLE * (1 if quick else 2)
    os.environ.update({k: os.environ.get(k, v) for k, v in VLLM_ENV.items()})
    # Every server process holds a socket per client, plus Ray's and vLLM's own: raised before
    # anything starts, so they inherit it.
    fds = raise_open_files_limit(2 * max(ns) + 4096)
    config = CONFIGS[engine]
    spec = yaml.safe_load(Path(config).read_text())["applications"][0]
    cfg_args = spec.get("args", {})
    work = Path(tempfile.mkdtemp(prefix="bench-control-load-"))
    args: dict[str, Any] = {**cfg_args, "save_path": str(work / "traces"), "weights_dir": str(work / "weights")}
    if engine == "vllm":  # one engine each side: the 2 cores hold two vLLM engines, not three
        args["num_replicas"] = 1
    args.pop("control_listener", None)  # a config's port: this run's is free, or there is none
    if control_via == "listener":
        args["control_listener"] = {"port": free_port()}
    args.pop("replica_listener", None)
    if generation_via == "listener":
        args["replica_listener"] = {"port": free_port()}
    if max_forward_steps is not None:
        args["profiler"] = {**cfg_args.get("profiler", {}), "max_forward_steps": max_forward_steps}
    threads = replica_omp_threads(args)
    if engine == "vllm":
        args["replica_env"] = {**cfg_args.get("replica_env", {}), "OMP_NUM_THREADS": threads}
    parsed = parse_args(args)
    args["model_path"] = parsed.model_path or str(ensure_tiny_model(parsed.tiny_model))
    body = {"model": parsed.model_name, "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True, "n": n}
    name = spec.get("name", "rollout")
    report = Report(
        engine=engine, config=config, against=against, control_via=control_via, generation_via=generation_via,
        clients=ns, seconds=seconds,
        rounds=rounds, sync_every_s=sync_every_s, sync_spacing_s=plan.spacing_s, n=n, max_tokens=max_tokens,
        omp_threads=threads, profiling=profiling, max_forward_steps=parsed.profiler.max_forward_steps,
        source=_source(),
        machine={"cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg(), "open_files": fds,
                 "load_generator": f"aiohttp {aiohttp.__version__}, in a child process"},
    )  # fmt: skip
    save = Path(json_path) if json_path else work / "control_under_load.json"
    total_syncs = idle_ticks + plan.ticks * rounds * len(ns)
    console.print(
        f"engine {engine} ({config}, {args.get('num_replicas')} replicas), against {against}, control via "
        f"{control_via}, generation via {generation_via}, N={ns}, "
        f"{rounds} rounds of {seconds:.0f} s, a sync every {plan.spacing_s:.2f} s, OMP_NUM_THREADS={threads}, "
        f"{f'windows of at most {report.max_forward_steps} engine steps' if profiling else 'no profiling'}, "
        f"open files {fds}; app code {report.source}"
    )
    with contextlib.ExitStack() as stack:
        # Ray first: its head gives up after 30 s when the machine is busy starting vLLM as well.
        port = stack.enter_context(local_cluster())
        vproc = None
        if against == "vllm":
            ref_port = free_port()
            cmd = vllm_server_command(sys.executable, args["model_path"], parsed.model_name, parsed.vllm, ref_port)
            env = {**VLLM_ENV, **args.get("replica_env", {}), "OMP_NUM_THREADS": threads, "VLLM_SERVER_DEV_MODE": "1"}
            vproc = stack.enter_context(reference_server(cmd, env, work / "vllm-server.log"))
        app_url = run_app(port, name, args)
        listener = parsed.control_listener
        control_url = None if listener is None else http_url(listener.host, listener.port)
        replicas = parsed.replica_listener
        load_url = app_url if replicas is None else http_url(replicas.host, replicas.port)
        load = stack.enter_context(load_generator())
        if vproc is not None:
            _wait_ready(f"http://127.0.0.1:{ref_port}", vproc, work / "vllm-server.log")
        cpu = CpuMeter(vproc.pid if vproc else -1, replica_pids(name), load.pid)

        async def measure() -> None:
            publisher = WeightsPublisher(args["model_path"], work / "weights")
            app = AppSide(load_url, body, total_syncs, publisher, control_url, app_url, profiling)
            sides: list[Side] = [app]
            if vproc is not None:
                sides.append(VllmSide(f"http://127.0.0.1:{ref_port}", body))
            try:
                await app.sync.begin()
                await _measure(report, sides, load, cpu, plan, idle_ticks, drain_s, n * max_tokens, save)
            finally:
                for side in sides:
                    await side.aclose()

        asyncio.run(measure())
    report.machine["loadavg_at_end"] = os.getloadavg()
    report.goals = _goals(report)
    save.write_text(report.model_dump_json(indent=1))
    side_names = [APP] + ([VLLM] if against == "vllm" else [])
    calls = {APP: APP_CALLS, VLLM: VllmSide.calls}
    for n_clients in ns:
        _print_n(report, n_clients, side_names, calls)
    _print_problems(report)
    _print_goals(report.goals)
    console.print(f"raw figures: {save} (working directory {work}, vLLM's server log in it)")


if __name__ == "__main__":  # vLLM spawns processes, and so does the load generator: the guard is required
    typer.run(main)
