"""`engine: sglang`: an SGLang server (its own process, as SGLang runs) driven over its HTTP API.

* Server: `sglang.url` if set, else the replica launches `sglang.server_command` as a child
  process (serve_app/engines/sglang_server.py) and terminates it on shutdown.
* Profiling: `POST /start_profile` with `output_dir` = this replica's own trace directory,
  `profile_prefix` = "step<k>[-tag]" (SGLang names the files `<prefix>-<profile_id>-TP-<tp>...
  .trace.json.gz`), `num_steps` = max_forward_steps (SGLang stops and writes the trace by itself
  after that many engine steps) and `POST /stop_profile`. The server must write to the same
  filesystem as the replica.
* Weights: pause (`retract`: in-flight requests are kept, their KV cache is recomputed with the
  new weights), `POST /update_weights_from_disk` with `weight_version` and `flush_cache`, resume.
* Tools: `torch` (SGLang's torch profiler, activities CPU/GPU), `nsys` (activity CUDA_PROFILER:
  SGLang calls cudaProfilerStart/Stop; run the server under `nsys profile
  --capture-range=cudaProfilerApi`), `npu` (the same route on Ascend, where SGLang swaps in
  torch_npu's profiler with a fixed configuration).

Only the fake server in tests/fakes has run this adapter; docs/sglang.md says which SGLang
source each request follows and what has not run on real hardware.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from profiling.backends.base import ProfilerBackend
from profiling.backends.nsys_profiler import REPORT_WHERE
from profiling.config import ProfileOptions
from profiling.session import SessionSpec
from profiling.step_ranges import SGLANG_BATCH
from profiling.store import atomic_write_text
from serve_app.config import AppArgs
from serve_app.engines.base import GenerateRequest, GenerateResult, RolloutEngine
from serve_app.engines.engine_profiler import EngineProfiler
from serve_app.engines.sglang_client import (
    ContinueGenerationBody,
    GenerateAnswer,
    GenerateBody,
    PauseGenerationBody,
    SamplingParams,
    SglangClient,
    SglangError,
    StartProfileBody,
    UpdateWeightsFromDiskAnswer,
    UpdateWeightsFromDiskBody,
)
from serve_app.engines.sglang_server import SglangServer, wait_ready
from serve_app.weights import WeightsError, stage_weights

log = logging.getLogger(__name__)

_ACTIVITIES = {"cpu": "CPU", "cuda": "GPU"}
# SGLang's scheduler names a stopped-already profiler this way (only in its log: the route's answer
# is a bare HTTP 500).
_NOT_IN_PROGRESS = "Profiling is not in progress"
_LOG_SETTLE_S = 2.0  # uvicorn logs a route's exception just after sending the 500


def start_profile_body(prefix: str, options: ProfileOptions, trace_dir: Path) -> StartProfileBody:
    """The `/start_profile` body for one recording named `prefix` (the options passed
    `SglangOptions.check_profiler`)."""
    if options.tool == "nsys":
        activities = ["CUDA_PROFILER"]
    else:
        activities = [_ACTIVITIES[a] for a in options.activities]
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


class SglangProfiler(EngineProfiler):
    """One recording of SGLang's profiler, through `/start_profile` and `/stop_profile`."""

    # One engine step: the `run_batch` range SGLang opens around a batch launch (in its
    # pipeline-parallel loop; the fake server opens it around every batch).
    step_range = SGLANG_BATCH

    def __init__(self, spec: SessionSpec, *, client: SglangClient, trace_dir: Path, loop: asyncio.AbstractEventLoop):
        super().__init__(spec, trace_dir=trace_dir, loop=loop)
        self._client = client
        self._started_at: float | None = None

    async def _engine_start(self) -> None:
        body = start_profile_body(self.prefix, self.options, self.trace_dir)
        await self._client.call("/start_profile", body, own_connection=True)
        self._started_at = time.time()

    async def _engine_stop(self) -> None:
        try:
            await self._client.call("/stop_profile", own_connection=True)
        except SglangError as e:
            if e.status is None or not await self._auto_stopped():
                raise
            log.info("SGLang had already stopped %s after num_steps engine steps", self.prefix)
        if self.options.tool == "nsys":
            self._write_nsys_note()

    async def _auto_stopped(self) -> bool:
        """Whether SGLang stopped this recording itself (num_steps reached), so /stop_profile
        found nothing to stop: its trace is on disk, or its log says so."""
        if self.options.tool != "nsys" and self.recorded_files():
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


