"""vLLM's server routes that RL frameworks' clients call beside the OpenAI ones (TRL's
`VLLMClient`, SkyRL's), with vLLM 0.33's shapes and the app's meanings (docs/http_api.md#vllm-routes):
/get_world_size, /server_info, /is_paused and /weight_info (read-only), /tokenize and /detokenize
(the served model's tokenizer, on a replica, as generation uses it), /reset_prefix_cache, /pause,
/resume, /abort_requests and /update_weight_version (control routes); vLLM's weight-transfer
routes, refused (the app has no weight-transfer engine), with prime-rl's `/update_weights
{weight_dir}`, a checkpoint load.

vLLM answers for one server: its workers (tensor x pipeline parallel) and its data-parallel
copies. Here each rollout replica is one data-parallel copy, and its workers are the members it
puts in a collective weight transfer (`transfer_ranks`, one per engine worker).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import metadata
from typing import Any, ClassVar, Literal

from fastapi import Depends
from pydantic import BaseModel, Field, ValidationError, model_validator
from ray.serve.handle import DeploymentHandle

from profiling.config import StrictModel, describe_validation_error
from serve_app.api import (
    AbortRequestsRequest,
    AbortRequestsResponse,
    ClientPauseMode,
    ErrorResponse,
    IsPausedResponse,
    PauseResponse,
    ResetPrefixCacheResponse,
    ResumeResponse,
    StatusResponse,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
)
from serve_app.desired_state import DesiredState
from serve_app.engines.options import EngineOptions
from serve_app.errors import Conflict, Refused
from serve_app.generate_api import version_label, version_of_label
from serve_app.ingress.auth import require_control_token
from serve_app.ingress.openai_routes import check_chars, check_served, dispatch_errors
from serve_app.limits import RequestLimits
from serve_app.tokenize_api import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)

_PAUSE_ERRORS: dict[int | str, dict[str, Any]] = {
    422: {"model": ErrorResponse, "description": "An engine that cannot abort (mode=abort) or pause (mode=keep)."},
    503: {"model": ErrorResponse, "description": "A replica did not carry out the call (each named)."},
}
_NO_TRANSFER_ENGINE: dict[int | str, dict[str, Any]] = {
    422: {"model": ErrorResponse, "description": "Always: the app has no vLLM weight-transfer engine."}
}
NO_TRANSFER_ENGINE = (
    "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer. (vLLM's words: "
    "this app has no vLLM weight-transfer engine; weights move through POST /weights/update, from a checkpoint "
    "under weights_dir, through the app's own collective, or moved by the trainer itself: "
    "docs/design.md#weight-transfer)"
)
_TOKENIZE_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorResponse, "description": "The request names a model this app does not serve."},
    422: {"model": ErrorResponse, "description": "A field out of range, or a token id the model cannot embed."},
    503: {"model": ErrorResponse, "description": "No replica running; retry after Retry-After."},
}


class WorldSize(BaseModel):
    world_size: int
    """Engine workers: of every replica (`include_dp`), or of one."""


class ResetPrefixCache(StrictModel):
    """`/reset_prefix_cache`'s options as a JSON body (SkyRL's client sends them so)."""

    reset_running_requests: bool = False
    reset_external: bool = False


class WeightInfo(BaseModel):
    weight_version: str
    """The served version as vLLM labels it ("default": the initial weights)."""


class NewWeightVersion(StrictModel):
    new_version: str = Field(min_length=1, max_length=64)
    abort_all_requests: bool | None = None
    """SGLang's: accepted either way; the relabel changes nothing, so no request in flight ends."""


class WeightVersionSet(BaseModel):
    """vLLM's answer (`success`, `new_version`) with SGLang's `message`."""

    success: Literal[True] = True
    message: str
    new_version: str


