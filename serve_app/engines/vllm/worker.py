"""This project's profiler inside vLLM's worker processes: `ProfilingWorkerExtension`, injected
into every vLLM worker through `worker_extension_cls` (docs/engines.md#vllm-worker-profiling).

vLLM runs the model in worker processes (one per tensor-parallel rank) that the replica reaches
only through `collective_rpc`. The extension gives each worker:

* a forward-step range (`profiling.markers`) around every engine iteration that runs a forward
  pass while recording: the same contract as the embedded engine and the trainer; the
  version is set when weights load (`rollout_profiler_load_weights`), the step at start;
* this project's torch backend (`profiling.backends.torch_profiler`) instead of vLLM's profiler:
  start and finalize on the worker's own thread (torch.profiler records per thread), the export
  in a background thread of the worker, so a stop costs the finalize only; `max_forward_steps`
  ends a window in the worker itself;
* forward passes counted by weight version, recorded or not, so the replica can say how many ran
  outside any window;
* weights by collective (`WorkerWeights`): join the sync's group (serve_app/weights/collective.py), stage
  the tensors it delivers without touching the served model, then load them through vLLM's own
  in-place reload (`reload_weights` with a weights iterator: the layerwise reload that also redoes
  the kernel repacking vLLM's CPU and quantized layers do after a load).

The replica waits for an export by its record file: the worker writes
`<prefix>.rank<r>.export.json` (`WorkerExport`) into the replica's engine trace directory once
the trace beside it is complete. No RPC ever waits for an export: the worker's thread would stop
serving meanwhile.

Methods are called by name through `collective_rpc`, with and returning only plain data (vLLM
serializes both); their names carry the `rollout_profiler_`, `rollout_weights_` or `rollout_rpc_`
prefix, since vLLM refuses an extension whose attribute names clash with the worker's.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from profiling.backends.torch_profiler import TRACE_FILE, TorchProfilerBackend, quiet_kineto_env
from profiling.config import ProfileOptions
from profiling.manifest import AutoStop, ClockSample
from profiling.markers import format_forward_step, format_weight_update
from profiling.store import atomic_write_text
from profiling.trace_budget import TraceCut
from serve_app.weights.collective import connect_store, open_group, receive
from serve_app.weights.collective_schema import CollectiveTransfer

EXTENSION = f"{__name__}.ProfilingWorkerExtension"
"""vLLM's `worker_extension_cls` for this extension."""

if importlib.util.find_spec("vllm") is not None:
    # vLLM imports this module in each worker before the worker builds its weight-transfer
    # engine, so `backend: rollout_gloo` is known there (the replica imports it too: harmless).
    from serve_app.engines.vllm.gloo_transfer import register

    register()


class WorkerExport(BaseModel):
    """One worker's export of one recording, written after its trace file is complete."""

    rank: int
    file: str | None = None
    """The trace's file name in the engine trace directory (None: the export failed)."""
    forward_steps: int
    trace_bytes: int | None = None
    cut: TraceCut | None = None
    """Set when the trace was cut to `max_trace_mb`."""
    error: str | None = None


class WorkerStop(BaseModel):
    """What a worker's stop returns: the window's forward passes and why it ended early."""

    forward_steps: int
    forward_steps_in_window: int
    """Forward passes from the start to this stop, recorded or not (more after a cap)."""
    auto_stopped: AutoStop | None = None
    weight_versions: list[int]


def export_record(trace_dir: Path, prefix: str, rank: int) -> Path:
    """Where worker `rank` records the export of recording `prefix`."""
    return trace_dir / f"{prefix}.rank{rank}.export.json"


def trace_name(prefix: str, rank: int) -> str:
    """The name of worker `rank`'s trace of recording `prefix` in the engine trace directory."""
    return f"{prefix}.rank{rank}.{TRACE_FILE}"


