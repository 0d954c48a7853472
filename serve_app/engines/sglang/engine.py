"""`engine: sglang`: an SGLang server (its own process, as SGLang runs) driven over its HTTP API.

* Server: `sglang.url` if set, else the replica launches `sglang.server_command` as a child
  process (serve_app/engines/sglang/server.py) and terminates it on shutdown.
* Generation: `POST /generate` with the sequence's sampling as SGLang's `sampling_params`
  (`generate_body`) and its request id as SGLang's `rid`, streamed as server-sent events when the
  caller streams; each chunk's `meta_info.weight_version` is the version of its tokens, and newer
  servers give exact `weight_versions` spans when the sequence finishes (`ChunkReader`).
* Aborts: `POST /abort_request {rid}` per sequence, or `{abort_all: true}`; SGLang ends each with
  finish_reason {"type": "abort"} and its tokens so far, which is finish_reason 'abort' where the
  app asked for it (`abort_asked`) and a failure otherwise. SGLang cannot abort a request that
  waits at its own pause (sent while the engine was held): that one runs once the hold ends.
* Profiling: `POST /start_profile` with `output_dir` = this replica's own trace directory,
  `profile_prefix` = "step<k>[-tag]-v<version>" (SGLang names the files `<prefix>-<profile_id>-TP-
  <tp>....trace.json.gz`), `num_steps` = max_forward_steps (SGLang stops and writes the trace by
  itself after that many engine steps) and `POST /stop_profile`. The server must write to the same
  filesystem as the replica. Forward steps are SGLang's own `step[<MODE> bs=<n>...]` ranges, one
  around every forward of its model runner. SGLang's trace carries no weight version, so each
  recording holds one version, named in its files: a weight load inside a recording (a
  continuous window) ends SGLang's recording before the load and starts a new one, named by the
  new version, after it, while generation is paused (docs/sglang.md#forward-steps-and-weight-versions).
* Weights: pause (`retract`: in-flight requests are kept, their KV cache is recomputed with the
  new weights), `POST /flush_cache` (checked: a refusal fails the update before the load),
  `POST /update_weights_from_disk` with `weight_version`, resume; an adopted version (below) is
  flushed likewise, and generation does not resume while its flush is refused
  (docs/sglang.md#the-radix-cache-across-a-weight-update).
* The trainer's own transfer (source external): a trainer reaches SGLang's distributed weight
  update through the app's `engine_rpc` (`ENGINE_RPC_ROUTES`: init/destroy the group, begin/end
  the update session, update_weights_from_distributed, update_weight_version); the app publishes
  the version once `GET /model_info` reports it (docs/sglang.md#the-trainers-own-transfer).
* Tools: `torch` (SGLang's torch profiler, activities CPU/GPU), `nsys` (activity CUDA_PROFILER:
  SGLang calls cudaProfilerStart/Stop; run the server under `nsys profile
  --capture-range=cudaProfilerApi`), `npu` (the same route on Ascend, where SGLang swaps in
  torch_npu's profiler with a fixed configuration).

Only the fake server in tests/fakes has run this adapter; docs/sglang.md says which SGLang
source each request follows and what has not run on real hardware.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from profiling.backends.base import ProfilerBackend
from profiling.backends.nsys_profiler import REPORT_WHERE
from profiling.config import ProfileOptions
from profiling.session import SessionSpec
from profiling.step_ranges import count_engine_steps
from profiling.store import atomic_write_text
from serve_app.config import AppArgs
from serve_app.engines.adapter import EngineAdapter, TransferRefused
from serve_app.engines.engine_profiler import EngineProfiler, EngineTrace
from serve_app.engines.generation import GenerateDelta, GenerateRequest, TokenLogprobs, WeightVersionSpan
from serve_app.engines.sglang.client import (
    AbortRequestBody,
    BeginWeightUpdateBody,
    ContinueGenerationBody,
    DestroyWeightsUpdateGroupBody,
    EndWeightUpdateBody,
    GenerateBody,
    GenerateChunk,
    GenerateMetaInfo,
    InitWeightsUpdateGroupBody,
    LogprobEntry,
    ModelInfoAnswer,
    PauseGenerationBody,
    SamplingParams,
    SglangClient,
    SglangError,
    StartProfileBody,
    UpdateWeightsFromDiskAnswer,
    UpdateWeightsFromDiskBody,
    UpdateWeightsFromDistributedBody,
    UpdateWeightVersionBody,
    WeightUpdateAnswer,
)
from serve_app.engines.sglang.options import SglangOptions
from serve_app.engines.sglang.server import SglangServer, wait_ready
from serve_app.engines.sglang.trace_dialect import SGLANG_DIALECT
from serve_app.weights.checkpoint import stage_weights
from serve_app.weights.safetensors_file import WeightsError

log = logging.getLogger(__name__)

_ACTIVITIES = {"cpu": "CPU", "cuda": "GPU"}
# SGLang's scheduler names a stopped-already profiler this way (only in its log: the route's answer
# is a bare HTTP 500).
_NOT_IN_PROGRESS = "Profiling is not in progress"
_LOG_SETTLE_S = 2.0  # uvicorn logs a route's exception just after sending the 500


ENGINE_RPC_ROUTES: dict[str, tuple[str, type[BaseModel]]] = {
    "init_weights_update_group": ("/init_weights_update_group", InitWeightsUpdateGroupBody),
    "begin_weight_update": ("/begin_weight_update", BeginWeightUpdateBody),
    "update_weights_from_distributed": ("/update_weights_from_distributed", UpdateWeightsFromDistributedBody),
    "end_weight_update": ("/end_weight_update", EndWeightUpdateBody),
    "destroy_weights_update_group": ("/destroy_weights_update_group", DestroyWeightsUpdateGroupBody),
    "update_weight_version": ("/update_weight_version", UpdateWeightVersionBody),
}
"""The SGLang routes a trainer may call through the app's `engine_rpc`, by method name, with the
body each takes (docs/sglang.md#the-trainers-own-transfer): those that move weights and set their
version. Generation, pause, profiling and the disk load stay the replica's, whose state they would
break."""


def rpc_body(method: str, args: tuple[object, ...], kwargs: dict[str, object]) -> BaseModel:
    """The body of engine RPC `method`: its fields as keyword arguments (or one dict); a value
    that differs per replica (`rank_offset`) comes as a `PerReplica`, resolved by the replica.
    ValueError: refused, with the reason."""
    if method not in ENGINE_RPC_ROUTES:
        raise ValueError(
            f"engine RPC {method!r} is not allowed; a trainer may call these SGLang routes: "
            f"{', '.join(ENGINE_RPC_ROUTES)} (docs/sglang.md#the-trainers-own-transfer)"
        )
    if len(args) > 1 or (args and not isinstance(args[0], dict)):
        raise ValueError(f"engine RPC {method} takes its body's fields as keyword arguments (or one dict)")
    fields: dict[str, object] = {**(args[0] if args else {}), **kwargs}  # type: ignore[dict-item]
    try:
        return ENGINE_RPC_ROUTES[method][1].model_validate(fields)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors())
        raise ValueError(f"engine RPC {method}: {problems}") from e


def start_profile_body(prefix: str, options: ProfileOptions, trace_dir: Path) -> StartProfileBody:
    """The `/start_profile` body for one recording named `prefix` (the options passed
    `SglangOptions.check_profiler`)."""
    activities = ["CUDA_PROFILER"] if options.tool == "nsys" else [_ACTIVITIES[a] for a in options.activities]
    output_dir = trace_dir
    if options.tool == "npu":
        # torch_npu's trace handler names its output `<host>_<pid>_<ts>_ascend_pt/`, not by our
        # prefix: a directory of the recording's own keeps it apart.
        output_dir = trace_dir / f"{prefix}-ascend"
    return StartProfileBody(
        output_dir=str(output_dir),
        profile_prefix=prefix,
        activities=activities,
        num_steps=options.max_forward_steps,
        with_stack=options.with_stack,
        record_shapes=options.record_shapes,
    )


def segment_prefix(prefix: str, version: int) -> str:
    """The `profile_prefix` of the part of recording `prefix` on weight version `version`."""
    return f"{prefix}-v{version}"


class SglangTrace(EngineTrace):
    """One recording's files: one SGLang recording per weight version, several files each when
    SGLang runs several ranks. Forward steps are counted in the first file of each recording
    (every rank runs the same batches) and summed."""

    def __init__(self, files: list[Path]):
        super().__init__(files, None)

    def export(self, out_dir: Path) -> list[Path]:
        paths = super().export(out_dir)
        firsts: dict[str, Path] = {}
        for path in sorted(paths):
            if path.name.endswith((".json", ".json.gz")):
                firsts.setdefault(SGLANG_DIALECT.recording_of(path.name), path)
        if firsts:
            self.forward_steps = sum(count_engine_steps(p, SGLANG_DIALECT.forward_range) for p in firsts.values())
            # Versions only grow within a window: ordered by number, not by file name (v10 < v9).
            self.weight_versions = sorted(
                {v for p in firsts.values() if (v := SGLANG_DIALECT.file_version_of(p.name)) is not None}
            )
        return paths


class SglangProfiler(EngineProfiler):
    """One recording of SGLang's profiler, through `/start_profile` and `/stop_profile`: one SGLang
    recording per weight version the window sees (`split`)."""

    trace_dialect = SGLANG_DIALECT

    def __init__(
        self, spec: SessionSpec, *, client: SglangClient, trace_dir: Path, loop: asyncio.AbstractEventLoop, version: int
    ):
        super().__init__(spec, trace_dir=trace_dir, loop=loop)
        self._client = client
        self._version = version
        self._started_at: float | None = None
        self._between_segments = False  # a split stopped SGLang's recording and has not restarted it
        self._segment_files: set[Path] = set()  # the files on disk before the current segment began
        self._closed = False  # stopped (or capped): no segment starts again
        self._num_steps_reached = False  # SGLang ended a recording itself, after num_steps
        self._lock = asyncio.Lock()  # a cap's stop from the control thread vs a split on the loop

    async def _engine_start(self) -> None:
        async with self._lock:
            await self._begin_segment()

    async def _begin_segment(self) -> None:
        self._segment_files = set(self.recorded_files())
        body = start_profile_body(segment_prefix(self.prefix, self._version), self.options, self.trace_dir)
        await self._client.call("/start_profile", body, own_connection=True)
        self._between_segments = False
        if self._started_at is None:
            self._started_at = time.time()

    async def _end_segment(self) -> bool:
        """Stop SGLang's recording of the current version. False: SGLang had stopped it itself
        (num_steps reached), so the window is full."""
        self._between_segments = True
        try:
            await self._client.call("/stop_profile", own_connection=True)
        except SglangError as e:
            if e.status is None or not await self._auto_stopped():
                raise
            log.info("SGLang had already stopped %s after num_steps engine steps", self.prefix)
            self._num_steps_reached = True
            return False
        return True

    async def split(self, load: Callable[[], Awaitable[None]], version: int) -> None:
        """Run `load` (the weight load to `version`, with generation paused) between two SGLang
        recordings: the one of the version served so far, and one named by the version served
        afterwards (`version`, or the old one when `load` fails)."""
        async with self._lock:
            full = self._closed or self._between_segments or not await self._end_segment()
        loaded = False
        try:
            await load()
            loaded = True
        finally:
            if not full:
                async with self._lock:
                    if not self._closed:
                        if loaded:
                            self._version = version
                        await self._begin_segment()

    async def _engine_stop(self) -> None:
        async with self._lock:
            self._closed = True
            if not self._between_segments:
                await self._end_segment()
        if self.options.tool == "nsys":
            self._write_nsys_note()

    def _recorded(self) -> SglangTrace:
        trace = SglangTrace(self.recorded_files())
        # SGLang counts only the steps it recorded: the entry says the cap ended it, uncounted after.
        trace.auto_stopped = "max_forward_steps" if self._num_steps_reached else None
        return trace

    async def _auto_stopped(self) -> bool:
        """Whether SGLang stopped this recording itself (num_steps reached), so /stop_profile
        found nothing to stop: its trace is on disk, or its log says so."""
        if self.options.tool != "nsys" and set(self.recorded_files()) - self._segment_files:
            return True
        # The route answers before the server logs the exception: give the log a moment.
        deadline = time.monotonic() + _LOG_SETTLE_S
        while True:
            if _NOT_IN_PROGRESS in self._client.log_tail():
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)

    def _write_nsys_note(self) -> None:
        """nsys writes its report where its `-o` says: leave a note of the window instead."""
        note = {
            "tool": "nsys",
            "engine": "sglang",
            "trace_written_here": False,
            "report": REPORT_WHERE,
            "capture": {
                "api": "SGLang /start_profile activities=[CUDA_PROFILER] (cudaProfilerStart/Stop on "
                "the first GPU of each node)",
                "started_at": self._started_at,
                "stopped_at": time.time(),
            },
            "server": self._client.url,
            "run_under": "nsys profile --capture-range=cudaProfilerApi --capture-range-end=repeat "
            "python -m sglang.launch_server ...",
        }
        atomic_write_text(self.trace_dir / f"{self.prefix}-nsys_capture.json", json.dumps(note, indent=2) + "\n")


def generate_body(request: GenerateRequest) -> GenerateBody:
    """The `/generate` body for one sequence of `request` (docs/sglang.md#sampling). ValueError
    for what SGLang would silently do otherwise than asked."""
    s = request.sampling
    if s.ignore_eos and s.stop_token_ids:
        raise ValueError(
            "engine 'sglang' cannot honour stop_token_ids together with ignore_eos: SGLang's ignore_eos "
            "also ignores stop_token_ids; drop one of them"
        )
    if s.min_tokens and s.stop:
        raise ValueError(
            "engine 'sglang' cannot honour min_tokens together with stop strings: SGLang's min_new_tokens "
            "holds back EOS and stop tokens only, a stop string still ends the sequence earlier; drop one of them"
        )
    asks_logprobs = s.logprobs is not None or s.prompt_logprobs is not None
    top = max(s.logprobs or 0, s.prompt_logprobs or 0)  # SGLang has one count for output and prompt
    return GenerateBody(
        input_ids=request.prompt_token_ids,
        sampling_params=SamplingParams(
            max_new_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else -1,
            min_p=s.min_p,
            sampling_seed=s.seed,
            stop=s.stop or None,
            stop_token_ids=s.stop_token_ids or None,
            ignore_eos=s.ignore_eos,
            min_new_tokens=s.min_tokens,
            repetition_penalty=s.repetition_penalty,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            no_stop_trim=s.include_stop_str_in_output,
        ),
        stream=request.stream,
        return_logprob=asks_logprobs,
        top_logprobs_num=top if top else None,
        logprob_start_len=0 if s.prompt_logprobs is not None else None,
        cache_salt=request.cache_salt,
        rid=request.request_id,
    )


class ChunkReader:
    """Turns one sequence's `/generate` answer, or each chunk of its stream, into deltas.

    SGLang streams either every output token so far (its default) or only the new ones (its
    --incremental-streaming-output); `meta_info.completion_tokens` counts all output tokens so
    far in both modes, so the new tokens are always the last `completion_tokens - seen` of
    `output_ids`, and their logprobs sit at the same offset in the logprob lists."""

    def __init__(self, request: GenerateRequest, url: str, abort_asked: Callable[[], bool] = lambda: False):
        """`abort_asked`: whether the app asked to end this sequence early."""
        self._sampling = request.sampling
        self._prompt_len = len(request.prompt_token_ids)
        self._url = url
        self._abort_asked = abort_asked
        self.seen = 0
        """Output tokens delivered so far."""
        self.finished = False

    def read(self, chunk: GenerateChunk) -> GenerateDelta:
        if self.finished:
            raise SglangError(f"SGLang at {self._url} sent output after the sequence finished")
        meta = chunk.meta_info
        new = meta.completion_tokens - self.seen
        if new == 0 and meta.finish_reason is not None and meta.finish_reason.type == "abort":
            # An abort echoed for a request off the running batch (`_handle_abort_req`) brings no
            # new token; streamed incrementally it repeats the last one.
            delta = GenerateDelta(weight_version=None if meta.weight_version is None else _version(meta.weight_version))
            self._finish(delta, meta)
            return delta
        offset = len(chunk.output_ids) - new  # `seen` in SGLang's cumulative mode, 0 in incremental
        if new < 0 or offset not in (0, self.seen):
            raise SglangError(
                f"SGLang at {self._url} sent {len(chunk.output_ids)} output ids for {meta.completion_tokens} "
                f"completion tokens after {self.seen}: not a stream this adapter can read"
            )
        delta = GenerateDelta(
            token_ids=chunk.output_ids[offset:],
            weight_version=None if meta.weight_version is None else _version(meta.weight_version),
        )
        if self._sampling.logprobs is not None:
            delta.logprobs = self._output_logprobs(meta, offset, new)
        if self.seen == 0 and self._sampling.prompt_logprobs is not None:
            delta.prompt_logprobs = self._prompt_logprobs(meta)
        self.seen += new
        if meta.finish_reason is not None:
            self._finish(delta, meta)
        return delta

    def _output_logprobs(self, meta: GenerateMetaInfo, offset: int, new: int) -> list[TokenLogprobs]:
        k = self._sampling.logprobs or 0
        entries = meta.output_token_logprobs[offset : offset + new]
        tops = meta.output_top_logprobs[offset : offset + new] if k else []
        if len(entries) != new or (k and len(tops) != new):
            raise SglangError(
                f"SGLang at {self._url} sent {len(entries)} logprobs ({len(tops)} top lists) for {new} new tokens"
            )
        return [TokenLogprobs(logprob=lp, top=_top(tops[i], k) if k else {}) for i, (lp, _, _) in enumerate(entries)]

    def _prompt_logprobs(self, meta: GenerateMetaInfo) -> list[TokenLogprobs | None]:
        k = self._sampling.prompt_logprobs or 0
        entries, tops = meta.input_token_logprobs, meta.input_top_logprobs
        if len(entries) != self._prompt_len or (k and len(tops) != self._prompt_len):
            raise SglangError(
                f"SGLang at {self._url} sent {len(entries)} prompt logprobs for a prompt of {self._prompt_len} tokens"
            )
        return [
            None if lp is None else TokenLogprobs(logprob=lp, top=_top(tops[i], k) if k else {})
            for i, (lp, _, _) in enumerate(entries)
        ]

    def _finish(self, delta: GenerateDelta, meta: GenerateMetaInfo) -> None:
        reason = meta.finish_reason
        assert reason is not None
        if reason.type == "abort" and (reason.status_code is not None or not self._abort_asked()):
            message = f"SGLang at {self._url} aborted the request: {reason.message}"
            if reason.status_code == 400:  # SGLang refused the request itself
                raise ValueError(message)
            raise SglangError(message, status=reason.status_code)
        self.finished = True
        delta.finish_reason = reason.type if reason.type in ("stop", "abort") else "length"
        matched = reason.matched
        if isinstance(matched, str) and matched in self._sampling.stop:
            delta.stop_reason = matched
        elif isinstance(matched, int) and matched in self._sampling.stop_token_ids:
            delta.stop_reason = matched  # else EOS: None
        if meta.weight_versions:
            delta.weight_versions = [
                WeightVersionSpan(version=_version(s.version), start=s.start, end=s.end) for s in meta.weight_versions
            ]


def _top(entries: list[LogprobEntry] | None, k: int) -> dict[int, float]:
    """The `k` most likely tokens' logprobs of one position (SGLang's list is sorted)."""
    return {token: lp for lp, token, _ in (entries or [])[:k]}


def _chunk(event: dict[str, Any], url: str) -> GenerateChunk:
    try:
        return GenerateChunk.model_validate(event)
    except ValidationError as e:
        raise SglangError(
            f"SGLang at {url} streamed a /generate event this adapter cannot read ({e.error_count()} problems: "
            f"{e.errors()[0]['msg']}): {str(event)[:300]!r}; is the server an SGLang 0.5.x?"
        ) from e


class SglangEngine(EngineAdapter):
    def open(self, args: AppArgs, model_dir: Path) -> None:
        opts = args.engine_options
        assert isinstance(opts, SglangOptions)
        self.host.trace_dir.mkdir(parents=True, exist_ok=True)
        self._server: SglangServer | None = None
        if opts.url:
            url = opts.url.rstrip("/")
            wait_ready(url, opts.startup_timeout_s)
        else:
            log_path = self.host.trace_dir.with_name(f"{self.host.trace_dir.name}.sglang-server.log")
            self._server = SglangServer(opts.server_command, opts.server_args, model_dir, log_path)
            url = self._server.url
            try:
                wait_ready(url, opts.startup_timeout_s, self._server)
            except BaseException:
                self._server.terminate()
                raise
        self._client = SglangClient(
            url, timeout_s=opts.request_timeout_s, log_tail=self._server.log_tail if self._server else None
        )
        self._probe: asyncio.Future[None] | None = None
        self._recording: SglangProfiler | None = None
        # SGLang's cache holds KV of weights no longer served (an adopted version's flush was refused).
        self._stale_cache = False

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        body = generate_body(request)
        reader = ChunkReader(request, self._client.url, lambda: self.host.abort_asked(request.request_id))
        try:
            if request.stream:
                # Closing this iterator closes the HTTP stream now, not when the stream is collected.
                async with contextlib.aclosing(self._client.stream("/generate", body)) as events:
                    async for event in events:
                        yield reader.read(_chunk(event, self._client.url))
            else:
                yield reader.read(await self._client.call_for("/generate", body, GenerateChunk))
        except SglangError as e:
            if e.status == 400:  # SGLang's ValueError: the request itself is unusable
                raise ValueError(str(e)) from e
            raise
        if not reader.finished:
            raise SglangError(f"SGLang at {self._client.url} ended the /generate stream before the sequence finished")

    def profiler(self, spec: SessionSpec) -> ProfilerBackend:
        assert self.host.loop is not None, "the session starts a recording only from start_profile"
        self._recording = SglangProfiler(
            spec,
            client=self._client,
            trace_dir=self.host.trace_dir,
            loop=self.host.loop,
            version=self.host.weight_version,
        )
        return self._recording

    async def abort(self, request_ids: list[str] | None) -> None:
        if request_ids is None:
            await self._client.call("/abort_request", AbortRequestBody(abort_all=True))
        else:
            await asyncio.gather(*(self._client.call("/abort_request", AbortRequestBody(rid=r)) for r in request_ids))

    async def pause(self) -> None:
        await self._client.call("/pause_generation", PauseGenerationBody(mode="retract"))

    async def resume(self) -> None:
        if self._stale_cache:  # an adopted version's flush was refused: no batch runs on that cache
            await self._flush_cache("before generation resumes on the weights the trainer moved (it stays paused)")
        await self._client.call("/continue_generation", ContinueGenerationBody())

    async def reset_prefix_cache(self, reset_running_requests: bool, reset_external: bool) -> bool:
        # SGLang's flush has no preempting form: it refuses (400) while a request runs, whatever
        # the caller asks; it keeps no external cache.
        resp = await self._client.call("/flush_cache", accept=(400,))
        return resp.status_code != 400

    async def _flush_cache(self, when: str) -> None:
        """Empty SGLang's radix cache while generation is paused, `when` naming the moment for the
        error (docs/sglang.md#the-radix-cache-across-a-weight-update). SglangError when SGLang
        refuses: a request is still in its running batch."""
        resp = await self._client.call("/flush_cache", accept=(400,))
        if resp.status_code == 400:
            raise SglangError(
                f"SGLang at {self._client.url} refused to flush its cache {when} (HTTP 400: {resp.text.strip()}): "
                "it still runs a request (in its running batch, or compiling a grammar), whose KV would outlive the "
                "weights that computed it; the replica's retract pause empties the running batch, so another client "
                "paused the server in place or resumed it: let it serve this replica alone, then publish the "
                "version again",
                status=400,
            )
        self._stale_cache = False

    async def read_weights(self, path: Path) -> Path:
        return path

    async def load_weights(self, weights: Path, version: int) -> None:
        recording = self._recording
        if recording is not None and recording.recording:  # a window spanning versions
            await recording.split(lambda: self._load(weights, version), version)
        else:
            await self._load(weights, version)

    async def _load(self, weights: Path, version: int) -> None:
        # Before the load: paused, no batch computes KV in between, and a refusal leaves the old
        # weights serving with their own cache (SGLang's flush after it would fail the update
        # with the new weights loaded).
        await self._flush_cache(f"before loading version {version} (version {self.host.weight_version} serves on)")
        staged = stage_weights(
            weights, self.host.trace_dir.with_name(f"{self.host.trace_dir.name}.weights")
        )  # SGLang loads a directory
        body = UpdateWeightsFromDiskBody(model_path=str(staged), weight_version=str(version))
        answer = await self._client.call_for(
            "/update_weights_from_disk", body, UpdateWeightsFromDiskAnswer, accept=(400,)
        )
        if not answer.success:
            raise WeightsError(
                f"SGLang at {self._client.url} did not load {weights} as version {version}: {answer.message}"
            )

    async def reported_version(self) -> int | None:
        info = await self._client.get_for("/model_info", ModelInfoAnswer)
        return None if info.weight_version is None else _version(info.weight_version)

    async def adopted(self, version: int) -> None:
        """The trainer loaded `version` through SGLang's own update: a continuous window's
        recording is split at the version, as for a load from disk, and SGLang's cache is flushed
        again (that update's own flush may have been refused); while it is refused, generation
        stays paused (`_resume` retries it)."""
        recording = self._recording
        if recording is not None and recording.recording:
            await recording.split(_loaded_already, version)
        self._stale_cache = True
        await self._flush_cache(f"after the trainer's update to version {version} (generation stays paused)")

    async def engine_rpc(self, method: str, *args: object, **kwargs: object) -> object:
        """One of SGLang's weight routes (`ENGINE_RPC_ROUTES`); SGLang's answer, or SglangError
        with its message when it did not succeed."""
        body = rpc_body(method, args, kwargs)
        route = ENGINE_RPC_ROUTES[method][0]
        resp = await self._client.call(route, body, accept=(400,))
        try:
            answer = WeightUpdateAnswer.model_validate_json(resp.content)
        except ValidationError as e:
            raise SglangError(self._client.describe(route, resp), status=resp.status_code) from e
        if not answer.success:
            raise SglangError(
                f"SGLang at {self._client.url} refused {method}: {answer.message}", status=resp.status_code
            )
        return resp.json()

    # -- SGLang's update group, driven over HTTP (docs/sglang.md#the-update-group-over-http) -------
    def transfer_problem(self) -> str | None:
        return None

    async def transfer_init(self, body: dict[str, Any], rank_offset: int | None) -> None:
        placed = body if rank_offset is None else {**body, "rank_offset": rank_offset}
        await self.engine_rpc("init_weights_update_group", **placed)

    async def transfer_begin(self) -> None:
        await self.engine_rpc("begin_weight_update")

    async def transfer_send(self, body: dict[str, Any] | list[dict[str, Any]], first_worker: int) -> None:
        if isinstance(body, list):
            raise TransferRefused("SGLang's update_weights_from_distributed takes one body for every rank, not a list")
        await self.engine_rpc("update_weights_from_distributed", **body)

    async def transfer_end(self, version: int) -> None:
        await self.engine_rpc("end_weight_update")
        await self.engine_rpc("update_weight_version", new_version=version)

    async def transfer_close(self, body: dict[str, Any]) -> None:
        await self.engine_rpc("destroy_weights_update_group", **body)

    def healthy(self) -> bool:
        """False once the launched server has exited, or while the last call could not reach the
        server; a probe then runs so that the next check sees whether it answers again."""
        if self._server is not None and not self._server.alive():
            return False
        if self._client.unreachable is None:
            return True
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._client.probe())
        return False

    async def close(self) -> None:
        await self._client.aclose()
        if self._server is not None:
            await asyncio.to_thread(self._server.terminate)


async def _loaded_already() -> None:
    """The load of a source-external update: the trainer made it already."""


def _version(reported: str) -> int:
    """Our integer version from SGLang's `weight_version` label. Every label this adapter sets
    is an integer (`update_weights_from_disk`); any other (SGLang's "default", or a server's
    --weight-version) is the label the server was launched with, serving version 0."""
    return int(reported) if reported.isdigit() else 0
