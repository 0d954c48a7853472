"""A FAKE SGLang server for tests: NOT SGLang. SGLang needs CUDA; this runs on CPU.

Run it as SGLang is run: `python tests/fakes/fake_sglang_server.py --model-path DIR --host H
--port P` (other arguments are ignored, and logged). It serves the native routes the SGLang engine
adapter uses, with SGLang 0.5.x's paths, methods, request fields, status codes, answer bodies and
messages (sources: `sglang/srt/entrypoints/http_server.py`, `sglang/srt/managers/io_struct.py`,
`tokenizer_manager.py`, `scheduler_components/profiler_manager.py`; docs/sglang.md lists
them):

* `GET /health`, `/health_generate`: 503 until the startup warmup request has finished, then 200;
* `GET /model_info`, `/get_model_info`: model path and the current `weight_version`;
* `POST|PUT /generate`: one prompt (`text` or `input_ids`), `sampling_params` (an unknown key is
  a TypeError: HTTP 500, as in SGLang), `return_logprob`, `top_logprobs_num`,
  `logprob_start_len`, `stream`; answers `{text, output_ids, meta_info}` with `finish_reason`
  ({type, matched|length|message}), `completion_tokens`, `weight_version` (and, when finished,
  `weight_versions` spans), `output_token_logprobs` as (logprob, id, null), `output_top_logprobs`,
  `input_token_logprobs`, `input_top_logprobs`; with `stream: true`, `data: {...}` events (each
  with every output token so far, or only the new ones with --incremental-streaming-output), then
  `data: [DONE]`; a stream whose client goes away aborts its request; input errors are HTTP 400
  `{"error": {"message"}}` (in a stream: an error event); requests wait while generation is
  paused;
* `GET|POST /start_profile` and `/stop_profile`: plain-text 200 answers; a refusal ("Profiling is
  already in progress. Call /stop_profile first.", "Profiling is not in progress. Call
  /start_profile first.") escapes the route as a RuntimeError, i.e. a bare HTTP 500 "Internal
  Server Error" with the message only in the server log; traces are real torch.profiler Chrome
  traces named `[{profile_prefix}-]{profile_id}-TP-0.trace.json.gz` in `output_dir`; `num_steps`
  auto-stops before the engine step after the last one;
* `POST /update_weights_from_disk`: loads every safetensors file of `model_path` between batches,
  answers `{success, message, num_paused_requests}` (400 when not loaded, the old weights keep
  serving), sets `weight_version`, then with `flush_cache` flushes the cache: refused while
  requests are still running (no pause, or an `in_place` pause), which fails the call (400) with
  the new weights loaded, as in 0.5.23;
* `GET|POST /flush_cache`: "Cache flushed." (200), or 400 "Flush cache failed." when SGLang's
  scheduler refuses (requests in the running batch; unpaused, also waiting ones);
* `POST /pause_generation {"mode": "abort"|"retract"|"in_place"}`, `POST /continue_generation`;
* `POST /abort_request {"rid": ..., "abort_all": false}`: 200 with no body; the request (a rid
  prefix, as SGLang matches it), or every one, ends with finish_reason abort and its tokens so far
  (how: tests/fakes/fake_sglang_scheduler.py); an empty rid without `abort_all` does nothing;
* SGLang's own distributed weight update, each answering `{success, message}` (HTTP 400 when not
  successful): `POST /init_weights_update_group` (joins the trainer's group as rank
  `rank_offset` + 0, blocking until every member has: tests/fakes/fake_sglang_weight_group.py),
  `POST /begin_weight_update`, `POST /update_weights_from_distributed` (receives the broadcast, one
  tensor at a time in `names` order or one `flattened_bucket`, loads it, sets `weight_version`,
  flushes the cache; refused outside a begin/end session), `POST /end_weight_update`,
  `POST /destroy_weights_update_group`; and `POST /update_weight_version` (aborting every request
  unless `abort_all_requests` is false, as SGLang does); `GET|POST /get_weights_by_name` (the
  first `truncate_size` values of a parameter, flattened: tests read the fake's weights with it).

Malformed bodies are HTTP 400 with SGLang's ErrorResponse shape. SGLang ignores unknown body
fields; so does this fake, logging a warning, unless started with the fake-only flag
`--fake-strict-fields`, which rejects them with a 400 naming the field (tests use it to catch a
misspelt field in the adapter). Not faithful: see the scheduler module's docstring, and no
batch requests, no other routes; a weight update (from disk or distributed) without a pause runs
between batches (SGLang first waits, under its model-update lock, for the requests in flight to
finish, so its flush is not refused), a CPU
fake joins a group whose backend is "nccl" with gloo, and `/flush_cache` answers at once (its
`timeout` query, a flush deferred until idle, is ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal, cast

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

if __package__ in (None, ""):  # run as a script: make the `fakes` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fakes.fake_sglang_scheduler import ABORT_ECHO, ProfileReq, SamplingParams, Scheduler

log = logging.getLogger("fake_sglang")

WARMUP_INPUT_IDS = [10, 11, 12]
CACHE_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
FLUSH_FAILED = "Flush cache failed.\n"
"""`/flush_cache`'s answers (http_server.py): flushed, or refused by the scheduler."""