class _Window:
    """One recording in one worker."""

    def __init__(self, step: int, options: ProfileOptions, prefix: str, trace_dir: Path, rank: int):
        self.step, self.options, self.prefix, self.trace_dir, self.rank = step, options, prefix, trace_dir, rank
        self.backend = TorchProfilerBackend(options)
        self.forward_steps = 0
        self.steps_in_window = 0
        """Forward passes from the start to the stop, recorded or run after the cap."""
        self.versions: list[int] = []
        self.auto_stopped: AutoStop | None = None
        self.stop_clock: ClockSample | None = None


class WorkerProfiler:
    """The state the extension keeps on one worker (created by `rollout_profiler_attach`)."""

    def __init__(self, rank: int, version: int):
        self.rank = rank
        self.version = version
        self.passes: dict[int, int] = {}
        """Forward passes run, by weight version."""
        self.recorded: dict[int, int] = {}
        """Forward passes recorded in a window, by weight version."""
        self.window: _Window | None = None
        self._exporter = ThreadPoolExecutor(1, thread_name_prefix="rollout-profiler-export")

    def wrap(self, execute_model: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """`execute_model` inside a forward-step range while recording, counted by version."""

        def execute_model_marked(scheduler_output: Any) -> Any:
            # An iteration that schedules no token runs no forward pass (vLLM calls it to
            # advance its own bookkeeping): neither counted nor marked.
            if scheduler_output.total_num_scheduled_tokens == 0:
                return execute_model(scheduler_output)
            v = self.version
            self.passes[v] = self.passes.get(v, 0) + 1
            window = self.window
            if window is not None:
                window.steps_in_window += 1
            if window is None or window.auto_stopped is not None:
                return execute_model(scheduler_output)
            n = window.forward_steps
            with window.backend.mark(format_forward_step(n, window.step, v)):
                out = execute_model(scheduler_output)
            window.forward_steps = n + 1
            self.recorded[v] = self.recorded.get(v, 0) + 1
            if v not in window.versions:
                window.versions.append(v)
            limit = window.options.max_forward_steps
            if limit is not None and n + 1 >= limit:
                self._finish(window, "max_forward_steps")
            return out

        return execute_model_marked

    def start(self, step: int, options: ProfileOptions, prefix: str, trace_dir: Path) -> ClockSample | None:
        if self.window is not None:
            raise RuntimeError(f"the worker is already recording step {self.window.step}")
        window = _Window(step, options, prefix, trace_dir, self.rank)
        window.versions.append(self.version)
        window.backend.start()
        self.window = window
        return window.backend.sample_clock("start")

    def clock(self, at: str) -> ClockSample | None:
        window = self.window
        if window is None:
            return None
        if window.auto_stopped is None:
            return window.backend.sample_clock(at)
        return window.stop_clock  # ended by itself: the sample taken then

    def stop(self) -> WorkerStop:
        window, self.window = self.window, None
        if window is None:
            raise RuntimeError("the worker is not recording")
        if window.auto_stopped is None:
            self._finish(window, None)
        return WorkerStop(
            forward_steps=window.forward_steps,
            forward_steps_in_window=window.steps_in_window,
            auto_stopped=window.auto_stopped,
            weight_versions=window.versions,
        )

    def load_weights(self, version: int, load: Callable[[], None]) -> None:
        window = self.window
        if window is not None and window.auto_stopped is None:
            with window.backend.mark(format_weight_update(version)):
                load()
        else:
            load()
        self.version = version

    def _finish(self, window: _Window, auto_stopped: AutoStop | None) -> None:
        """End the recording on this (the worker's) thread; export in the background."""
        window.stop_clock = window.backend.sample_clock("stop")
        window.auto_stopped = auto_stopped
        trace = window.backend.stop()
        self._exporter.submit(self._export, window, trace)

    @staticmethod
    def _export(window: _Window, trace: Any) -> None:
        record = WorkerExport(rank=window.rank, forward_steps=window.forward_steps)
        out = window.trace_dir / f".{window.prefix}.rank{window.rank}.export"
        try:
            (path,) = trace.export(out)
            final = window.trace_dir / trace_name(window.prefix, window.rank)
            path.replace(final)
            record.file, record.trace_bytes, record.cut = final.name, trace.trace_bytes, trace.cut
        except Exception as e:  # noqa: BLE001 - the record carries it to the replica's entry
            record.error = f"the vLLM worker's trace export failed: {e!r}"
        finally:
            shutil.rmtree(out, ignore_errors=True)
        atomic_write_text(export_record(window.trace_dir, window.prefix, window.rank), record.model_dump_json())


Reload = Callable[[Iterable[tuple[str, torch.Tensor]]], None]
"""Loads checkpoint-format tensors into the served model (vLLM: the worker's `reload_weights`)."""


class WorkerWeights:
    """One worker's weights by collective: what a transfer staged, and (rank 0 only) the
    checkpoint-format tensors of the last staged load, kept for a replica that joins later.

    vLLM cannot hand its served parameters back as a checkpoint: it fuses them (qkv_proj,
    gate_up_proj) and, on CPU, repacks linear weights for its kernels and drops the originals.
    So the tensors as they arrived are kept instead, on the host: rank 0 only, since every
    worker receives the full checkpoint."""

    def __init__(self, rank: int):
        self.rank = rank
        self.staged: dict[str, torch.Tensor] | None = None
        self.served: dict[str, torch.Tensor] | None = None
        """The last staged load's tensors on CPU (rank 0); None after a load from a path."""

    def receive(
        self, transfer: CollectiveTransfer, rank: int, world_size: int, timeout_s: float, device: torch.device
    ) -> int:
        """Join the sync's group as `rank` and stage every tensor it delivers on `device`;
        returns the bytes received. Whatever was staged before is dropped first."""
        self.staged = None
        store = connect_store(transfer.address, transfer.port, timeout_s)
        group = open_group(store, transfer, rank, world_size, timeout_s)
        staged = dict(receive(group, transfer, device))
        # The group is the sync's alone: dropped with these references, as the publisher drops its.
        del group, store
        self.staged = staged
        return transfer.total_bytes

    def load(self, version: int, profiler: WorkerProfiler, reload: Reload) -> None:
        """Load the staged tensors as `version` (inside the profiler's `weight_update` range)."""
        staged = self.staged
        if staged is None:
            raise RuntimeError(
                f"no weights are staged on vLLM worker {self.rank} for version {version}: the transfer "
                "did not reach this worker, or they were dropped; run the sync again"
            )
        profiler.load_weights(version, lambda: reload(iter(staged.items())))
        self.staged = None
        self.served = {n: t.cpu() for n, t in staged.items()} if self.rank == 0 else None

    def forget_served(self) -> None:
        """The served weights came another way (a path, the trainer's own transfer): the kept
        tensors are stale."""
        self.served = None

    def drop(self) -> None:
        self.staged = None

    def snapshot(self) -> bytes:
        """The served checkpoint as safetensors bytes (plain data for vLLM's serializer)."""
        from safetensors.torch import save

        if self.served is None:
            raise RuntimeError(
                "this vLLM engine holds no copy of its served weights as a checkpoint: only weights "
                "loaded by collective are kept (a path load is read from its file instead)"
            )
        # Received tensors are views into shared bucket buffers, which safetensors refuses.
        return save({n: t.contiguous().clone() for n, t in self.served.items()})


class ProfilingWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); every method runs on the worker's
    thread between engine iterations, called by the replica through `collective_rpc`."""

    rollout_profiler: WorkerProfiler
    rollout_weights: WorkerWeights

    def rollout_profiler_attach(self, version: int) -> None:
        """Wrap this worker's `execute_model` with the forward-step ranges (once, after the
        engine is built; `version`: the weights it was built with)."""
        if getattr(self, "rollout_profiler", None) is not None:
            return
        quiet_kineto_env()
        worker: Any = self
        self.rollout_profiler = WorkerProfiler(rank=int(getattr(worker, "rank", 0)), version=version)
        self.rollout_weights = WorkerWeights(self.rollout_profiler.rank)
        # An instance attribute: vLLM calls `worker.execute_model` by name, so this wrapper is
        # what every iteration runs (the class's method cannot be overridden by an extension).
        worker.execute_model = self.rollout_profiler.wrap(worker.execute_model)

    def rollout_profiler_start(
        self, step: int, options: dict[str, Any], prefix: str, trace_dir: str
    ) -> dict[str, Any] | None:
        """Start recording window `step` into `trace_dir`; the clock sample taken at start."""
        sample = self.rollout_profiler.start(step, ProfileOptions.model_validate(options), prefix, Path(trace_dir))
        return sample.model_dump() if sample else None

    def rollout_profiler_clock(self, at: str) -> dict[str, Any] | None:
        sample = self.rollout_profiler.clock(at)
        return sample.model_dump() if sample else None

    def rollout_profiler_stop(self) -> dict[str, Any]:
        """End the window (the finalize runs here); the export continues in the background."""
        return self.rollout_profiler.stop().model_dump()

    def rollout_profiler_load_weights(self, weights_path: str, version: int) -> dict[str, Any]:
        """vLLM's `reload_weights` from `weights_path`, as `version` (inside a `weight_update`
        range while recording). Returns the forward passes run and recorded so far, by version
        (as lists of pairs: plain data for vLLM's serializer)."""
        worker: Any = self
        self.rollout_profiler.load_weights(version, lambda: worker.reload_weights(weights_path=weights_path))
        self.rollout_weights.forget_served()
        return self._rollout_pass_counts()

    def rollout_weights_receive(
        self, transfer: dict[str, Any], first_rank: int, world_size: int, timeout_s: float
    ) -> int:
        """Join the collective transfer's group as rank `first_rank` + this worker's rank and
        stage the tensors (gloo: on the host; nccl: on this worker's GPU); the served model is
        untouched. Returns the bytes received."""
        worker: Any = self
        parsed = CollectiveTransfer.model_validate(transfer)
        device = worker.device if parsed.backend == "nccl" else torch.device("cpu")
        rank = first_rank + self.rollout_weights.rank
        return self.rollout_weights.receive(parsed, rank, world_size, timeout_s, device)

    def rollout_weights_load_staged(self, version: int) -> dict[str, Any]:
        """Load the staged tensors as `version` through vLLM's in-place reload (inside a
        `weight_update` range while recording); the pass counts, as the path load returns them."""
        worker: Any = self
        self.rollout_weights.load(
            version, self.rollout_profiler, lambda weights: worker.reload_weights(weights_iterator=weights)
        )
        return self._rollout_pass_counts()

    def rollout_weights_adopt(self, version: int) -> dict[str, Any]:
        """The trainer loaded `version` itself (through the engine's RPC): the forward-step
        markers carry it from here on. The pass counts, as a load returns them."""
        self.rollout_profiler.version = version
        self.rollout_weights.forget_served()
        return self._rollout_pass_counts()

    def rollout_weights_drop(self) -> None:
        """Free the staged tensors (the sync failed somewhere, or is abandoned)."""
        self.rollout_weights.drop()

    def rollout_weights_snapshot(self) -> bytes | None:
        """Rank 0: the served checkpoint as safetensors bytes (other ranks: None)."""
        return self.rollout_weights.snapshot() if self.rollout_weights.rank == 0 else None

    def rollout_rpc_function(self, function: bytes, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """A trainer's function of the worker (cloudpickled by the replica's engine RPC), called
        as `function(worker, *args, **kwargs)`: vLLM ships a pickled function only when it allows
        insecure serialization, and bytes are plain data."""
        import cloudpickle  # type: ignore[import-untyped]

        return cloudpickle.loads(function)(self, *args, **kwargs)

    def _rollout_pass_counts(self) -> dict[str, Any]:
        """Forward passes run and recorded so far, by version (lists of pairs: plain data)."""
        profiler = self.rollout_profiler
        return {"passes": sorted(profiler.passes.items()), "recorded": sorted(profiler.recorded.items())}
