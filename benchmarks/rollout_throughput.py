"""Output tokens/s through this app on `engine: vllm` against a reference server (vLLM's own
OpenAI server, or Ray Serve LLM), on the same tiny model, under the same closed-loop load,
measured side by side in one run.

* the app: the first application of `--config` (default config/serve.vllm.yaml) with 1 replica,
  profiler idle, on a private local Ray bound to 127.0.0.1 (`trainer/local_app.py`);
* vLLM's server: `python -m vllm.entrypoints.openai.api_server` on the same model directory with
  the config's `dtype`, `max_model_len` and `enforce_eager`, on 127.0.0.1, with the same thread
  settings as the app's replica (`OMP_NUM_THREADS`: `--omp-threads`, else what the replica gets:
  the config's `replica_env`, else Ray's default for the replica's `num_cpus`, floor with at
  least 1);
* or, with `--against ray-serve-llm --python P`, Ray Serve LLM's OpenAI app on vLLM on CPU
  (benchmarks/ray_serve_llm_app.py), run by the Python `P` of an environment where
  `ray.serve.llm` imports with the vLLM its Ray pins, on its own private Ray.

Both servers are up at once and the runs alternate (app, vLLM, vLLM, app, ...: no drift bias).
Each run is `--clients` clients, each sending one `/v1/completions` request at a time with
`--prompts` prompts, `--max-tokens` tokens, temperature 1 and `ignore_eos` (dropped, and said so,
where a server refuses it), for `--seconds`; output tokens are the responses' `usage`. It prints
tokens/s per run, the medians and their ratio; the CPU time every process on the machine used
per 1000 output tokens, by role (Serve proxy, ingress, replica, EngineCore, worker, API server,
Ray, the load, other users of the machine) and the ratio of CPU per token of all our processes,
which is the throughput ratio where the cores are the bottleneck, unskewed by other users of a
shared machine; and the threads and OMP_NUM_THREADS of each side's processes.

    python benchmarks/rollout_throughput.py [--runs 6] [--seconds 20] [--clients 4] [--prompts 4]
        [--max-tokens 64] [--omp-threads N] [--logprobs K] [--config config/serve.vllm.yaml]
        [--against vllm|ray-serve-llm] [--python P] [--quick]
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import typer
import yaml
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from serve_app.app import parse_args
from serve_app.engines.vllm.options import VllmOptions
from serve_app.net import free_port
from serve_app.tiny_model import ensure_tiny_model
from trainer.local_app import local_cluster, run_app

console = Console()
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}
APP, VLLM, RAY_SERVE_LLM = "app", "vLLM server", "Ray Serve LLM"
OTHERS = "other processes (not this benchmark's)"


class Load(BaseModel):
    clients: int
    prompts: int
    max_tokens: int
    logprobs: int | None

    def body(self, model: str, ignore_eos: bool) -> dict[str, Any]:
        """One request: `prompts` distinct short prompts, sampled at temperature 1, no seed (a
        per-request seed gives vLLM one generator per sequence: slower sampling on both sides)."""
        body: dict[str, Any] = {
            "model": model,
            "prompt": [f"The rollout server answers question {i}" for i in range(self.prompts)],
            "max_tokens": self.max_tokens,
            "temperature": 1.0,
        }
        if ignore_eos:
            body["ignore_eos"] = True
        if self.logprobs is not None:
            body["logprobs"] = self.logprobs
        return body


class Run(BaseModel):
    tokens: int
    requests: int
    seconds: float
    cpu_s: dict[str, float] = {}
    """CPU seconds used during the run, by role (`cpu_by_role`)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


async def _run(url: str, body: dict[str, Any], clients: int, seconds: float) -> Run:
    """Closed loop: each client sends its next request when the previous one is answered; no new
    request after `seconds`, and the time counts until the last one is answered."""
    tokens = requests = 0
    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:
        t0 = time.perf_counter()
        deadline = t0 + seconds

        async def client() -> None:
            nonlocal tokens, requests
            while time.perf_counter() < deadline:
                r = await c.post("/v1/completions", json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"{url}: /v1/completions answered {r.status_code}: {r.text[:300]}")
                tokens += r.json()["usage"]["completion_tokens"]
                requests += 1

        await asyncio.gather(*(client() for _ in range(clients)))
        return Run(tokens=tokens, requests=requests, seconds=time.perf_counter() - t0)