class _Lenient(BaseModel):
    """SGLang's request structs: unknown fields are accepted (and ignored)."""

    model_config = ConfigDict(extra="allow")


class GenerateReqInput(_Lenient):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    stream: bool = False
    rid: str | list[str] | None = None


class ProfileReqInput(_Lenient):
    output_dir: str | None = None
    start_step: int | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    profile_by_stage: bool = False
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_id: str | None = None
    merge_profiles: bool = False
    profile_prefix: str | None = None
    profile_stages: list[str] | None = None


class UpdateWeightFromDiskReqInput(_Lenient):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None


class InitWeightsUpdateGroupReqInput(_Lenient):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedReqInput(_Lenient):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class DestroyWeightsUpdateGroupReqInput(_Lenient):
    group_name: str = "weight_update_group"


class UpdateWeightVersionReqInput(_Lenient):
    new_version: str
    abort_all_requests: bool = True


class BeginWeightUpdateReqInput(_Lenient):
    selector: Literal["target", "draft", "all"] = "all"


class EndWeightUpdateReqInput(_Lenient):
    pass


class GetWeightsByNameReqInput(_Lenient):
    name: str
    truncate_size: int = 100


class PauseGenerationReqInput(_Lenient):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class AbortReq(_Lenient):
    rid: str | None = None
    abort_all: bool = False


class ContinueGenerationReqInput(_Lenient):
    torch_empty_cache: bool = True


def _env_flag(name: str, default: bool) -> bool:
    value = os.getenv(name)
    return default if value is None else value.strip().lower() in ("1", "true", "yes", "on")


def _bad_request(message: str) -> JSONResponse:
    """`/generate`'s error answer for a ValueError (`_create_error_response`)."""
    return JSONResponse({"error": {"message": message}}, status_code=400)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """SGLang turns FastAPI's 422 (a RequestValidationError) into 400 with its ErrorResponse body."""
    assert isinstance(exc, RequestValidationError)
    exc_str, errors_str = str(exc), str(exc.errors())
    message = f"{exc_str} {errors_str}" if errors_str and errors_str != exc_str else exc_str
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return JSONResponse(body, status_code=400)