class ServerInfo(BaseModel):
    """vLLM's `/server_info`: `vllm_config` holds the app's answers in vLLM's config keys (a
    summary, not a vLLM config: the app has no other), as JSON or as text; and SGLang's
    top-level keys (its `/server_info` and `/get_server_info`), where the app can answer them."""

    vllm_config: dict[str, Any] | str
    vllm_env: dict[str, str]
    system_env: dict[str, str]
    model_path: str
    """SGLang's: the served model's name (the app names no server path)."""
    served_model_name: str
    tp_size: int
    """SGLang's: the engine workers of one replica (tensor x pipeline parallel)."""
    dp_size: int
    """SGLang's: the replicas, each one data-parallel copy."""
    weight_version: str
    """SGLang's: the served version's label ("default": the initial weights)."""
    version: str
    """SGLang's: here the app's own version."""


class UpdateWeightsBody(StrictModel):
    """`/update_weights`: vLLM's `{update_info}` (a chunk for its weight-transfer engine: refused,
    the app has none) or prime-rl's `{weight_dir}` (a checkpoint directory to load)."""

    update_info: dict[str, Any] | list[dict[str, Any]] | None = None
    weight_dir: str | None = Field(None, min_length=1)
    """A checkpoint inside the app's weights_dir, published as the served version + 1."""
    skip_prefix_cache_reset: bool = False
    """prime-rl's: accepted either way (every weight switch empties the prefix cache)."""

    @model_validator(mode="after")
    def _one(self) -> UpdateWeightsBody:
        if (self.update_info is None) == (self.weight_dir is None):
            raise ValueError("give `weight_dir` (a checkpoint to load) or vLLM's `update_info`, one of them")
        return self


class WeightsLoaded(BaseModel):
    """prime-rl's answer (`status`) with the app's `/weights/update` answer."""

    status: Literal["ok"] = "ok"
    update: UpdateWeightsResponse


