"""vLLM's server routes that RL frameworks' clients call beside the OpenAI ones (TRL's
`VLLMClient`, SkyRL's), with vLLM 0.33's shapes and the app's meanings (docs/http_api.md#vllm-routes):
/get_world_size, /server_info, /is_paused and /weight_info (read-only), /tokenize and /detokenize
(the served model's tokenizer, on a replica, as generation uses it), /reset_prefix_cache, /pause,
/resume, /abort_requests and /update_weight_version (control routes); vLLM's weight-transfer
routes, forwarded to every replica's vLLM weight-transfer engine where the engines have one (each
update one sync of the app: docs/design.md#engine-transfer), with prime-rl's `/update_weights
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
    ReplicaReport,
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
_TRANSFER_ERRORS: dict[int | str, dict[str, Any]] = {
    409: {
        "model": ErrorResponse,
        "description": "Out of order (no group, no update open, one open already, the replicas changed since the "
        "group formed, the update given up after hold_timeout_s), or a version not newer than the served one.",
    },
    422: {
        "model": ErrorResponse,
        "description": "The engines have no vLLM weight-transfer engine (engine vllm without "
        "engine_args.weight_transfer_config, or another engine), or the call's fields are refused.",
    },
    503: {"model": ErrorResponse, "description": "A replica's engine did not carry out the call (each named)."},
}


def _transfer_route(path: str) -> Callable[[Any], Any]:
    """A control route of vLLM's weight-transfer API."""
    return lambda app: app.post(
        path, dependencies=[Depends(require_control_token)], responses=_TRANSFER_ERRORS, tags=["vllm"]
    )
NOT_CONFIGURED = "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer."
"""vLLM's answer to a weight-transfer call where the engine has no weight-transfer engine."""
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


class InitWeightTransfer(StrictModel):
    """`/init_weight_transfer_engine`: the init fields of the engines' weight-transfer backend."""

    init_info: dict[str, Any]
    """As vLLM's backend takes them (nccl, rollout_gloo: master_address, master_port, rank_offset,
    world_size, ...). `rank_offset` is where the app's engine workers start in the trainer's group;
    each replica is given its own (docs/engines.md#vllm-weight-transfer-routes)."""

    @model_validator(mode="after")
    def _ranks_are_numbers(self) -> InitWeightTransfer:
        for key in ("rank_offset", "world_size"):
            value = self.init_info.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"init_info.{key} must be a non-negative integer, not {value!r}")
        return self

    def rank(self, key: str) -> int | None:
        value = self.init_info.get(key)
        return value if isinstance(value, int) else None


class FinishWeightUpdate(StrictModel):
    """`/finish_weight_update`."""

    weight_version: str | None = Field(None, min_length=1, max_length=64)
    """The version the update publishes, as vLLM labels it ("<k>"); default: the served version + 1."""


class TransferAnswer(BaseModel):
    """vLLM's answer (`message`), with each replica's report."""

    message: str
    replicas: list[ReplicaReport] = Field(default_factory=list)


class WeightUpdateFinished(BaseModel):
    """vLLM's answer (`message`), with the publication of the update's version (as
    `/weights/update` answers it, the app's own schedule's calls included)."""

    message: Literal["Weight update finished"] = "Weight update finished"
    update: UpdateWeightsResponse


