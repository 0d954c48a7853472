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

Only the fake server in tests/fakes has run this adapter; docs/sglang_notes.md says which SGLang
source each request follows and what has not run on real hardware.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

from profiling.backends.nsys_profiler import REPORT_WHERE
from profiling.config import NpuOptions, ProfileOptions
from profiling.step_ranges import SGLANG_BATCH
from profiling.store import atomic_write_text
from serve_app.config import AppArgs
from serve_app.engines.base import GenerateRequest, GenerateResult
from serve_app.engines.external import ExternalEngine, SessionFactory
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
from serve_app.weights import WeightsError

log = logging.getLogger(__name__)

_ACTIVITIES = {"cpu": "CPU", "cuda": "GPU"}
# SGLang's scheduler names a stopped-already profiler this way (only in its log: the route's answer
# is a bare HTTP 500).
_NOT_IN_PROGRESS = "Profiling is not in progress"
_LOG_SETTLE_S = 2.0  # uvicorn logs a route's exception just after sending the 500


@dataclass
class _Recording:
    prefix: str
    tool: str
    started_at: float


def start_profile_body(prefix: str, options: ProfileOptions, trace_dir: Path) -> StartProfileBody:
    """The `/start_profile` body for one recording named `prefix` (ValueError: not possible)."""
    if options.with_memory:
        raise ValueError(
            "with_memory is not available with engine: sglang: SGLang's MEM activity writes a CUDA "
            "memory snapshot whose file name does not carry the profile prefix; set with_memory: false"
        )
    if options.tool == "nsys":
        activities = ["CUDA_PROFILER"]
    else:
        activities = [_ACTIVITIES[a] for a in options.activities]
    output_dir = trace_dir
    if options.tool == "npu":
        if options.npu != NpuOptions():
            raise ValueError(
                "with engine: sglang, SGLang configures torch_npu's profiler itself (Level1, "
                "PipeUtilization AI-core metrics, text export): profiler.npu settings cannot be "
                "applied; remove them"
            )
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


class SglangEngine(ExternalEngine):
    # One engine step: the `run_batch` range SGLang opens around a batch launch (in its
    # pipeline-parallel loop; the fake server opens it around every batch).
    step_range = f'"name": "{SGLANG_BATCH}"'

    def __init__(self, *, args: AppArgs, model_dir: Path, session_factory: SessionFactory, trace_dir: Path):
        super().__init__(
            session_factory=session_factory, trace_dir=trace_dir, hold_timeout_s=args.hold_timeout_s, model_dir=model_dir
        )
        opts = args.sglang
        self.model_name = args.model_name
        self._server: SglangServer | None = None
        if opts.url:
            url = opts.url.rstrip("/")
            wait_ready(url, opts.startup_timeout_s)
        else:
            log_path = trace_dir.with_name(f"{trace_dir.name}.sglang-server.log")
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
        self._recording: _Recording | None = None
        self._probe: asyncio.Future | None = None

    # -- generation --------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.check_prompt(request.prompt_token_ids)
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
        if reason == "abort":
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

    # -- engine hooks ------------------------------------------------------------------------
    async def _engine_start_profile(self, prefix: str, options: ProfileOptions) -> None:
        body = start_profile_body(prefix, options, self.trace_dir)
        await self._client.call("/start_profile", body, own_connection=True)
        self._recording = _Recording(prefix, options.tool, time.time())

    async def _engine_stop_profile(self) -> None:
        recording = self._recording
        assert recording is not None, "stop follows a start"
        self._recording = None
        try:
            await self._client.call("/stop_profile", own_connection=True)
        except SglangError as e:
            if e.status is None or not await self._auto_stopped(recording):
                raise
            log.info("SGLang had already stopped %s after num_steps engine steps", recording.prefix)
        if recording.tool == "nsys":
            self._write_nsys_note(recording)

    async def _auto_stopped(self, recording: _Recording) -> bool:
        """Whether SGLang stopped `recording` itself (num_steps reached), so /stop_profile found
        nothing to stop: its trace is on disk, or its log says so."""
        if recording.tool != "nsys" and self.trace_files(recording.prefix):
            return True
        # The route answers before the server logs the exception: give the log a moment.
        deadline = time.monotonic() + _LOG_SETTLE_S
        while True:
            if _NOT_IN_PROGRESS in self._client.log_tail():
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)

    def _write_nsys_note(self, recording: _Recording) -> None:
        """nsys writes its report where its `-o` says: leave a note of the window instead."""
        note = {
            "tool": "nsys",
            "engine": "sglang",
            "trace_written_here": False,
            "report": REPORT_WHERE,
            "capture": {
                "api": "SGLang /start_profile activities=[CUDA_PROFILER] (cudaProfilerStart/Stop on "
                "the first GPU of each node)",
                "started_at": recording.started_at,
                "stopped_at": time.time(),
            },
            "server": self._client.url,
            "run_under": "nsys profile --capture-range=cudaProfilerApi --capture-range-end=repeat "
            "python -m sglang.launch_server ...",
        }
        atomic_write_text(self.trace_dir / f"{recording.prefix}-nsys_capture.json", json.dumps(note, indent=2) + "\n")

    async def _engine_pause(self) -> None:
        await self._client.call("/pause_generation", PauseGenerationBody(mode="retract"))

    async def _engine_resume(self) -> None:
        await self._client.call("/continue_generation", ContinueGenerationBody())

    async def _engine_load_weights(self, path: Path, version: int) -> None:
        weights = self.staged_weights(path)  # SGLang loads a directory
        body = UpdateWeightsFromDiskBody(model_path=str(weights), weight_version=str(version))
        answer = await self._client.call_for(
            "/update_weights_from_disk", body, UpdateWeightsFromDiskAnswer, accept=(400,)
        )
        if not answer.success:
            raise WeightsError(f"SGLang at {self._client.url} did not load {path} as version {version}: {answer.message}")

    def trace_files(self, prefix: str) -> list[Path]:
        """The recording's trace files, and its own directory of torch_npu output on Ascend."""
        pattern = re.compile(rf"^{re.escape(prefix)}[_.-]")
        return sorted(p for p in self.trace_dir.iterdir() if pattern.match(p.name))

    # -- health ------------------------------------------------------------------------------
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

    async def shutdown(self) -> None:
        await self._close_control()
        await self._client.aclose()
        if self._server is not None:
            await asyncio.to_thread(self._server.terminate)


def _version(reported: str | None) -> int | None:
    """Our integer version from SGLang's `weight_version` string (None: not one of ours)."""
    return int(reported) if reported is not None and reported.isdigit() else None