class VllmRoutesMixin:
    controller: DeploymentHandle
    replicas: DeploymentHandle
    model_name: str
    engine_options: EngineOptions
    request_limits: RequestLimits
    num_replicas: int

    ENDPOINTS: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "get_world_size": lambda app: app.get("/get_world_size", tags=["vllm"]),
        "server_info": lambda app: app.get("/server_info", tags=["vllm"]),
        "tokenize": lambda app: app.post("/tokenize", responses=_TOKENIZE_ERRORS, tags=["vllm"]),
        "detokenize": lambda app: app.post("/detokenize", responses=_TOKENIZE_ERRORS, tags=["vllm"]),
        "reset_prefix_cache": lambda app: app.post(
            "/reset_prefix_cache", dependencies=[Depends(require_control_token)], tags=["vllm"]
        ),
        "pause": lambda app: app.post(
            "/pause", dependencies=[Depends(require_control_token)], responses=_PAUSE_ERRORS, tags=["vllm"]
        ),
        "resume": lambda app: app.post(
            "/resume", dependencies=[Depends(require_control_token)], responses=_PAUSE_ERRORS, tags=["vllm"]
        ),
        "abort_requests": lambda app: app.post(
            "/abort_requests",
            dependencies=[Depends(require_control_token)],
            responses={
                422: {"model": ErrorResponse, "description": "A malformed body, or an engine that cannot abort."},
                503: {"model": ErrorResponse, "description": "A replica did not carry out the call (each named)."},
            },
            tags=["vllm"],
        ),
        "is_paused": lambda app: app.get("/is_paused", tags=["vllm"]),
        "weight_info": lambda app: app.get("/weight_info", tags=["vllm"]),
        "update_weight_version": lambda app: app.post(
            "/update_weight_version",
            dependencies=[Depends(require_control_token)],
            responses={409: {"model": ErrorResponse}, 422: {"model": ErrorResponse}},
            tags=["vllm"],
        ),
        "init_weight_transfer_engine": lambda app: app.post(
            "/init_weight_transfer_engine",
            dependencies=[Depends(require_control_token)],
            responses=_NO_TRANSFER_ENGINE,
            tags=["vllm"],
        ),
        "start_weight_update": lambda app: app.post(
            "/start_weight_update",
            dependencies=[Depends(require_control_token)],
            responses=_NO_TRANSFER_ENGINE,
            tags=["vllm"],
        ),
        "update_weights_by_body": lambda app: app.post(
            "/update_weights",
            dependencies=[Depends(require_control_token)],
            responses={
                409: {"model": ErrorResponse},
                422: {"model": ErrorResponse, "description": "`update_info`, or a checkpoint the app cannot load."},
            },
            tags=["vllm"],
        ),
        "finish_weight_update": lambda app: app.post(
            "/finish_weight_update",
            dependencies=[Depends(require_control_token)],
            responses=_NO_TRANSFER_ENGINE,
            tags=["vllm"],
        ),
    }

    async def weight_info(self) -> WeightInfo:
        """The served weight version as vLLM labels it: "default" for the weights the engine
        started with (the app's version 0), "k" for version k."""
        status: StatusResponse = await self.controller.status.remote()
        return WeightInfo(weight_version=version_label(status.weight_version))

    async def update_weight_version(self, body: NewWeightVersion) -> WeightVersionSet:
        """vLLM's relabelling of the served weights. The app's version changes only with its
        weights (`/weights/update` publishes and labels them), so only the served version's own
        label is taken (a no-op); any other is a 409 naming the way to publish it."""
        version = version_of_label(body.new_version)
        if version is None:
            raise Refused(
                f'new_version {body.new_version!r} names no version of this app: its versions are "default" (the '
                "weights the engine started with) and positive integers"
            )
        status: StatusResponse = await self.controller.status.remote()
        if version != status.weight_version:
            raise Conflict(
                f"version {status.weight_version} ({version_label(status.weight_version)!r}) is served; the app's "
                f"version changes only with its weights: publish version {version} through POST /weights/update, "
                "which labels the weights it loads"
            )
        return WeightVersionSet(message=f"Weight version updated to {body.new_version}", new_version=body.new_version)

    async def init_weight_transfer_engine(self) -> None:
        """Refused (422): vLLM's answer without a weight-transfer engine, and where weights move here."""
        raise Refused(NO_TRANSFER_ENGINE)

    async def start_weight_update(self) -> None:
        """Refused (422), as /init_weight_transfer_engine."""
        raise Refused(NO_TRANSFER_ENGINE)

    async def finish_weight_update(self) -> None:
        """Refused (422), as /init_weight_transfer_engine."""
        raise Refused(NO_TRANSFER_ENGINE)

    async def update_weights_by_body(self, body: UpdateWeightsBody) -> WeightsLoaded:
        """prime-rl's `{weight_dir}`: publish that checkpoint as the served version + 1, as
        `/weights/update` with source path does (its checks, conflicts and statuses apply).
        vLLM's `{update_info}`: refused (422), as /init_weight_transfer_engine."""
        if body.weight_dir is None:
            raise Refused(NO_TRANSFER_ENGINE)
        desired: DesiredState = await self.controller.desired_state.remote()
        try:
            request = UpdateWeightsRequest(version=desired.weight_version + 1, path=body.weight_dir)
        except ValidationError as e:
            raise Refused(describe_validation_error(e)) from None
        done: UpdateWeightsResponse = await self.controller.update_weights.remote(request)
        return WeightsLoaded(update=done)

    async def pause(self, mode: ClientPauseMode = "abort", clear_cache: bool = True) -> PauseResponse:
        """Pause generation on every replica until `/resume`, or until client_pause_max_s passes
        (docs/design.md#client-pause): `abort` (vLLM's default) ends every request in flight at
        once (each answers finish_reason abort with the tokens sampled so far) and refuses new
        ones (503), as vLLM 0.33 does; `keep` freezes requests in flight between engine steps and
        queues new ones; `wait` refuses new ones (503) and answers once those in flight finished.
        `clear_cache` is accepted and has no effect (deprecated in vLLM; every weight switch
        empties the prefix cache on its own)."""
        return await self.controller.pause.remote(mode)

    async def abort_requests(self, body: AbortRequestsRequest) -> AbortRequestsResponse:
        """End generation requests in flight without pausing (vLLM's): those `request_ids`
        names (a completion's `id`, or the request id vLLM's server gives one of its prompts:
        docs/http_api.md#request-ids), or every one when it is null or empty. Each answers
        finish_reason abort with the tokens sampled so far; `aborted` counts them, one per
        choice."""
        return await self.controller.abort_requests.remote(body.request_ids)

    async def resume(self) -> ResumeResponse:
        """End a client's pause on every replica (none in effect: nothing changes)."""
        return await self.controller.resume.remote()

    async def is_paused(self) -> IsPausedResponse:
        """Whether a client's pause is in effect, its mode, and when it ends on its own."""
        return await self.controller.is_paused.remote()

    async def get_world_size(self, include_dp: bool = True) -> WorldSize:
        """Engine workers over every replica (each replica a data-parallel copy, as vLLM counts
        data parallelism), or, with `include_dp=false`, of one replica."""
        ranks = await self._ranks()
        return WorldSize(world_size=sum(ranks) if include_dp else max(ranks))

    async def server_info(self, config_format: Literal["text", "json"] = "text") -> ServerInfo:
        """The served model and the parallel layout under vLLM's config keys; no weight-transfer
        engine (`weight_transfer_config` null): weights move through `/weights/update`, so a
        client that asks for vLLM's NCCL weight-transfer engine is told it is not there. Beside
        them, SGLang's keys (`model_path`, `tp_size`, `dp_size`, `weight_version`, ...)."""
        ranks = await self._ranks()
        desired: DesiredState = await self.controller.desired_state.remote()
        config = {
            "model_config": {"model": self.model_name, "served_model_name": self.model_name},
            "parallel_config": {
                "data_parallel_size": len(ranks),
                "world_size": max(ranks),
                "world_size_across_dp": sum(ranks),
            },
            "weight_transfer_config": None,
            "engine": self.engine_options.engine,
        }
        return ServerInfo(
            vllm_config=config if config_format == "json" else json.dumps(config),
            vllm_env={},
            system_env={},
            model_path=self.model_name,
            served_model_name=self.model_name,
            tp_size=max(ranks),
            dp_size=len(ranks),
            weight_version=version_label(desired.weight_version),
            version=metadata.version("rollout-profiler"),
        )

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """A text prompt's token ids (`prompt`), or a conversation's rendered with the model's
        chat template (`messages`), exactly as the OpenAI routes tokenize them."""
        check_served(body.model, self.model_name)
        field = "messages" if isinstance(body, TokenizeChatRequest) else "prompt"
        chars = sum(len(m.text()) for m in body.messages) if isinstance(body, TokenizeChatRequest) else len(body.prompt)
        check_chars(self.request_limits, {field: chars})
        with dispatch_errors(field):
            return await self.replicas.tokenize.remote(body)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids, special tokens kept (vLLM's)."""
        check_served(body.model, self.model_name)
        with dispatch_errors("tokens"):
            return await self.replicas.detokenize.remote(body)

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_external: bool = False, body: ResetPrefixCache | None = None
    ) -> ResetPrefixCacheResponse:
        """Empty the prefix cache of every replica's engine (every weight switch does it on its
        own): `success` false when an engine refused, as vLLM's does while requests in flight
        hold cached blocks (`reset_running_requests` preempts them; `reset_external`: a KV
        connector's cache too). vLLM reads them from the query; SkyRL's client sends them as a
        JSON body, which is read too (either one asking is enough). The embedded engine shares
        no KV between requests: nothing to empty."""
        if body is not None:
            reset_running_requests = reset_running_requests or body.reset_running_requests
            reset_external = reset_external or body.reset_external
        return await self.controller.reset_prefix_cache.remote(reset_running_requests, reset_external)

    async def _ranks(self) -> list[int]:
        """Each running replica's engine workers (one where a replica does not say)."""
        status: StatusResponse = await self.controller.status.remote()
        return [r.transfer_ranks or 1 for r in status.replicas] or [1] * self.num_replicas
