"""The wire schema of vLLM's token-in, token-out `/inference/v1/generate` (vLLM 0.33's
`GenerateRequest` and tokens-mode `GenerateResponse`; docs/http_api.md#vllm-routes), and its
mapping onto the app's completions: the same sampling, admission and weight-version spans as
`/v1/completions` with a token-id prompt.

vLLM labels weight versions with strings; the app numbers them. `version_label` is the one
mapping: version 0 (the engine's initial weights) is vLLM's `"default"`, version k is `"k"`.

Pure pydantic; unknown fields are refused (422 naming the field), sampling parameters included.
"""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from profiling.config import StrictModel
from serve_app.choices import LOWEST_LOGPROB
from serve_app.engines.generation import WeightVersionSpan
from serve_app.openai_api import (
    MAX_CHOICES,
    MAX_TOP_LOGPROBS,
    TOKEN_ID_PREFIX,
    CacheSalt,
    CompletionChoice,
    CompletionRequest,
    PromptLogprobs,
    Usage,
)

INITIAL_VERSION_LABEL = "default"
"""vLLM's label of the weights an engine started with (the app's version 0)."""


def version_label(version: int) -> str:
    """The app's integer weight version as vLLM labels it."""
    return INITIAL_VERSION_LABEL if version == 0 else str(version)


def version_of_label(label: str) -> int | None:
    """The app's version a vLLM label names (None: a label no app version has)."""
    if label == INITIAL_VERSION_LABEL:
        return 0
    return int(label) if label.isascii() and label.isdigit() and label[0] != "0" else None


class SamplingParams(StrictModel):
    """vLLM's `SamplingParams` fields the app honours, with vLLM's defaults; any other is refused."""

    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0, allow_inf_nan=False)
    temperature: float = Field(1.0, ge=0.0, le=10.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int = Field(16, ge=1)
    """Output tokens per choice (vLLM's null, the rest of the context, is not taken: give a number)."""
    min_tokens: int = Field(0, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    """Accepted either way: the tokens-mode answer carries no text."""
    skip_special_tokens: bool = True
    """Accepted either way: the tokens-mode answer carries no text."""
    spaces_between_special_tokens: bool = True
    """Accepted either way: the tokens-mode answer carries no text."""


class GenerateRequest(StrictModel):
    """`POST /inference/v1/generate`: token ids in, token ids out."""

    request_id: str | None = Field(None, max_length=256)
    token_ids: list[int] = Field(min_length=1)
    sampling_params: SamplingParams = SamplingParams()
    model: str | None = None
    cache_salt: CacheSalt | None = None
    """As on `/v1/completions`: only requests with the same salt share prefix-cache blocks."""
    return_token_ids: bool | None = None
    """With true, the answer carries `prompt_token_ids`."""
    output_mode: Literal["tokens"] = "tokens"
    """Only `tokens`: `text` and `derender` are vLLM's, for servers that detokenize on this route."""
    stream: Literal[False] = False
    """Only false: stream through `/v1/completions`."""
    priority: Literal[0] = 0
    """Only 0: the app's engines schedule first come, first served."""

    @model_validator(mode="after")
    def _ids(self) -> GenerateRequest:
        if any(t < 0 for t in self.token_ids):
            raise ValueError("token_ids must not contain negative values")
        return self

    def completion(self) -> CompletionRequest:
        """The same generation as a `/v1/completions` request with a token-id prompt."""
        sp = self.sampling_params
        fields = sp.model_dump(
            exclude={"prompt_logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens"}
        )
        return CompletionRequest(
            model=self.model,
            prompt=self.token_ids,
            prompt_logprobs=sp.prompt_logprobs,
            cache_salt=self.cache_salt,
            return_tokens_as_token_ids=True,
            **fields,
        )


class GenerateLogProb(BaseModel):
    token_id: int
    logprob: float
    rank: int | None = None
    """1: the most likely token; null where not known (the sampled token outside the top k)."""


class GenerateLogProbsContent(GenerateLogProb):
    """The sampled token at one position, then its alternatives in rank order."""

    top_logprobs: list[GenerateLogProb] = []


class GenerateLogProbs(BaseModel):
    content: list[GenerateLogProbsContent] | None = None


class VersionSpan(BaseModel):
    """vLLM's `WeightVersionSpan`: output tokens `[start, end)` were sampled by weights `version`."""

    version: str
    start: int
    end: int


class GenerateChoice(BaseModel):
    index: int
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    logprobs: GenerateLogProbs | None = None
    weight_versions: list[VersionSpan] | None = None


class GenerateResponse(BaseModel):
    request_id: str
    model: str | None = None
    created: int | None = None
    output_mode: Literal["tokens"] = "tokens"
    choices: list[GenerateChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: None = None


def generate_response(
    request: GenerateRequest, choices: list[CompletionChoice], usage: Usage, model: str, created: int
) -> GenerateResponse:
    """vLLM's tokens-mode answer from the completion choices of `request.completion()`."""
    return GenerateResponse(
        request_id=request.request_id or uuid.uuid4().hex,
        model=model,
        created=created,
        choices=[_choice(c, request.sampling_params.logprobs) for c in choices],
        usage=usage,
        prompt_logprobs=choices[0].prompt_logprobs if choices else None,
        prompt_token_ids=request.token_ids if request.return_token_ids else None,
    )


def _choice(c: CompletionChoice, k: int | None) -> GenerateChoice:
    return GenerateChoice(
        index=c.index,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        token_ids=c.token_ids,
        logprobs=_logprobs(c, k),
        weight_versions=[_span(s) for s in c.weight_versions],
    )


def _span(span: WeightVersionSpan) -> VersionSpan:
    return VersionSpan(version=version_label(span.version), start=span.start, end=span.end)


def _logprobs(c: CompletionChoice, k: int | None) -> GenerateLogProbs | None:
    """vLLM's per-position content: the sampled token, then the `k` most likely others in rank
    order. The completion's alternatives (keyed `token_id:<id>`) are the k most likely plus the
    sampled token when it is not among them, whose rank is then not known."""
    lp = c.logprobs
    if lp is None or k is None:
        return None
    tops = lp.top_logprobs or [None] * len(c.token_ids)
    content = []
    for token_id, logprob, top in zip(c.token_ids, lp.token_logprobs, tops, strict=True):
        ranked = sorted(((_id(t), v) for t, v in (top or {}).items()), key=lambda e: -e[1])[:k]
        rank = {t: i + 1 for i, (t, _) in enumerate(ranked)}
        sampled = GenerateLogProb(
            token_id=token_id, logprob=LOWEST_LOGPROB if logprob is None else logprob, rank=rank.get(token_id)
        )
        others = [GenerateLogProb(token_id=t, logprob=v, rank=rank[t]) for t, v in ranked if t != token_id]
        content.append(GenerateLogProbsContent(**sampled.model_dump(), top_logprobs=[sampled, *others]))
    return GenerateLogProbs(content=content)


def _id(token: str) -> int:
    return int(token.removeprefix(TOKEN_ID_PREFIX))
