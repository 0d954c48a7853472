"""SGLang 0.5.23's native routes that RL frameworks' clients call (AReaL's `RemoteSGLangEngine`,
slime's `SGLangEngine`), with SGLang's shapes and the app's meanings, on every engine
(docs/http_api.md#sglang-routes): /generate (a completion, answered in SGLang's shape),
/model_info, /get_server_info, /get_weight_version and /health_generate (no control token), and
the control routes /update_weights_from_disk (the app's /weights/update of a path),
/pause_generation and /continue_generation (the client pause), /flush_cache (the prefix cache)
and SGLang's update-group routes (/init_weights_update_group, /begin_weight_update,
/update_weights_from_distributed, /end_weight_update, /destroy_weights_update_group), forwarded to
every replica's SGLang on engine sglang, each update one sync of the app
(docs/design.md#engine-transfer).

They build on the OpenAI routes (the completion they run) and the vLLM routes (the server info
they share)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Literal

from fastapi import Depends, Query
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import TypeAdapter, ValidationError

from profiling.config import describe_validation_error
from serve_app.api import ErrorResponse, UpdateWeightsRequest, UpdateWeightsResponse
from serve_app.choices import PromptJob
from serve_app.desired_state import DesiredState
from serve_app.engines.options import Capability
from serve_app.errors import ControlError, Refused, Unavailable
from serve_app.generate_api import version_label
from serve_app.ingress.auth import require_control_token
from serve_app.ingress.get_or_post import get_or_post
from serve_app.ingress.openai_routes import OpenAIRoutesMixin
from serve_app.ingress.settings import current
from serve_app.ingress.vllm_routes import ServerInfo, VllmRoutesMixin
from serve_app.openai_api import CompletionChoice, CompletionRequest
from serve_app.sglang_api import (
    CHUNK_LOADED_TEXT,
    CONTINUED_TEXT,
    FLUSHED_TEXT,
    GROUP_JOINED_TEXT,
    GROUP_LEFT_TEXT,
    LOADED_TEXT,
    NOT_FLUSHED_TEXT,
    PAUSED_TEXT,
    SESSION_TEXT,
    BeginWeightUpdate,
    ContinueGeneration,
    DestroyWeightsUpdateGroup,
    EndWeightUpdate,
    InitWeightsUpdateGroup,
    ModelInfo,
    PauseGeneration,
    SglangGenerateRequest,
    SglangGenerateResult,
    SglangResult,
    SglangStatus,
    SglangUpdateResult,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDiskResponse,
    UpdateWeightsFromDistributed,
    WeightVersion,
    sglang_pause_mode,
    sglang_results,
)

HEALTH_TIMEOUT_S = 20.0
"""How long /health_generate waits for its one token (SGLang's HEALTH_CHECK_TIMEOUT)."""
FLUSH_RETRY_S = 0.1
"""How often /flush_cache tries again within its `timeout` while an engine refuses."""
MAX_FLUSH_WAIT_S = 600.0

_ANSWERS = TypeAdapter(list[SglangGenerateResult])
_CONTROL = [Depends(require_control_token)]
_TAGS = ["sglang"]
_GENERATE_ERRORS: dict[int | str, dict[str, Any]] = {
    200: {"model": SglangGenerateResult, "description": "One answer; a list of them for a batch or n > 1."},
    413: {"model": ErrorResponse, "description": "Body over request_limits.max_body_bytes."},
    422: {
        "model": ErrorResponse,
        "description": "A field out of range, one the app cannot honour (named, with what to do instead), or a "
        "prompt that does not fit the context.",
    },
    503: {"model": ErrorResponse, "description": "Queue full or no replica running; retry after Retry-After."},
}
_SGLANG_REFUSAL: dict[int | str, dict[str, Any]] = {
    400: {
        "model": SglangResult,
        "description": "Not done: `success` false and why (SGLang's shape): the engine is not SGLang, the call "
        "is out of order (no group, no update open), a version not newer than the served one, or a replica's "
        "SGLang refused or failed (each named).",
    }
}


def _group_route(path: str, answer: type[SglangResult] = SglangResult) -> Callable[[Any], Any]:
    """A control route of SGLang's update group, answering SGLang's result or its refusal."""
    return lambda app: app.post(
        path, dependencies=_CONTROL, response_model=answer, responses=_SGLANG_REFUSAL, tags=_TAGS
    )


class SglangRoutesMixin(OpenAIRoutesMixin, VllmRoutesMixin):
    ENDPOINTS: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "sglang_generate": lambda app: app.post(
            "/generate", response_model=None, responses=_GENERATE_ERRORS, tags=_TAGS
        ),
        "model_info": lambda app: app.get("/model_info", tags=_TAGS),
        "get_server_info": lambda app: app.get("/get_server_info", tags=_TAGS),
        "get_weight_version": lambda app: app.get("/get_weight_version", tags=_TAGS),
        "health_generate": lambda app: app.get(
            "/health_generate",
            response_class=Response,
            responses={200: {"description": "A token was generated."}, 503: {"model": ErrorResponse}},
            tags=_TAGS,
        ),
        "update_weights_from_disk": lambda app: app.post(
            "/update_weights_from_disk",
            dependencies=_CONTROL,
            response_model=UpdateWeightsFromDiskResponse,
            responses={
                400: {
                    "model": UpdateWeightsFromDiskResponse,
                    "description": "Not loaded: `success` false and the app's reason (SGLang's shape).",
                }
            },
            tags=_TAGS,
        ),
        "pause_generation": lambda app: app.post(
            "/pause_generation", dependencies=_CONTROL, responses={503: {"model": ErrorResponse}}, tags=_TAGS
        ),
        "continue_generation": lambda app: app.post(
            "/continue_generation", dependencies=_CONTROL, responses={503: {"model": ErrorResponse}}, tags=_TAGS
        ),
        "flush_cache": lambda app: get_or_post(
            app,
            "/flush_cache",
            dependencies=_CONTROL,
            response_class=PlainTextResponse,
            responses={400: {"description": "An engine refused: requests in flight hold cached blocks."}},
            tags=_TAGS,
        ),
        "init_weights_update_group": _group_route("/init_weights_update_group"),
        "begin_weight_update": _group_route("/begin_weight_update"),
        "update_weights_from_distributed": _group_route("/update_weights_from_distributed"),
        "end_weight_update": _group_route("/end_weight_update", SglangUpdateResult),
        "destroy_weights_update_group": _group_route("/destroy_weights_update_group"),
    }

    async def sglang_generate(self, body: SglangGenerateRequest) -> Response:
        """SGLang's native generation: the same sampling, admission and weight-version spans as a
        completion of the prompts, answered in SGLang's shape (`text`, `output_ids`, `meta_info`
        with the finish reason, token counts, logprobs as `[logprob, token_id, null]` and the
        weight versions labelled as SGLang labels them)."""
        try:
            request = body.completion()
        except ValidationError as e:
            raise Refused(f"{describe_validation_error(e)} (as /v1/completions names it)") from None
        prompts = request.prompts()
        self._check(request, len(prompts), {f"text {i}": len(p) for i, p in enumerate(prompts) if isinstance(p, str)})
        results = await self._run([PromptJob(request=request, prompt_index=i, prompt=p) for i, p in enumerate(prompts)])
        choices = [c for r in results for c in r.choices if isinstance(c, CompletionChoice)]  # a completion's, all
        answers = sglang_results(body, choices)
        if body.is_batch():
            return Response(_ANSWERS.dump_json(answers, exclude_none=True), media_type="application/json")
        return Response(answers[0].model_dump_json(exclude_none=True), media_type="application/json")

    async def model_info(self) -> ModelInfo:
        """The served model (named by its served name: no server path) and the served weights' label."""
        desired: DesiredState = await self.controller.desired_state.remote()
        name = self.model_name
        return ModelInfo(
            model_path=name,
            tokenizer_path=name,
            served_model_name=name,
            weight_version=version_label(desired.weight_version),
        )

    async def get_server_info(self, config_format: Literal["text", "json"] = "text") -> ServerInfo:
        """SGLang's older name of /server_info: the same answer."""
        return await self.server_info(config_format)

    async def get_weight_version(self) -> WeightVersion:
        """The served weights' label (slime's route): "default" for the weights the engine started
        with, "<k>" for version k."""
        desired: DesiredState = await self.controller.desired_state.remote()
        return WeightVersion(weight_version=version_label(desired.weight_version))

    async def health_generate(self) -> Response:
        """200 once one token is generated (greedily, from prompt `[0]`, through the load balancer,
        as SGLang's check does); 503 when none comes within 20 s (e.g. a client pause holds
        generation) or no replica can take it."""
        probe = CompletionRequest(prompt=[0], max_tokens=1, temperature=0.0)
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                await self._run([PromptJob(request=probe, prompt_index=0, prompt=[0])])
        except TimeoutError:
            raise Unavailable(
                f"no token generated within {HEALTH_TIMEOUT_S:g} s (a client pause holds generation until "
                "/continue_generation, or the replicas are busy)"
            ) from None
        return Response(status_code=200)

    async def update_weights_from_disk(self, body: UpdateWeightsFromDisk) -> Response:
        """Publish the checkpoint at `model_path` on every replica, as `/weights/update` with source
        path does (its checks, conflicts and versions apply), as version `weight_version` (SGLang's
        label: "<k>") or, without it, the served version + 1. 200 `success: true` once loaded;
        any refusal is SGLang's 400 with `success: false` and the app's reason as `message`.
        `abort_all_requests`: requests in flight end first (finish_reason abort, with the tokens
        sampled so far), on an engine that can abort; on one that cannot, they pause between
        engine steps across the load and go on with the new weights, as their weight-version
        spans say."""
        desired: DesiredState = await self.controller.desired_state.remote()
        try:
            request = UpdateWeightsRequest(version=body.version(desired.weight_version), path=body.model_path)
        except ValidationError as e:
            return _not_loaded(describe_validation_error(e))
        except ValueError as e:
            return _not_loaded(str(e))
        try:
            # The one place SGLang's abort_all_requests ends requests: not failing the clients that
            # always send it (AReaL) on an engine that cannot abort.
            if body.abort_all_requests and self.engine_options.has(Capability.ABORT):
                await self.controller.abort_requests.remote(None)
            done: UpdateWeightsResponse = await self.controller.update_weights.remote(request)
        except ControlError as e:
            return _not_loaded(e.detail)
        message = f"{LOADED_TEXT} Weight version updated to {version_label(done.version)}."
        if missed := [r.replica_id for r in done.replicas if not r.ok]:
            message += f" Replicas that did not load it (they keep trying to converge): {', '.join(missed)}."
        paused = sum(r.requests_in_flight or 0 for r in done.replicas if r.ok)
        answer = UpdateWeightsFromDiskResponse(success=True, message=message, num_paused_requests=paused)
        return JSONResponse(answer.model_dump())

    async def pause_generation(self, body: PauseGeneration | None = None) -> SglangStatus:
        """Pause generation on every replica until /continue_generation (bounded by
        client_pause_max_s; docs/design.md#client-pause). `in_place` and `retract`: requests in
        flight freeze between engine steps and new ones queue; all go on after
        /continue_generation. `abort` (SGLang's default, what AReaL and slime send): requests in
        flight end first (finish_reason abort, with the tokens sampled so far), then new ones
        queue the same way (docs/http_api.md#sglang-routes)."""
        mode = (body or PauseGeneration()).mode
        if mode == "abort":
            await self.controller.abort_requests.remote(None)
        await self.controller.pause.remote(sglang_pause_mode(mode))
        return SglangStatus(message=PAUSED_TEXT)

    async def continue_generation(self, body: ContinueGeneration | None = None) -> SglangStatus:
        """End a client's pause on every replica (none in effect: nothing changes)."""
        await self.controller.resume.remote()
        return SglangStatus(message=CONTINUED_TEXT)

    async def flush_cache(self, timeout: float = Query(0.0, ge=0.0, le=MAX_FLUSH_WAIT_S)) -> PlainTextResponse:
        """Empty every replica's engine prefix cache (as /reset_prefix_cache), trying again for up
        to `timeout` seconds while an engine refuses (requests in flight hold cached blocks); SGLang's
        text, 400 when it still did not. The embedded engine shares no KV between requests: it
        always succeeds."""
        deadline = time.monotonic() + timeout
        while True:
            done = await self.controller.reset_prefix_cache.remote(False, False)
            if done.success:
                return PlainTextResponse(FLUSHED_TEXT)
            if time.monotonic() >= deadline:
                why = "; ".join(f"{r.replica_id}: {r.error}" for r in done.replicas if r.error)
                text = NOT_FLUSHED_TEXT if not why else f"{NOT_FLUSHED_TEXT.rstrip()} {current().redact(why)}\n"
                return PlainTextResponse(text, status_code=400)
            await asyncio.sleep(FLUSH_RETRY_S)

    async def init_weights_update_group(self, body: InitWeightsUpdateGroup) -> JSONResponse:
        """Every replica's SGLang joins the trainer's group (SGLang's fields), answering once every
        one has joined: the trainer joins the same rendezvous meanwhile. The app stands for one
        SGLang server whose TP ranks are every replica's in turn, from `rank_offset` on
        (docs/sglang.md#the-update-group-over-http)."""
        return await self._sglang_transfer(
            GROUP_JOINED_TEXT,
            lambda: self.controller.transfer_init.remote(body.engine_body(), body.rank_offset, body.world_size),
        )

    async def begin_weight_update(self, body: BeginWeightUpdate | None = None) -> JSONResponse:
        """Open one update on every replica's SGLang. It is the sync's stop: the app's own schedule
        stops the window the update ends, and generation is held until the update is published."""
        return await self._sglang_transfer(SESSION_TEXT, self.controller.transfer_begin.remote)

    async def update_weights_from_distributed(self, body: UpdateWeightsFromDistributed) -> JSONResponse:
        """One chunk of the open update into every replica's SGLang at once, each receiving the
        trainer's broadcast. `weight_version` names the version the update publishes at its end;
        `abort_all_requests` ends the requests in flight first, on an engine that can abort."""
        if (why := self.engine_options.transfer_refusal("sglang")) is not None:
            return _refused(why)
        if body.abort_all_requests and self.engine_options.has(Capability.ABORT):
            await self.controller.abort_requests.remote(None)
        return await self._sglang_transfer(
            CHUNK_LOADED_TEXT,
            lambda: self.controller.transfer_send.remote(body.engine_body(), body.weight_version),
        )

    async def end_weight_update(self, body: EndWeightUpdate | None = None) -> JSONResponse:
        """Close the update on every replica's SGLang and publish it as the version a chunk named
        (default: the served version + 1), once every replica reports it, as `/weights/update` with
        source external does; the app's own schedule then starts the window beginning there,
        before generation resumes."""
        if (why := self.engine_options.transfer_refusal("sglang")) is not None:
            return _refused(why)
        try:
            done: UpdateWeightsResponse = await self.controller.transfer_end.remote(None)
        except ControlError as e:
            return _refused(current().redact(e.detail))
        answer = SglangUpdateResult(
            success=True,
            message=f"{SESSION_TEXT} Weight version updated to {version_label(done.version)}.",
            update=done,
        )
        return JSONResponse(answer.model_dump(mode="json"))

    async def destroy_weights_update_group(self, body: DestroyWeightsUpdateGroup | None = None) -> JSONResponse:
        """Every replica's SGLang leaves the trainer's group (not during an update)."""
        group = body or DestroyWeightsUpdateGroup()
        return await self._sglang_transfer(
            GROUP_LEFT_TEXT, lambda: self.controller.transfer_close.remote(group.model_dump())
        )

    async def _sglang_transfer(self, done: str, call: Callable[[], Awaitable[Any]]) -> JSONResponse:
        """`call` to the controller, answered in SGLang's shape: `done` with success, or a 400 with
        why (the engine is not SGLang, or the app's refusal)."""
        if (why := self.engine_options.transfer_refusal("sglang")) is not None:
            return _refused(why)
        try:
            await call()
        except ControlError as e:
            return _refused(current().redact(e.detail))
        return JSONResponse(SglangResult(success=True, message=done).model_dump())


def _not_loaded(why: str) -> JSONResponse:
    body = UpdateWeightsFromDiskResponse(success=False, message=current().redact(why))
    return JSONResponse(body.model_dump(), status_code=400)


def _refused(why: str) -> JSONResponse:
    return JSONResponse(SglangResult(success=False, message=why).model_dump(), status_code=400)
