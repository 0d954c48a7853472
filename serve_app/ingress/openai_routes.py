"""The generation routes: /v1/models, /v1/completions and /v1/chat/completions (OpenAI's shapes,
plus token ids and weight-version spans; docs/http_api.md#openai-routes), and vLLM's token-in,
token-out /inference/v1/generate (a completion with a token-id prompt, in vLLM's shape;
docs/http_api.md#vllm-routes). Generation goes through the load balancer, one handle call per
prompt (its `n` choices stay on one replica, sharing its prefix cache); it never needs the
control token."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, ClassVar, cast

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from profiling.config import describe_validation_error
from serve_app.admission import BUSY_RETRY_AFTER_S
from serve_app.api import ErrorResponse
from serve_app.async_streams import merged
from serve_app.choices import JobAccepted, JobDone, JobResult, OpenAIRequest, PromptJob
from serve_app.engines.options import EngineOptions
from serve_app.errors import ControlError, NotFound, Refused, Unavailable
from serve_app.generate_api import GenerateRequest, GenerateResponse, generate_response, version_label
from serve_app.ingress.settings import current
from serve_app.limits import RequestLimits
from serve_app.openai_api import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
)

log = logging.getLogger(__name__)

_GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorResponse, "description": "The request names a model this app does not serve."},
    413: {"model": ErrorResponse, "description": "Body over request_limits.max_body_bytes."},
    422: {
        "model": ErrorResponse,
        "description": "A field out of range, one the engine cannot honour, or a prompt that does not fit the context.",
    },
    503: {"model": ErrorResponse, "description": "Queue full or no replica running; retry after Retry-After."},
}


def _streamed(model: type) -> dict[int | str, dict[str, Any]]:
    return {
        200: {
            "model": model,
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
            "description": "With `stream: true`, server-sent events: `data: <chunk>` lines, then `data: [DONE]`.",
        },
        **_GENERATION_ERRORS,
    }


class OpenAIRoutesMixin:
    replicas: DeploymentHandle
    model_name: str
    request_limits: RequestLimits
    engine_options: EngineOptions
    num_replicas: int

    ENDPOINTS: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "list_models": lambda app: app.get("/v1/models", tags=["openai"]),
        "completions": lambda app: app.post(
            "/v1/completions", response_model=None, responses=_streamed(CompletionResponse), tags=["openai"]
        ),
        "chat_completions": lambda app: app.post(
            "/v1/chat/completions", response_model=None, responses=_streamed(ChatCompletionResponse), tags=["openai"]
        ),
        "generate_tokens": lambda app: app.post(
            "/inference/v1/generate",
            response_model=None,
            responses={200: {"model": GenerateResponse}, **_GENERATION_ERRORS},
            tags=["vllm"],
        ),
    }

    async def list_models(self) -> ModelList:
        """The one served model."""
        return ModelList(data=[ModelCard(id=self.model_name, created=int(time.time()))])

    async def completions(self, body: CompletionRequest) -> Response:
        """OpenAI completions; each choice adds its token ids and weight-version spans."""
        prompts = body.prompts()
        self._check(body, len(prompts), {f"prompt {i}": len(p) for i, p in enumerate(prompts) if isinstance(p, str)})
        rid = f"cmpl-{body.request_id or uuid.uuid4().hex}"
        # vLLM's server gives prompt i of completion `rid` the request id `rid-i`.
        jobs = [
            PromptJob(request=body, prompt_index=i, prompt=p, names=[rid, f"{rid}-{i}"]) for i, p in enumerate(prompts)
        ]
        if body.stream:
            return await self._stream(body, jobs, CompletionChunk, rid)
        results = await self._run(jobs)
        return _json(
            body,
            CompletionResponse(
                id=rid,
                created=int(time.time()),
                model=self.model_name,
                choices=[c for r in results for c in r.choices],
                usage=_usage(results),
                weight_version=min(c.weight_version for r in results for c in r.choices),
            ),
        )

    async def chat_completions(self, body: ChatCompletionRequest) -> Response:
        """OpenAI chat completions over the model's chat template; each choice adds the token ids
        of prompt and answer and the answer's weight-version spans."""
        self._check(body, 1, {"messages": sum(len(m.text()) for m in body.messages)})
        rid = f"chatcmpl-{body.request_id or uuid.uuid4().hex}"
        jobs = [PromptJob(request=body, prompt_index=0, names=[rid])]  # vLLM's id of its one prompt too
        if body.stream:
            return await self._stream(body, jobs, ChatCompletionChunk, rid)
        results = await self._run(jobs)
        return _json(
            body,
            ChatCompletionResponse(
                id=rid,
                created=int(time.time()),
                model=self.model_name,
                choices=results[0].choices,
                usage=_usage(results),
                weight_version=min(c.weight_version for c in results[0].choices),
                prompt_token_ids=results[0].choices[0].prompt_token_ids,
                prompt_logprobs=results[0].choices[0].prompt_logprobs,
            ),
        )

    async def generate_tokens(self, body: GenerateRequest) -> Response:
        """vLLM's token-in, token-out generation: the same sampling, admission and weight-version
        spans as a completion of the token-id prompt, in vLLM's tokens-mode shape (each
        position's logprobs keyed by token id; weight versions labelled as vLLM labels them)."""
        try:
            request = body.completion()
        except ValidationError as e:
            raise Refused(f"sampling_params: {describe_validation_error(e, 'sampling_params')}") from None
        self._check(request, 1, {})
        body = body.model_copy(update={"request_id": body.request_id or uuid.uuid4().hex})
        # The answer's request_id, and the id vLLM's server gives the request.
        names = [body.request_id, f"generate-tokens-{body.request_id}"]
        results = await self._run([PromptJob(request=request, prompt_index=0, prompt=body.token_ids, names=names)])
        choices = [c for c in results[0].choices if isinstance(c, CompletionChoice)]  # a completion's, all
        answer = generate_response(body, choices, _usage(results), self.model_name, int(time.time()))
        return Response(answer.model_dump_json(), media_type="application/json")

    # -- internals -------------------------------------------------------------------------
    def _check(self, body: OpenAIRequest, prompts: int, chars: dict[str, int]) -> None:
        """Before anything is tokenized or queued: the model, the engine's fields, the size.
        `chars`: the characters of each text to tokenize, by the name a refusal gives it."""
        check_served(body.model, self.model_name)
        options = self.engine_options
        for name, why in options.unsupported_sampling.items():
            if name in body.model_fields_set and getattr(body, name) != type(body).model_fields[name].default:
                raise Refused(f"{name} is not available with engine {options.engine!r}: {why}")
        limits = self.request_limits
        if prompts > limits.max_prompts:
            raise Refused(f"prompt: {prompts} prompts, over request_limits.max_prompts {limits.max_prompts}")
        if prompts * body.n > limits.max_choices:
            raise Refused(
                f"{prompts} prompts x n={body.n} = {prompts * body.n} choices, over request_limits.max_choices "
                f"{limits.max_choices}"
            )
        check_chars(limits, chars)

    def _calls(self, jobs: list[PromptJob]) -> list[list[PromptJob]]:
        """The prompts of a request in as few handle calls as still spread it over the replicas
        (a call costs more than a prompt): up to one contiguous slice per replica."""
        k = min(len(jobs), self.num_replicas)
        size = -(-len(jobs) // k)
        return [jobs[i : i + size] for i in range(0, len(jobs), size)]

    async def _run(self, jobs: list[PromptJob]) -> list[JobResult]:
        with dispatch_errors():
            parts = await asyncio.gather(*(self.replicas.run_jobs.remote(c) for c in self._calls(jobs)))
        return [r for part in parts for r in part]

    async def _stream(
        self,
        body: OpenAIRequest,
        jobs: list[PromptJob],
        chunk: type[CompletionChunk | ChatCompletionChunk],
        rid: str,
    ) -> StreamingResponse:
        """Start every job and wait for each to be accepted (so a prompt that does not fit, or a
        full queue, is still a 4xx/503), then stream their pieces as server-sent events."""
        streaming = self.replicas.options(stream=True)
        streams = [cast(DeploymentResponseGenerator, streaming.stream_jobs.remote(c)) for c in self._calls(jobs)]
        try:
            with dispatch_errors():
                accepted = [await s.__anext__() for s in streams]
        except BaseException:
            for s in streams:
                s.cancel()
            raise
        prompt_tokens = sum(a.prompt_tokens for a in accepted if isinstance(a, JobAccepted))
        head = {"id": rid, "created": int(time.time()), "model": self.model_name}
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        async def events() -> AsyncIterator[bytes]:
            completion_tokens = 0
            try:
                async for _, item in merged(streams):
                    if isinstance(item, JobDone):
                        completion_tokens += item.completion_tokens
                    else:
                        yield _event(chunk(**head, choices=[item]), labelled=bool(body.return_weight_versions))
                if include_usage:
                    usage = Usage(
                        prompt_tokens=prompt_tokens,
                        completion_tokens=completion_tokens,
                        total_tokens=prompt_tokens + completion_tokens,
                    )
                    yield _event(chunk(**head, choices=[], usage=usage))
            except Exception as e:  # noqa: BLE001 - the status is sent: the error goes in the stream
                yield _event(_stream_error(e))
            finally:
                # The caller went away (or the stream ended): abort whatever still runs.
                for s in streams:
                    s.cancel()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _json(body: OpenAIRequest, answer: CompletionResponse | ChatCompletionResponse) -> Response:
    """The answer as JSON, serialized by pydantic (FastAPI's encoder walks every token id in
    Python: many times slower for n choices of long answers); with `return_weight_versions`,
    its spans labelled as vLLM labels them."""
    if body.return_weight_versions:
        return Response(_labelled(answer), media_type="application/json")
    return Response(answer.model_dump_json(), media_type="application/json")


def _labelled(answer: BaseModel) -> str:
    """`answer` as JSON with every choice's weight-version spans in vLLM's shape (`version` the
    label: "default" for version 0, "k" for version k), as `return_weight_versions` asks."""
    data = answer.model_dump(mode="json")
    for choice in data["choices"]:
        for span in choice.get("weight_versions") or ():
            span["version"] = version_label(span["version"])
    return json.dumps(data)


def _usage(results: list[JobResult]) -> Usage:
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(r.completion_tokens for r in results)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _event(payload: BaseModel | dict[str, Any], labelled: bool = False) -> bytes:
    if isinstance(payload, BaseModel):
        data = _labelled(payload) if labelled else payload.model_dump_json()
    else:
        data = json.dumps(payload)
    return f"data: {data}\n\n".encode()


def _stream_error(e: Exception) -> dict[str, Any]:
    """An error after the 200 was sent, as OpenAI streams it: `data: {"error": {...}}`."""
    try:
        with dispatch_errors():
            raise e
    except ControlError as known:
        status, message = known.status, known.detail
    except Exception as other:
        log.error("a streamed generation failed", exc_info=other)
        cause = str(getattr(other, "cause", None) or other).strip().splitlines()
        status, message = 500, f"{type(other).__name__}: {cause[0] if cause else ''}"
    return {"error": {"message": current().redact(message), "code": status}}


def check_served(model: str | None, served: str) -> None:
    """NotFound (404) when a request names a model other than the served one."""
    if model is not None and model != served:
        raise NotFound(f"model {model!r} is not served; this app serves {served!r}")


def check_chars(limits: RequestLimits, chars: dict[str, int]) -> None:
    """Refused (422) naming a text over max_prompt_chars; `chars`: each text's length by the name
    a refusal gives it."""
    for name, count in chars.items():
        if count > limits.max_prompt_chars:
            raise Refused(f"{name}: {count} characters, over request_limits.max_prompt_chars {limits.max_prompt_chars}")


@contextlib.contextmanager
def dispatch_errors(field: str = "prompt") -> Iterator[None]:
    """A replica's refusal as a 422 naming `field` with the replica's own message (not Ray's
    wrapper around it, a remote traceback), no replica as a 503 with Retry-After (a replica's
    full queue is its own 503: serve_app/admission.py)."""
    try:
        yield
    except ValueError as e:
        raise Refused(f"{field}: {getattr(e, 'cause', e)}") from e
    except DeploymentUnavailableError as e:
        raise Unavailable(
            "no rollout replica is running (still starting, or failing to start: see `serve status`)",
            retry_after_s=BUSY_RETRY_AFTER_S,
        ) from e