class UpdateWeightsBody(StrictModel):
    """`/update_weights`: vLLM's `{update_info}` (a chunk for the engines' weight-transfer
    engine) or prime-rl's `{weight_dir}` (a checkpoint directory to load)."""

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
        "init_weight_transfer_engine": _transfer_route("/init_weight_transfer_engine"),
        "start_weight_update": _transfer_route("/start_weight_update"),
        "start_draft_weight_update": lambda app: app.post(
            "/start_draft_weight_update",
            dependencies=[Depends(require_control_token)],
            responses={422: {"model": ErrorResponse, "description": "Always: the app serves no draft model."}},
            tags=["vllm"],
        ),
        "update_weights_by_body": lambda app: app.post(
            "/update_weights",
            dependencies=[Depends(require_control_token)],
            responses={
                **_TRANSFER_ERRORS,
                422: {
                    "model": ErrorResponse,
                    "description": "`update_info` where the engines have no weight-transfer engine, or a checkpoint "
                    "the app cannot load.",
                },
            },
            tags=["vllm"],
        ),
        "finish_weight_update": _transfer_route("/finish_weight_update"),
        "shutdown_weight_transfer_engine": _transfer_route("/shutdown_weight_transfer_engine"),
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

    async def init_weight_transfer_engine(self, body: InitWeightTransfer) -> TransferAnswer:
        """Every replica's vLLM joins the trainer's group through its weight-transfer engine
        (`init_info` as vLLM's backend takes it), answering once every one has joined: the
        trainer joins the same rendezvous meanwhile. The app stands for one vLLM server whose
        workers are every replica's in turn, from `rank_offset` on (docs/engines.md#vllm-weight-transfer-routes)."""
        self._vllm_transfer()
        reports = await self.controller.transfer_init.remote(
            body.init_info, body.rank("rank_offset"), body.rank("world_size")
        )
        return TransferAnswer(message="Weight transfer initialized", replicas=reports)

    async def start_weight_update(self) -> TransferAnswer:
        """Open one update on every replica's engine. It is the sync's stop: the app's own
        schedule stops the window the update ends, and generation is held until the update is
        published (the weights are partly loaded meanwhile)."""
        self._vllm_transfer()
        reports = await self.controller.transfer_begin.remote()
        return TransferAnswer(message="Weight update started", replicas=reports)

    async def start_draft_weight_update(self) -> None:
        """Refused (422): the app's engines serve no speculative draft model."""
        raise Refused(
            "the app's engines serve no speculative draft model, so there are no draft weights to update: "
            "use /start_weight_update"
        )

    async def finish_weight_update(self, body: FinishWeightUpdate | None = None) -> WeightUpdateFinished:
        """Close the update on every replica's engine and publish it as version `weight_version`
        (default: the served version + 1) once every replica reports it, as `/weights/update`
        with source external does; the app's own schedule then starts the window beginning there,
        before generation resumes."""
        self._vllm_transfer()
        done: UpdateWeightsResponse = await self.controller.transfer_end.remote(
            (body or FinishWeightUpdate()).weight_version
        )
        return WeightUpdateFinished(update=done)

    async def shutdown_weight_transfer_engine(self) -> TransferAnswer:
        """Every replica's engine leaves the trainer's group (not during an update: 409)."""
        self._vllm_transfer()
        reports = await self.controller.transfer_close.remote({})
        return TransferAnswer(message="Weight transfer shut down", replicas=reports)

    async def update_weights_by_body(self, body: UpdateWeightsBody) -> WeightsLoaded | TransferAnswer:
        """vLLM's `{update_info}`: one chunk of the open update into every replica's engine at
        once, each receiving the trainer's broadcast (a list: one entry per engine worker of the
        app, as GET /get_world_size counts them). prime-rl's `{weight_dir}`: publish that
        checkpoint as the served version + 1, as `/weights/update` with source path does (its
        checks, conflicts and statuses apply)."""
        if body.weight_dir is None:
            self._vllm_transfer()
            reports = await self.controller.transfer_send.remote(body.update_info, None)
            return TransferAnswer(message="Weights updated", replicas=reports)
        desired: DesiredState = await self.controller.desired_state.remote()
        try:
            request = UpdateWeightsRequest(version=desired.weight_version + 1, path=body.weight_dir)
        except ValidationError as e:
            raise Refused(describe_validation_error(e)) from None
        done: UpdateWeightsResponse = await self.controller.update_weights.remote(request)
        return WeightsLoaded(update=done)

    def _vllm_transfer(self) -> None:
        """Refused (422, in vLLM's words and the app's) unless the replicas' engines have a
        weight-transfer engine driven through vLLM's routes."""
        if (why := self.engine_options.transfer_refusal("vllm")) is not None:
            raise Refused(f"{NOT_CONFIGURED} ({why}; or move the weights through POST /weights/update)")

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
        """The served model and the parallel layout under vLLM's config keys, with the engines'
        `weight_transfer_config` (null where they have none: a client that asks for vLLM's
        weight-transfer engine is told it is not there). Beside them, SGLang's keys
        (`model_path`, `tp_size`, `dp_size`, `weight_version`, ...)."""
        ranks = await self._ranks()
        desired: DesiredState = await self.controller.desired_state.remote()
        config = {
            "model_config": {"model": self.model_name, "served_model_name": self.model_name},
            "parallel_config": {
                "data_parallel_size": len(ranks),
                "world_size": max(ranks),
                "world_size_across_dp": sum(ranks),
            },
            "weight_transfer_config": self._transfer_config(),
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

    def _transfer_config(self) -> dict[str, str] | None:
        """vLLM's `weight_transfer_config` of the replicas' engines (None: they have none)."""
        if self.engine_options.transfer_refusal("vllm") is not None:
            return None
        return {"backend": self.engine_options.transfer_backend or ""}

    async def _ranks(self) -> list[int]:
        """Each running replica's engine workers (one where a replica does not say)."""
        status: StatusResponse = await self.controller.status.remote()
        return [r.transfer_ranks or 1 for r in status.replicas] or [1] * self.num_replicas
