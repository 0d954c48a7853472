"""/v1/models and /v1/completions (OpenAI shape, plus token ids and weight versions).
Generation goes through the load balancer; it never needs the control token."""

from __future__ import annotations

import asyncio
import time
import uuid

from ray.serve.handle import DeploymentHandle

from serve_app.api import (
    CompletionRequest,
    CompletionResponse,
    CompletionUsage,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from serve_app.errors import NotFound, Refused


class OpenAIRoutesMixin:
    replicas: DeploymentHandle
    model_name: str

    ENDPOINTS = {
        "list_models": lambda app: app.get("/v1/models", tags=["openai"]),
        "completions": lambda app: app.post(
            "/v1/completions",
            responses={404: {"model": ErrorResponse}, 422: {"model": ErrorResponse}},
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
        try:
            choices = await asyncio.gather(
                *(self.replicas.complete.remote(p, body, i) for i, p in enumerate(prompts))
            )
        except ValueError as e:
            # The replica's own message, not Ray's wrapper around it (a remote traceback).
            raise Refused(f"prompt: {getattr(e, 'cause', e)}") from e
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