class SglangEngine(RolloutEngine[Path]):
    def _open(self, args: AppArgs, model_dir: Path) -> None:
        opts = args.sglang
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        self._server: SglangServer | None = None
        if opts.url:
            url = opts.url.rstrip("/")
            wait_ready(url, opts.startup_timeout_s)
        else:
            log_path = self.trace_dir.with_name(f"{self.trace_dir.name}.sglang-server.log")
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

    async def _generate(self, request: GenerateRequest) -> GenerateResult:
        body = GenerateBody(
            input_ids=request.prompt_token_ids,
            sampling_params=SamplingParams(
                max_new_tokens=request.max_tokens, temperature=request.temperature, sampling_seed=request.seed
            ),
        )
        with self.versions_seen() as versions:
            try:
                answer = await self._client.call_for("/generate", body, GenerateAnswer)
            except SglangError as e:
                if e.status == 400:  # SGLang's ValueError: the request itself is unusable
                    raise ValueError(str(e)) from e
                raise
        meta = answer.meta_info
        reason = meta.finish_reason.type if meta.finish_reason else "length"
        if meta.finish_reason is not None and reason == "abort":
            raise SglangError(f"SGLang at {self._client.url} aborted the request: {meta.finish_reason.message}")
        if len(meta.output_token_logprobs) != len(answer.output_ids):
            raise SglangError(
                f"SGLang at {self._client.url} returned {len(answer.output_ids)} tokens but "
                f"{len(meta.output_token_logprobs)} logprobs"
            )
        # SGLang reports only the version serving when the request finished.
        served = _version(meta.weight_version)
        if served is not None:
            versions.add(served)
        return GenerateResult(
            token_ids=answer.output_ids,
            logprobs=[lp for lp, _, _ in meta.output_token_logprobs],
            finish_reason="stop" if reason == "stop" else "length",
            weight_versions=sorted(versions) or [self.weight_version],
        )

    def _profiler(self, spec: SessionSpec) -> ProfilerBackend:
        assert self._loop is not None, "the session starts a recording only from start_profile"
        return SglangProfiler(spec, client=self._client, trace_dir=self.trace_dir, loop=self._loop)

    async def _pause(self) -> None:
        await self._client.call("/pause_generation", PauseGenerationBody(mode="retract"))

    async def _resume(self) -> None:
        await self._client.call("/continue_generation", ContinueGenerationBody())

    async def _read_weights(self, path: Path) -> Path:
        return path

    async def _load_weights(self, weights: Path, version: int) -> None:
        staged = stage_weights(weights, self.trace_dir.with_name(f"{self.trace_dir.name}.weights"))  # SGLang loads a directory
        body = UpdateWeightsFromDiskBody(model_path=str(staged), weight_version=str(version))
        answer = await self._client.call_for(
            "/update_weights_from_disk", body, UpdateWeightsFromDiskAnswer, accept=(400,)
        )
        if not answer.success:
            raise WeightsError(f"SGLang at {self._client.url} did not load {weights} as version {version}: {answer.message}")

    def _healthy(self) -> bool:
        """False once the launched server has exited, or while the last call could not reach the
        server; a probe then runs so that the next check sees whether it answers again."""
        if self._server is not None and not self._server.alive():
            return False
        if self._client.unreachable is None:
            return True
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._client.probe())
        return False

    async def _close(self) -> None:
        await self._client.aclose()
        if self._server is not None:
            await asyncio.to_thread(self._server.terminate)


def _version(reported: str | None) -> int | None:
    """Our integer version from SGLang's `weight_version` string (None: not one of ours)."""
    return int(reported) if reported is not None and reported.isdigit() else None