def _accepts_ignore_eos(url: str, model: str) -> tuple[bool, str]:
    """Whether the server takes `ignore_eos` (the app refused it before issue 14)."""
    r = httpx.post(
        f"{url}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2, "ignore_eos": True}, timeout=120
    )
    if r.status_code == 200:
        return True, ""
    if r.status_code in (400, 422):
        return False, r.text[:200]
    raise RuntimeError(f"{url}: probing ignore_eos answered {r.status_code}: {r.text[:300]}")


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(
                f"the reference server exited with {proc.returncode} while starting; its log ends:\n{tail}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        time.sleep(1)
    raise TimeoutError(f"the reference server did not answer /v1/models within {timeout_s:.0f}s (log: {log})")


def vllm_server_command(python: str, model_dir: str, name: str, opts: VllmOptions, port: int) -> list[str]:
    """vLLM's own OpenAI server on the app's engine settings."""
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir, "--served-model-name", name,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", opts.dtype, "--max-model-len", str(opts.max_model_len),
    ]  # fmt: skip
    return [*cmd, "--enforce-eager"] if opts.enforce_eager else cmd


def ray_serve_llm_command(
    python: str, model_dir: str, name: str, opts: VllmOptions, port: int, num_cpus: float
) -> list[str]:
    """Ray Serve LLM's OpenAI app (benchmarks/ray_serve_llm_app.py) under `python`, whose
    environment has the vLLM Ray Serve LLM pins."""
    return [
        python, str(Path(__file__).with_name("ray_serve_llm_app.py")),
        "--model-dir", model_dir, "--name", name, "--port", str(port),
        "--dtype", opts.dtype, "--max-model-len", str(opts.max_model_len), "--num-cpus", str(num_cpus),
    ]  # fmt: skip