class FakeSglangServer:
    """The HTTP side: SGLang's tokenizer-manager duties (pause gate, defaults) over a Scheduler."""

    def __init__(self, scheduler: Scheduler, *, strict_fields: bool, incremental_streaming_output: bool):
        self.scheduler = scheduler
        self.strict_fields = strict_fields
        self.incremental_streaming_output = incremental_streaming_output
        self.up = False
        self.is_pause = False
        self.pause_cond = asyncio.Condition()

    def check_fields(self, obj: BaseModel, route: str) -> None:
        extra = obj.model_extra or {}
        if not extra:
            return
        if self.strict_fields:
            raise RequestValidationError(
                [
                    {
                        "type": "extra_forbidden",
                        "loc": ("body", name),
                        "msg": "Extra inputs are not permitted (fake server started with --fake-strict-fields; "
                        "SGLang itself ignores unknown fields)",
                        "input": value,
                    }
                    for name, value in extra.items()
                ]
            )
        log.warning("%s: ignoring unknown fields %s (as SGLang does)", route, sorted(extra))

    async def run(self, input_ids: list[int], params: SamplingParams, **kwargs: Any) -> dict:
        """Submit one request and wait for its finished answer."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[dict] = loop.create_future()

        def finished(out: dict) -> None:
            if not answer.done():
                answer.set_result(out)

        def emit(out: dict) -> None:
            if out["meta_info"]["finish_reason"] is not None:
                out.pop(ABORT_ECHO, None)
                loop.call_soon_threadsafe(finished, out)

        self.scheduler.submit(self.scheduler.new_request(input_ids, params, emit, **kwargs))
        return await answer

    async def stream(self, input_ids: list[int], params: SamplingParams, **kwargs: Any) -> AsyncIterator[bytes]:
        """Submit one streamed request; its `data:` events (SGLang's `stream_results`). A client
        that goes away (this generator closed or cancelled) aborts the request, as SGLang's
        abort task does. ValueError: the request is refused before streaming starts."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[dict] = asyncio.Queue()

        def emit(out: dict) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        req = self.scheduler.new_request(input_ids, params, emit, stream=True, **kwargs)
        self.scheduler.submit(req)

        async def events() -> AsyncIterator[bytes]:
            sent = 0
            finished = False
            try:
                while not finished:
                    out = await outputs.get()
                    finished = out["meta_info"]["finish_reason"] is not None
                    if out.pop(ABORT_ECHO, False) and self.incremental_streaming_output:
                        # `_handle_abort_req`: an incremental stream's abort chunk repeats the last token.
                        out = {**out, "output_ids": out["output_ids"][-1:]}
                    elif self.incremental_streaming_output:
                        out = _incremental(out, sent)
                        sent += len(out["output_ids"])
                    yield b"data: " + json.dumps(out).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:
                if not finished:
                    log.info("fake SGLang server: client of %s went away; aborting it", req.rid)
                    self.scheduler.control_soon(lambda: self.scheduler.abort(req.rid))

        return events()

    async def warmup(self) -> None:
        """SGLang's `_wait_and_warmup`: one small generation, then the server reports healthy."""
        await self.run(WARMUP_INPUT_IDS, SamplingParams(max_new_tokens=1, temperature=0.0))
        self.up = True
        log.info("The server is fired up and ready to roll!")

    async def control(self, fn: Callable[[], Any]) -> Any:
        return await self.scheduler.control(fn)


def build_app(
    scheduler: Scheduler, *, strict_fields: bool = False, incremental_streaming_output: bool = False
) -> FastAPI:
    """The fake server's FastAPI app around a running `scheduler` (shut down with the app).
    `incremental_streaming_output`: SGLang's server flag of that name (each stream chunk carries
    only its new tokens and logprobs; by default every chunk carries all so far)."""
    server = FakeSglangServer(
        scheduler, strict_fields=strict_fields, incremental_streaming_output=incremental_streaming_output
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        warmup = asyncio.create_task(server.warmup())
        try:
            yield
        finally:
            warmup.cancel()
            scheduler.shutdown()

    app = FastAPI(lifespan=lifespan, title="FAKE SGLang server (tests)")
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.state.fake = server

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200 if server.up else 503)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict:
        return {
            "model_path": str(scheduler.model_path),
            "tokenizer_path": str(scheduler.model_path),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": scheduler.weight_version,
        }

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(obj: GenerateReqInput):
        server.check_fields(obj, "/generate")
        if obj.text is None and obj.input_ids is None:
            return _bad_request("Either text, input_ids or input_embeds should be provided.")
        if obj.input_ids is not None and len(obj.input_ids) == 0:
            return _bad_request("input_ids cannot be empty.")
        batched = (
            isinstance(obj.text, list)
            or (obj.input_ids is not None and isinstance(obj.input_ids[0], list))
            or isinstance(obj.sampling_params, list)
        )
        if batched:
            return _bad_request("fake SGLang server: batch requests are not implemented")
        async with server.pause_cond:
            await server.pause_cond.wait_for(lambda: not server.is_pause)
        # One prompt from here on (batches were refused above).
        input_ids = (
            cast(list[int], obj.input_ids) if obj.input_ids is not None else scheduler.tokenizer(obj.text).input_ids
        )
        params = SamplingParams(**cast(dict[str, Any], obj.sampling_params or {}))  # unknown key: TypeError, HTTP 500
        kwargs: dict[str, Any] = {
            "rid": obj.rid,
            "return_logprob": bool(obj.return_logprob),
            "top_logprobs_num": obj.top_logprobs_num or 0,
            "logprob_start_len": -1 if obj.logprob_start_len is None else obj.logprob_start_len,
        }
        try:
            if obj.stream:
                return StreamingResponse(
                    await server.stream(input_ids, params, **kwargs), media_type="text/event-stream"
                )
            return await server.run(input_ids, params, **kwargs)
        except ValueError as e:
            log.error("[http_server] Error: %s", e)
            if obj.stream:  # SGLang validates inside its stream: a 200 whose one event is the error
                return StreamingResponse(_error_events(str(e)), media_type="text/event-stream")
            return _bad_request(str(e))

    @app.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(obj: ProfileReqInput | None = None) -> Response:
        obj = obj or ProfileReqInput()
        server.check_fields(obj, "/start_profile")
        # TokenizerManager.start_profile's defaults: stack and shapes on unless set to false.
        req = ProfileReq(
            output_dir=obj.output_dir,
            start_step=obj.start_step,
            num_steps=obj.num_steps,
            activities=obj.activities,
            profile_by_stage=obj.profile_by_stage,
            with_stack=not (obj.with_stack is False or not _env_flag("SGLANG_PROFILE_WITH_STACK", True)),
            record_shapes=obj.record_shapes is not False and _env_flag("SGLANG_PROFILE_RECORD_SHAPES", True),
            profile_id=obj.profile_id,
            merge_profiles=obj.merge_profiles,
            profile_prefix=obj.profile_prefix,
        )
        success, message = await server.control(lambda: scheduler.profiler.handle(req, True, scheduler.forward_ct))
        if not success:
            raise RuntimeError(message)  # as SGLang's _execute_profile: a bare HTTP 500
        return Response(content="Start profiling.\n", status_code=200)

    @app.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile() -> Response:
        success, message = await server.control(
            lambda: scheduler.profiler.handle(ProfileReq(), False, scheduler.forward_ct)
        )
        if not success:
            raise RuntimeError(message)
        return Response(content="Stop profiling. This will take some time.\n", status_code=200)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(obj: UpdateWeightFromDiskReqInput) -> JSONResponse:
        server.check_fields(obj, "/update_weights_from_disk")
        if obj.abort_all_requests:
            await server.control(scheduler.abort_all)

        success, message = await server.control(
            lambda: scheduler.update_weights_from_disk(obj.model_path, obj.flush_cache, obj.weight_version)
        )
        if success and obj.weight_version is not None:
            message += f" Weight version updated to {obj.weight_version}."
        content = {"success": success, "message": message, "num_paused_requests": 0}
        return JSONResponse(content, status_code=200 if success else 400)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if await server.control(scheduler.flush_cache):
            return Response(content=CACHE_FLUSHED, status_code=200)
        return Response(content=FLUSH_FAILED, status_code=400)

    def answer(success: bool, message: str) -> JSONResponse:
        """The weight routes' `{success, message}`, HTTP 400 when not successful."""
        return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(obj: InitWeightsUpdateGroupReqInput) -> JSONResponse:
        server.check_fields(obj, "/init_weights_update_group")
        # On the scheduler thread, as SGLang's model runner joins: it blocks until every member has.
        return answer(
            *await server.control(
                lambda: scheduler.weight_groups.init(
                    obj.master_address, obj.master_port, obj.rank_offset, obj.world_size, obj.group_name, obj.backend
                )
            )
        )

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(obj: DestroyWeightsUpdateGroupReqInput) -> JSONResponse:
        server.check_fields(obj, "/destroy_weights_update_group")
        return answer(*await server.control(lambda: scheduler.weight_groups.destroy(obj.group_name)))

    @app.post("/begin_weight_update")
    async def begin_weight_update(obj: BeginWeightUpdateReqInput) -> JSONResponse:
        server.check_fields(obj, "/begin_weight_update")
        return answer(*await server.control(scheduler.begin_weight_update))

    @app.post("/end_weight_update")
    async def end_weight_update(obj: EndWeightUpdateReqInput) -> JSONResponse:
        server.check_fields(obj, "/end_weight_update")
        return answer(*await server.control(scheduler.end_weight_update))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(obj: UpdateWeightsFromDistributedReqInput) -> JSONResponse:
        server.check_fields(obj, "/update_weights_from_distributed")
        if obj.abort_all_requests:
            await server.control(scheduler.abort_all)
        success, message = await server.control(
            lambda: scheduler.update_weights_from_distributed(
                obj.names, obj.dtypes, obj.shapes, obj.group_name, obj.load_format, obj.weight_version, obj.flush_cache
            )
        )
        if success and obj.weight_version is not None:
            message += f" Weight version updated to {obj.weight_version}."
        return answer(success, message)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(obj: GetWeightsByNameReqInput) -> JSONResponse:
        server.check_fields(obj, "/get_weights_by_name")

        def read() -> list[float] | None:
            param = scheduler.model.state_dict().get(obj.name)
            return None if param is None else param.detach().flatten()[: obj.truncate_size].tolist()

        values = await server.control(read)
        if values is None:
            return _bad_request("Get parameter by name failed")
        return JSONResponse(values)

    @app.post("/update_weight_version")
    async def update_weight_version(obj: UpdateWeightVersionReqInput) -> JSONResponse:
        server.check_fields(obj, "/update_weight_version")
        if obj.abort_all_requests:
            await server.control(scheduler.abort_all)
        await server.control(lambda: scheduler.set_weight_version(obj.new_version))
        content = {
            "success": True,
            "message": f"Weight version updated to {obj.new_version}",
            "new_version": obj.new_version,
        }
        return JSONResponse(content)

    @app.post("/pause_generation")
    async def pause_generation(obj: PauseGenerationReqInput) -> JSONResponse:
        server.check_fields(obj, "/pause_generation")
        async with server.pause_cond:
            server.is_pause = True
            await server.control(lambda: scheduler.pause(obj.mode))
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/abort_request")
    async def abort_request(obj: AbortReq) -> Response:
        server.check_fields(obj, "/abort_request")
        if not obj.abort_all and not obj.rid:
            # TokenizerManager.abort_request: an empty rid would match every request by prefix.
            log.warning("Ignore abort_request with empty rid and abort_all=False")
            return Response(status_code=200)
        await server.control(lambda: scheduler.abort_request(obj.rid or "", obj.abort_all))
        return Response(status_code=200)

    @app.post("/continue_generation")
    async def continue_generation(obj: ContinueGenerationReqInput) -> JSONResponse:
        server.check_fields(obj, "/continue_generation")
        async with server.pause_cond:
            server.is_pause = False
            await server.control(scheduler.resume)
            server.pause_cond.notify_all()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    return app


async def _error_events(message: str) -> AsyncIterator[bytes]:
    """`stream_results`' answer to a ValueError: an error event, then [DONE]."""
    error = {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}
    yield b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def _incremental(out: dict, sent: int) -> dict:
    """A cumulative output cut to what is new since `sent` tokens (SGLang's
    `_slice_streaming_output_meta_info`: output ids and output logprobs; prompt logprobs stay).
    Not faithful: `text` stays cumulative (SGLang sends the new text; the adapter reads none)."""
    meta = dict(out["meta_info"])
    for key in ("output_token_logprobs", "output_top_logprobs"):
        if key in meta:
            meta[key] = meta[key][sent:]
    return {"text": out["text"], "output_ids": out["output_ids"][sent:], "meta_info": meta}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="FAKE SGLang server for tests (not SGLang; CPU only).")
    parser.add_argument("--model-path", required=True, help="Hugging Face checkpoint directory.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--fake-strict-fields",
        action="store_true",
        help="Fake-only: reject unknown request fields with HTTP 400 (SGLang ignores them).",
    )
    parser.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="As SGLang's: each stream chunk carries only its new output ids and logprobs.",
    )
    args, ignored = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s")
    if ignored:
        log.info("fake SGLang server: ignoring arguments %s", ignored)
    scheduler = Scheduler(Path(args.model_path))
    app = build_app(
        scheduler, strict_fields=args.fake_strict_fields, incremental_streaming_output=args.incremental_streaming_output
    )
    # A request held by a pause must not keep a terminated server alive.
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
