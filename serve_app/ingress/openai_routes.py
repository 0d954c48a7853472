"""/v1/models and /v1/completions (OpenAI shape, plus token ids and weight versions).
Generation goes through the load balancer; it never needs the control token."""

from __future__ import annotations

import asyncio
import time
import uuid

from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from serve_app.api import (
    CompletionRequest,
    CompletionResponse,
    CompletionUsage,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from serve_app.errors import NotFound, Refused, Unavailable
from serve_app.limits import RequestLimits

BUSY_RETRY_AFTER_S = 1
"""Seconds a caller turned away by a full queue waits before it retries."""


class OpenAIRoutesMixin:
    replicas: DeploymentHandle
    model_name: str
    request_limits: RequestLimits

    ENDPOINTS = {
        "list_models": lambda app: app.get("/v1/models", tags=["openai"]),
        "completions": lambda app: app.post(
            "/v1/completions",
            responses={
                404: {"model": ErrorResponse},
                413: {"model": ErrorResponse, "description": "Body over request_limits.max_body_bytes."},
                422: {"model": ErrorResponse},
                503: {"model": ErrorResponse, "description": "Queue full or no replica running; retry after Retry-After."},
            },
            tags=["openai"],
        ),
    }

    async def list_models(self) -> ModelList:
        """The one served model."""
        return ModelList(data=[ModelCard(id=self.model_name, created=int(time.time()))])

    async def completions(self, body: CompletionRequest) -> CompletionResponse:
        """OpenAI completions; each choice carries its token ids and weight version."""
        if body.model is not None and body.model != self.model_name:
            raise NotFound(f"model {body.model!r} is not served; this app serves {self.model_name!r}")
        prompts = [body.prompt] if isinstance(body.prompt, str) or isinstance(body.prompt[0], int) else body.prompt
        self._check_size(prompts)
        try:
            choices = await asyncio.gather(
                *(self.replicas.complete.remote(p, body, i) for i, p in enumerate(prompts))
            )
        except ValueError as e:
            # The replica's own message, not Ray's wrapper around it (a remote traceback).
            raise Refused(f"prompt: {getattr(e, 'cause', e)}") from e
        except BackPressureError as e:  # Serve's own answer to it is a bare text without Retry-After
            raise Unavailable(
                "every replica's queue is full (request_limits.max_queued_requests): retry after Retry-After "
                "seconds, or add replicas",
                retry_after_s=BUSY_RETRY_AFTER_S,
            ) from e
        except DeploymentUnavailableError as e:
            raise Unavailable(
                "no rollout replica is running (still starting, or failing to start: see `serve status`)",
                retry_after_s=BUSY_RETRY_AFTER_S,
            ) from e
        prompt_tokens = sum(len(c.prompt_token_ids) for c in choices)
        completion_tokens = sum(len(c.token_ids) for c in choices)
        return CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.model_name,
            choices=list(choices),
            usage=CompletionUsage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            ),
            weight_version=min(c.weight_version for c in choices),
        )

    def _check_size(self, prompts: list[str] | list[list[int]] | list[str | list[int]]) -> None:
        """Before anything is tokenized or queued: the number of prompts and each text's length."""
        limits = self.request_limits
        if len(prompts) > limits.max_prompts:
            raise Refused(f"prompt: {len(prompts)} prompts, over request_limits.max_prompts {limits.max_prompts}")
        for i, p in enumerate(prompts):
            if isinstance(p, str) and len(p) > limits.max_prompt_chars:
                raise Refused(
                    f"prompt {i}: {len(p)} characters, over request_limits.max_prompt_chars {limits.max_prompt_chars}"
                )
