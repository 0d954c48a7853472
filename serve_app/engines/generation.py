"""What an engine is asked to generate and what it streams back: one sequence per request.

Every engine maps `SamplingSpec` onto its own sampler (the embedded engine's, vLLM's
`SamplingParams`, SGLang's `sampling_params`) and streams `GenerateDelta`s; the replica turns
them into OpenAI choices (serve_app/choices.py). Choices of one prompt (`n`) are independent
requests to the engine, each with its own seed.
"""

from __future__ import annotations

import uuid

from pydantic import BaseModel, Field


class WeightVersionSpan(BaseModel):
    """Output tokens `[start, end)` of a choice were sampled with weights `version`."""

    version: int
    start: int = Field(ge=0)
    end: int = Field(ge=0)


class SamplingSpec(BaseModel):
    """Engine-neutral sampling of one sequence; the defaults change nothing (plain sampling at
    temperature 1 over the whole vocabulary)."""

    max_tokens: int = Field(ge=1)
    """Most output tokens."""
    temperature: float = Field(1.0, ge=0.0)
    """0: greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    """0: no top-k cut."""
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    """Stop strings: generation ends once the output text contains one."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Tokens that end generation besides EOS (the token is kept in the output)."""
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    """No EOS, stop token or stop string ends the sequence before this many output tokens."""
    repetition_penalty: float = Field(1.0, gt=0.0)
    """Multiplicative, over prompt and output tokens (>1 discourages repeats)."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already in the output."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it occurs in the output."""
    logprobs: int | None = Field(None, ge=0)
    """None: no logprobs; 0: the sampled token's; k: also the k most likely tokens'."""
    prompt_logprobs: int | None = Field(None, ge=0)
    """None: none; k: each prompt token's logprob (after the first) plus the k most likely."""
    include_stop_str_in_output: bool = False
    """Keep a matched stop string in the text."""


class GenerateRequest(BaseModel):
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: SamplingSpec
    stream: bool = False
    """The caller consumes deltas as they come; False lets an engine send one final delta."""
    cache_salt: str | None = None
    """Only requests with the same salt share prefix-cache blocks (an engine without a prefix
    cache shared between requests ignores it)."""
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    """This sequence's id in the engine (vLLM's request id, SGLang's rid), unique among the
    sequences in flight: what `Aborts.abort` names it by."""
    names: list[str] = Field(default_factory=list)
    """The ids a client's `/abort_requests` finds this sequence by: its answer's `id`, and the
    request id vLLM's server would give its prompt (docs/http_api.md#request-ids)."""


class TokenLogprobs(BaseModel):
    """The sampled token's logprob and, when asked, the most likely tokens' (token id -> logprob)."""

    logprob: float
    top: dict[int, float] = Field(default_factory=dict)
    rank: int | None = None
    """The token's rank over the whole vocabulary (1: the most likely); None where the engine
    does not say."""


class GenerateDelta(BaseModel):
    """New output of one sequence since the last delta."""

    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprobs] = Field(default_factory=list)
    """One per token of `token_ids` when the request asked for logprobs, else empty."""
    weight_version: int | None = None
    """The version these tokens were sampled with, as far as the engine knows as it streams."""
    weight_versions: list[WeightVersionSpan] | None = None
    """On the last delta only, where the engine reports exact spans over the whole output
    (vLLM): they replace the spans built from each delta's `weight_version`."""
    prompt_token_ids: list[int] | None = None
    """On the first delta where the engine tokenized the prompt itself (else the request's)."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """On the first delta, with `prompt_logprobs` asked: one per prompt token (None for the first)."""
    finish_reason: str | None = None
    """On the last delta: 'stop' (EOS, stop token or stop string), 'length', or 'abort' (the app
    asked to end it early: `Aborts.abort`)."""
    stop_reason: str | int | None = None
    """With finish_reason 'stop': the stop string or stop token id that matched (None: EOS)."""


class SpanBuilder:
    """Weight-version spans over a choice's output tokens, from deltas as they arrive."""

    def __init__(self) -> None:
        self.spans: list[WeightVersionSpan] = []
        self.tokens = 0

    def add(self, count: int, version: int) -> None:
        if count <= 0:
            return
        last = self.spans[-1] if self.spans else None
        if last is not None and last.version == version and last.end == self.tokens:
            last.end += count
        else:
            self.spans.append(WeightVersionSpan(version=version, start=self.tokens, end=self.tokens + count))
        self.tokens += count

    def replace(self, spans: list[WeightVersionSpan]) -> None:
        """The engine's exact spans for the whole output."""
        self.spans = [s.model_copy() for s in spans]


def check_fits(context_length: int | None, prompt_tokens: int, max_tokens: int) -> None:
    """ValueError (a 422 for the caller) when a prompt leaves no room for max_tokens in the
    engine's context (`context_length` None: unknown, not checked)."""
    if context_length is not None and prompt_tokens + max_tokens > context_length:
        raise ValueError(
            f"the prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}: together over the "
            f"model's context of {context_length} tokens; shorten the prompt or lower max_tokens"
        )


def room_left(context_length: int | None, prompt_tokens: int) -> int:
    """max_tokens for a request that gives none: the rest of the engine's context."""
    if context_length is None:
        raise ValueError("the model's context length is unknown: give max_tokens")
    if prompt_tokens >= context_length:
        raise ValueError(
            f"the prompt has {prompt_tokens} tokens: no room left in the model's context of "
            f"{context_length} tokens; shorten the prompt"
        )
    return context_length - prompt_tokens