@contextlib.contextmanager
def reference_server(cmd: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The reference server `cmd` in its own process group, not yet ready (`_wait_ready`): it
    starts while the app does. Stopped by SIGTERM to its pid (it stops what it started), then
    SIGKILL to its group if it hangs."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group we created for it: its engine processes
            proc.wait()


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                children.setdefault(int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(p.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


_TICK_S = 1 / os.sysconf("SC_CLK_TCK")
_OUR_RAY_ROLES = (
    (b"ray::ProxyActor", f"{APP}: Serve proxy"),
    (b"ray::ServeReplica:", f"{APP}: ingress"),  # the other Serve replica: RolloutReplica's tree is known
    (b"ray::ServeController", "Ray: Serve controller"),
)


def _title(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]


def _engine_role(pid: int, roots: Collection[int], root_name: str) -> str:
    """EngineCore, worker or `root_name` (for one of `roots`) for a process of a vLLM frontend's
    tree."""
    if pid in roots:
        return root_name
    title = _title(pid)
    return "vLLM EngineCore" if b"EngineCore" in title else "vLLM worker" if b"Worker" in title else "vLLM helpers"


def _role(
    pid: int,
    me: int,
    ref: str,
    ref_root: int,
    ref_tree: set[int],
    replica_roots: Collection[int],
    app_tree: set[int],
    named: Mapping[int, str],
) -> str:
    if pid in named:
        return named[pid]
    if pid in ref_tree:
        return f"{ref}: " + _engine_role(pid, (ref_root,), "API server" if ref == VLLM else "launcher")
    if pid in app_tree:
        return f"{APP}: " + _engine_role(pid, replica_roots, "replica")
    if pid == me:
        return "load generator (this process)"
    title = _title(pid)
    return next((role for marker, role in _OUR_RAY_ROLES if title.startswith(marker)), "Ray: system")


def cpu_by_role(
    ref: str, ref_root: int, replica_roots: Collection[int], named: Mapping[int, str] | None = None
) -> dict[str, float]:
    """CPU seconds (user + system) used so far by every process on this machine, by role. Ours
    descend from this process (the local Ray's processes, the app's rollout replicas
    `replica_roots` and their engines, the reference server `ref` and what it started); the rest
    are other users of the machine. `named`: pids of ours whose role the caller names (a load
    generator in a child process), this process's included."""
    me = os.getpid()
    ours = set(_descendants(me))
    ref_tree = set(_descendants(ref_root))
    app_tree = {pid for root in replica_roots for pid in _descendants(root)}
    cpu: dict[str, float] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        pid = int(p.name)
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
            used = (int(fields[11]) + int(fields[12])) * _TICK_S
            role = (
                _role(pid, me, ref, ref_root, ref_tree, replica_roots, app_tree, named or {})
                if pid in ours
                else OTHERS
            )
            cpu[role] = cpu.get(role, 0.0) + used
    return cpu


def replica_pids(app_name: str) -> list[int]:
    """The app's rollout replicas among this process's descendants (other users' apps may share
    its name)."""
    marker = f"ray::ServeReplica:{app_name}:RolloutReplica".encode()
    found = []
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(OSError):
            if _title(pid).startswith(marker):
                found.append(pid)
    return found


def thread_report(label: str, root: int) -> list[tuple[str, str, str, str]]:
    """(side, process, threads, OMP_NUM_THREADS) for `root` and its descendants (/proc)."""
    rows = []
    for pid in _descendants(root):
        with contextlib.suppress(OSError):
            d = Path(f"/proc/{pid}")
            title = d.joinpath("cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")[:48]
            threads = next(
                line.split()[1] for line in d.joinpath("status").read_text().splitlines() if line.startswith("Threads:")
            )
            env = dict(kv.split(b"=", 1) for kv in d.joinpath("environ").read_bytes().split(b"\0") if b"=" in kv)
            rows.append((label, f"{pid} {title}", threads, env.get(b"OMP_NUM_THREADS", b"unset").decode()))
    return rows


def replica_omp_threads(args: dict[str, Any]) -> str:
    """OMP_NUM_THREADS the app's replica runs with: its replica_env's, else Ray's default for an
    actor's `num_cpus` (floor, at least 1: 1 for any fractional share)."""
    if "OMP_NUM_THREADS" in args.get("replica_env", {}):
        return str(args["replica_env"]["OMP_NUM_THREADS"])
    return str(max(1, math.floor(float(args.get("replica_num_cpus", 0.25)))))


def _alternating(runs: int, ref: str) -> Iterator[str]:
    for i in range(runs):
        yield from (APP, ref) if i % 2 == 0 else (ref, APP)


def main(
    runs: int = typer.Option(6, min=1, help="Load runs per server, alternating."),
    seconds: float = typer.Option(20.0, min=1, help="Seconds per load run."),
    clients: int = typer.Option(4, min=1, help="Concurrent closed-loop clients."),
    prompts: int = typer.Option(4, min=1, help="Prompts per request."),
    max_tokens: int = typer.Option(64, min=1, help="max_tokens of each request."),
    omp_threads: int | None = typer.Option(None, min=1, help="OMP_NUM_THREADS of both (default: the replica's)."),
    logprobs: int | None = typer.Option(None, min=0, help="Ask both for `logprobs` (default: not asked)."),
    config: str = typer.Option("config/serve.vllm.yaml", help="The app's Serve config."),
    against: str = typer.Option(
        "vllm", help="The reference server: 'vllm' (vLLM's own OpenAI server) or 'ray-serve-llm' (Ray Serve LLM)."
    ),
    python: str = typer.Option(
        sys.executable,
        help="The Python of the reference server's environment (for ray-serve-llm: one where ray.serve.llm "
        "imports with the vLLM Ray pins).",
    ),
    quick: bool = typer.Option(False, help="A smoke run: 2 runs of 5 s each."),
) -> None:
    if quick:
        runs, seconds = 2, 5.0
    os.environ.update({k: os.environ.get(k, v) for k, v in VLLM_ENV.items()})
    load = Load(clients=clients, prompts=prompts, max_tokens=max_tokens, logprobs=logprobs)
    spec = yaml.safe_load(Path(config).read_text())["applications"][0]
    cfg_args = spec.get("args", {})
    threads = str(omp_threads) if omp_threads is not None else replica_omp_threads(cfg_args)
    work = Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    if against not in ("vllm", "ray-serve-llm"):
        raise typer.BadParameter(f"--against {against!r}: give 'vllm' or 'ray-serve-llm'")
    ref = VLLM if against == "vllm" else RAY_SERVE_LLM
    args = {
        **cfg_args,
        "num_replicas": 1,
        "save_path": str(work / "traces"),
        "weights_dir": str(work / "weights"),
        "replica_env": {**cfg_args.get("replica_env", {}), "OMP_NUM_THREADS": threads},
    }
    parsed = parse_args(args)
    args["model_path"] = parsed.model_path or str(ensure_tiny_model(parsed.tiny_model))
    vllm_env = {**VLLM_ENV, **cfg_args.get("replica_env", {}), "OMP_NUM_THREADS": threads}
    console.print(f"starting the app ({config}, 1 replica) and {ref}, OMP_NUM_THREADS={threads} in both ...")
    log = work / "reference.log"
    name = spec.get("name", "rollout")
    ref_port = free_port()
    cmd = (
        vllm_server_command(python, args["model_path"], parsed.model_name, parsed.vllm, ref_port)
        if ref == VLLM
        else ray_serve_llm_command(
            python, args["model_path"], parsed.model_name, parsed.vllm, ref_port, parsed.replica_num_cpus
        )
    )
    # Ray first: its head gives up after 30 s when the machine is busy starting vLLM as well.
    with local_cluster() as port, reference_server(cmd, vllm_env, log) as vproc:
        app_url = run_app(port, name, args)
        vurl = f"http://127.0.0.1:{ref_port}"
        _wait_ready(vurl, vproc, log)
        urls = {APP: app_url, ref: vurl}
        bodies = {}
        for side, url in urls.items():
            ok, why = _accepts_ignore_eos(url, parsed.model_name)
            if not ok:
                console.print(f"[yellow]{side} refuses ignore_eos ({why}); its requests go without it[/yellow]")
            bodies[side] = load.body(parsed.model_name, ok)
        for side in urls:  # warm-up, outside the figures
            asyncio.run(_run(urls[side], bodies[side], clients, min(seconds, 3.0)))
        replicas = replica_pids(name)
        results: dict[str, list[Run]] = {APP: [], ref: []}
        for side in _alternating(runs, ref):
            before = cpu_by_role(ref, vproc.pid, replicas)
            r = asyncio.run(_run(urls[side], bodies[side], clients, seconds))
            after = cpu_by_role(ref, vproc.pid, replicas)
            r.cpu_s = {role: after[role] - before.get(role, 0.0) for role in after}
            results[side].append(r)
            console.print(f"  {side:12s} run {len(results[side])}: {r.tokens_per_s:8.1f} tok/s ({r.requests} requests)")
        rows = [row for replica in replicas for row in thread_report(APP, replica)] + thread_report(ref, vproc.pid)
    _print(results, ref, load, seconds, rows)
    console.print(f"(working directory {work}, the reference server's log in it)")


def rounds_table(title: str, what: str, run: str, rows: list[tuple[str, list[float], str]]) -> Table:
    """One row per thing measured (`label`, its value in each run, `fmt`), a column per run
    (`run` + 1, 2, ...) and the median: how every side-by-side benchmark here prints its runs."""
    table = Table(title=title)
    table.add_column(what)
    for i in range(max(len(values) for _, values, _ in rows)):
        table.add_column(f"{run}{i + 1}", justify="right")
    table.add_column("median", justify="right")
    for label, values, fmt in rows:
        table.add_row(label, *(format(v, fmt) for v in values), format(statistics.median(values), fmt))
    return table


def _print(
    results: dict[str, list[Run]], ref: str, load: Load, seconds: float, rows: list[tuple[str, str, str, str]]
) -> None:
    title = (
        f"Output tokens/s, {load.clients} clients x {load.prompts} prompts x {load.max_tokens} tokens, "
        f"{len(results[APP])} runs of {seconds:.0f} s each"
    )
    runs = [(side, [r.tokens_per_s for r in rs], ".0f") for side, rs in results.items()]
    console.print(rounds_table(title, "server", "run ", runs))
    ratio = statistics.median(r.tokens_per_s for r in results[APP]) / statistics.median(
        r.tokens_per_s for r in results[ref]
    )
    goal = 0.9 if ref == VLLM else 1.0
    console.print(f"app / {ref} (medians): [bold]{ratio:.2f}x[/bold] (goal >= {goal})")
    cpu = Table(title="CPU ms per 1000 output tokens, by process (medians over each server's runs)")
    for col in ("process", f"during {APP} runs", f"during {ref} runs"):
        cpu.add_column(col, justify="left" if col == "process" else "right")
    roles = sorted({role for rs in results.values() for r in rs for role in r.cpu_s})
    per_kt = {side: {role: _median_per_kt(rs, role) for role in roles} for side, rs in results.items()}
    for role in roles:
        if max(per_kt[APP][role], per_kt[ref][role]) >= 0.5:
            cpu.add_row(role, *(f"{per_kt[side][role]:.0f}" for side in (APP, ref)))
    ours = {side: statistics.median(_ours_per_kt(r) for r in rs) for side, rs in results.items()}
    cpu.add_row("[bold]all of this benchmark's processes[/bold]", *(f"{ours[side]:.0f}" for side in (APP, ref)))
    busy = {side: statistics.median(sum(r.cpu_s.values()) / r.seconds for r in rs) for side, rs in results.items()}
    cpu.add_row("busy cores, all processes (median)", *(f"{busy[side]:.2f}" for side in (APP, ref)))
    console.print(cpu)
    console.print(
        f"CPU per token, {ref} / app: [bold]{ours[ref] / ours[APP]:.2f}x[/bold] (where the cores are the "
        "bottleneck, the throughput ratio that other users of the machine do not skew)"
    )
    threads = Table(title="Processes after the runs")
    for col in ("side", "pid, process", "threads", "OMP_NUM_THREADS"):
        threads.add_column(col)
    for row in rows:
        threads.add_row(*row)
    console.print(threads)


def _ours_per_kt(run: Run) -> float:
    """CPU ms per 1000 tokens of every process this benchmark started (both servers, Ray, the load)."""
    return sum(v for role, v in run.cpu_s.items() if role != OTHERS) * 1000 / (run.tokens / 1000)


def _median_per_kt(runs: list[Run], role: str) -> float:
    return statistics.median(r.cpu_s.get(role, 0.0) * 1000 / (r.tokens / 1000) for r in runs)


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    typer.run(main)
