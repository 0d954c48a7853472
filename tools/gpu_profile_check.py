"""The CUDA profiling check without Ray or vLLM: part 1 of tools/gpu_check.sh.

`python -m tools.gpu_profile_check run --out DIR [--device cuda|cpu]` drives this project's own
profiling library in one process, as a rollout replica and a trainer rank would, on the tiny Llama
moved to the device: step 1 records forward passes on weights version 0 (the rollout window) and
the fit steps producing version 1 (the trainer window); the trainer's weights are copied into the
rollout model as version 1; step 2 does the same on version 1. Every pass runs inside
`ProfileSession.forward_step(version)`, exactly as the embedded engine's do. It then merges each
step, runs `python -m profiling verify` over the traces, and on CUDA checks that every
forward-step range launched CUDA kernels (trace events of category `kernel`). torch.profiler is
one per process, so the rollout and trainer windows of a step are recorded one after the other.

`python -m tools.gpu_profile_check kernels SAVE_PATH` runs only that last check over every rollout
trace of a save path (the vLLM part of tools/gpu_check.sh uses it).

Each check prints one `PASS|FAIL|SKIP <name>: <detail>` line; exit status 0 when none failed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

ROLLOUT_ID = "gpu-check-0"
STEPS = (1, 2)
VERIFY_TIMEOUT_S = 120
Status = Literal["PASS", "FAIL", "SKIP"]


@dataclass
class Check:
    """One line of the report."""

    status: Status
    name: str
    detail: str

    def line(self) -> str:
        return f"{self.status} {self.name}: {self.detail}"


class Report:
    """Checks in the order they ran, printed as they come (a hung later part keeps the earlier lines)."""

    def __init__(self) -> None:
        self.checks: list[Check] = []

    def add(self, status: Status, name: str, detail: str) -> None:
        check = Check(status, name, detail)
        self.checks.append(check)
        print(check.line(), flush=True)

    def expect(self, ok: bool, name: str, detail: str) -> bool:
        self.add("PASS" if ok else "FAIL", name, detail)
        return ok

    @property
    def failed(self) -> bool:
        return any(c.status == "FAIL" for c in self.checks)


# -- trace reading -----------------------------------------------------------------------------


def load_events(path: Path) -> list[dict[str, Any]]:
    """The `traceEvents` of one Chrome trace (plain or gzipped JSON)."""
    raw = path.read_bytes()
    data = json.loads(gzip.decompress(raw) if path.name.endswith(".gz") else raw)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict)]


def marker_names(events: list[dict[str, Any]], prefix: str) -> list[str]:
    """Names of the user-annotation ranges starting with `prefix`, in the order they opened."""
    found = [e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(prefix)]
    return [e["name"] for e in sorted(found, key=lambda e: float(e["ts"]))]


@dataclass
class KernelCount:
    """CUDA kernels launched from inside engine-step ranges of one trace."""

    ranges: int
    ranges_with_kernels: int
    kernels_in_ranges: int
    kernels: int


def kernels_in_ranges(events: list[dict[str, Any]], prefixes: tuple[str, ...]) -> KernelCount:
    """Count the kernels each range (a user annotation whose name starts with one of `prefixes`)
    launched: a kernel runs on the GPU's own timeline, after its launch, so it belongs to the range
    that holds its launch (the runtime or driver call with the same `correlation`), not to the
    range that its own timestamps fall in. Launches are matched by process and time, not thread:
    an engine may launch from a thread other than the one that opened the range."""
    ranges = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(prefixes)
    ]
    launches = [
        e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    ]
    kernels_by_corr: dict[Any, int] = {}
    kernels = 0
    for e in events:
        if e.get("cat") == "kernel":
            kernels += 1
            corr = e.get("args", {}).get("correlation")
            kernels_by_corr[corr] = kernels_by_corr.get(corr, 0) + 1
    with_kernels = in_ranges = 0
    for r in ranges:
        t0, t1 = float(r["ts"]), float(r["ts"]) + float(r.get("dur", 0))
        n = sum(
            kernels_by_corr.get(launch["args"]["correlation"], 0)
            for launch in launches
            if launch.get("pid") == r.get("pid") and t0 <= float(launch["ts"]) <= t1
        )
        with_kernels += n > 0
        in_ranges += n
    return KernelCount(len(ranges), with_kernels, in_ranges, kernels)


def check_kernels(report: Report, save_path: Path, steps: list[int] | None = None) -> None:
    """For each step's rollout traces under `save_path`: every engine-step range (the entry's
    `trace_dialect.forward_range`) launched kernels."""
    from profiling.store import TraceStore

    store = TraceStore(save_path)
    steps = steps or store.steps()
    if not steps:
        report.add("FAIL", "cuda-kernels", f"no step directories under {save_path}")
        return
    for k in steps:
        manifest = store.read_manifest(k)
        files = [
            (store.step_dir(k) / f, e.trace_dialect.forward_range)
            for e in (manifest.entries if manifest else [])
            if e.role == "rollout"
            for f in e.files
            if f.endswith((".json", ".json.gz"))
        ]
        if not files:
            report.add("FAIL", f"cuda-kernels step {k}", "no rollout Chrome trace in the manifest")
            continue
        for path, forward_range in files:
            c = kernels_in_ranges(load_events(path), (forward_range,))
            report.expect(
                c.ranges > 0 and c.ranges_with_kernels == c.ranges,
                f"cuda-kernels step {k} {path.parent.name}",
                f"{c.ranges_with_kernels}/{c.ranges} engine-step ranges launched kernels "
                f"({c.kernels_in_ranges} of the trace's {c.kernels} kernels)",
            )


def run_verify(report: Report, save_path: Path, name: str = "verify") -> None:
    """`python -m profiling verify SAVE_PATH`: exit 0 is clean, 1 lists violations."""
    cmd = [sys.executable, "-m", "profiling", "verify", str(save_path)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=VERIFY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        report.add("FAIL", name, f"no answer within {VERIFY_TIMEOUT_S} s")
        return
    tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-6:])
    if done.returncode == 0:
        report.add("PASS", name, f"no violation ({tail})" if tail else "no violation")
    elif done.returncode == 1:
        report.add("FAIL", name, f"violations: {tail}")
    else:
        report.add("FAIL", name, f"verify did not run (exit {done.returncode}): {tail}")


# -- the in-process run ------------------------------------------------------------------------


def run(out: Path, device: str, passes: int, fit_steps: int, cache_dir: Path | None) -> Report:
    """Record steps 1 and 2 under `out/traces` on `device` and check them."""
    import torch
    from transformers import LlamaForCausalLM

    from profiling.analysis.merge import MergeError, merge_step
    from profiling.backends.torch_profiler import init_kineto, quiet_kineto_env
    from profiling.clock_exchange import own_offset
    from profiling.config import ProfileOptions
    from profiling.manifest import ManifestEntry, SessionRecord, SyncCost
    from profiling.markers import FORWARD_STEP, format_forward_step
    from profiling.session import ProfileSession, SessionSpec
    from profiling.store import TraceStore
    from serve_app.tiny_model import ensure_tiny_model

    report = Report()
    if device == "cuda" and not torch.cuda.is_available():
        report.add("FAIL", "device", "torch sees no CUDA device (run with --device cpu on a machine without one)")
        return report
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    report.add("PASS", "device", f"{name}, torch {torch.__version__}")
    activities: list[Literal["cpu", "cuda"]] = ["cpu", "cuda"] if device == "cuda" else ["cpu"]
    options = ProfileOptions(tool="torch", activities=activities, max_forward_steps=1000, max_duration_s=300)

    quiet_kineto_env()
    init_kineto()  # on this, the thread that imported torch (see init_kineto)
    model_dir = ensure_tiny_model(cache_dir=cache_dir)
    torch.manual_seed(0)
    loaded = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = loaded.config.vocab_size
    # Typed as modules: transformers' own `to` signature rejects a device name.
    rollout_model: torch.nn.Module = loaded
    policy: torch.nn.Module = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rollout_model.to(device).eval()
    policy.to(device).train()
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    prompts = torch.randint(4, vocab, (4, 32), device=device)

    def generate_pass() -> None:
        with torch.no_grad():
            rollout_model(prompts)

    def fit_step() -> None:
        loss = policy(prompts, labels=prompts).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def load_weights() -> None:  # the rollout replica loads the version the trainer published
        with torch.no_grad():
            for dst, src in zip(rollout_model.parameters(), policy.parameters(), strict=True):
                dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()

    root = out / "traces"
    store = TraceStore(root)
    exporter = ThreadPoolExecutor(1, thread_name_prefix="export")
    rollout = ProfileSession(
        store=store, entry_identity=ManifestEntry(role="rollout", replica_id=ROLLOUT_ID), exporter=exporter
    )
    trainer = ProfileSession(store=store, entry_identity=ManifestEntry(role="trainer", rank=0), exporter=exporter)
    version = 0
    try:
        for k in STEPS:
            assert version == k - 1  # step k: generation on weights k-1, fit steps producing k
            spec = SessionSpec(step=k, steps=[k], options=options)
            record = SessionRecord(
                step=k, steps=[k], tool="torch", options=options, started_at=time.time(), replicas=[ROLLOUT_ID]
            )
            store.write_session(k, record)
            rollout.start(spec, weight_version=version)
            for _ in range(passes):
                with rollout.forward_step(version):
                    generate_pass()
            cost = SyncCost(began_at=time.time())
            t0 = time.perf_counter()
            rollout.stop(k)
            cost.stop_s = time.perf_counter() - t0
            held_from = t0
            record.stopped_at = time.time()
            record.clock_offsets[ROLLOUT_ID] = own_offset()
            store.write_session(k, record)

            trainer.start(spec, weight_version=version)
            for _ in range(fit_steps):
                with trainer.forward_step(version):
                    fit_step()
            trainer.stop(k)

            before = next(rollout_model.parameters()).detach().clone()
            t0 = time.perf_counter()
            rollout.mark_weight_update(version + 1, load_weights)
            cost.update_s = time.perf_counter() - t0
            moved = float((next(rollout_model.parameters()).detach() - before).abs().max())
            report.expect(moved > 0, f"weights step {k}", f"version {version + 1} loaded (max change {moved:.2e})")
            version += 1
            # As a replica stopped with pause: admission held from the stop through the update,
            # so every pass on version k-1 ran inside step k's window.
            rollout.annotate(k, sync_held_s=time.perf_counter() - held_from, forward_steps_outside=0)
            trainer.annotate(k, sync=cost, clock_offset=own_offset())
        for k in STEPS:
            for session in (rollout, trainer):
                session.wait_exported(k, timeout=120)
    finally:
        exporter.shutdown(wait=True)

    for k in STEPS:
        manifest = store.refresh_manifest(k)
        counts = {e.key: e.forward_steps for e in manifest.entries}
        want = {f"rollout/{ROLLOUT_ID}": passes, "trainer/rank_0": fit_steps}
        shown = ", ".join(f"{key}={n}" for key, n in counts.items())
        report.expect(
            manifest.status == "complete" and counts == want,
            f"manifest step {k}",
            f"status {manifest.status}, forward_steps {shown}" + ("" if counts == want else f" (expected {want})"),
        )
        for entry in manifest.entries:
            want_names = [format_forward_step(i, k, k - 1) for i in range(entry.forward_steps)]
            got = [n for f in entry.files for n in marker_names(load_events(store.step_dir(k) / f), FORWARD_STEP)]
            report.expect(
                got == want_names and len(got) > 0,
                f"markers step {k} {entry.key}",
                f"{len(got)} forward_step ranges, all weight_version={k - 1}"
                if got == want_names
                else f"got {got[:3]}... expected {want_names[:3]}...",
            )
        try:
            merged = merge_step(store, k)
            report.expect(
                merged is not None and merged.status == "ok",
                f"merge step {k}",
                f"{merged.events if merged else 0} events from {len(merged.processes) if merged else 0} traces",
            )
        except MergeError as e:
            report.add("FAIL", f"merge step {k}", str(e))
    if device == "cuda":
        check_kernels(report, root, list(STEPS))
    else:
        report.add("SKIP", "cuda-kernels", "cpu mode: no CUDA activity recorded")
    run_verify(report, root)
    return report


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_profile_check", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="record two steps in this process and check them")
    r.add_argument("--out", type=Path, required=True, help="directory for traces/ (made if missing)")
    r.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: activities [cpu] only")
    r.add_argument("--passes", type=int, default=4, help="rollout forward passes per step")
    r.add_argument("--fit-steps", type=int, default=2, help="trainer fit steps per step")
    r.add_argument("--cache-dir", type=Path, default=None, help="tiny model cache (default: the app's)")
    k = sub.add_parser("kernels", help="check CUDA kernels inside the engine-step ranges of a save path")
    k.add_argument("save_path", type=Path)
    return parser.parse_args(argv)


def _print_summary(report: Report) -> None:
    counts = {s: sum(c.status == s for c in report.checks) for s in ("PASS", "FAIL", "SKIP")}
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the command; 0 when no check failed, else 1."""
    args = _args(argv)
    if args.command == "kernels":
        report = Report()
        check_kernels(report, args.save_path)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        report = run(args.out, args.device, args.passes, args.fit_steps, args.cache_dir)
    _print_summary(report)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
