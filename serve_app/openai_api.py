"""The OpenAI routes' wire schema (docs/http_api.md#openai-routes): completions, chat completions,
their streamed chunks, and what this app adds to each choice (token ids, weight-version spans).

Pure pydantic, shared with the trainer-side client. Unknown fields are refused (422 naming the
field), so no sampling field is ever silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field, field_validator, model_validator

from profiling.config import StrictModel
from serve_app.engines.generation import WeightVersionSpan

MIN_TEMPERATURE = 0.01
MAX_CHOICES = 128
"""Most choices (`n`) per prompt."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives per position (`logprobs`, `top_logprobs`, `prompt_logprobs`): vLLM's default
`max_logprobs`, so a request vLLM's server takes is taken here."""
TOKEN_ID_PREFIX = "token_id:"
"""With `return_tokens_as_token_ids`, a logprob's token is written `token_id:<id>` (vLLM's)."""
MAX_STOP_STRINGS = 16
MAX_CACHE_SALT_CHARS = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
"""Characters vLLM 0.33 refuses in a `cache_salt` (it keys cache backends with it)."""
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256

FinishReason = Literal["stop", "length", "abort"]
"""`abort`: the request was ended early (`/pause?mode=abort`, `/abort_requests`), with the tokens
sampled so far (vLLM's)."""


class StreamOptions(StrictModel):
    include_usage: bool = False
    """A last chunk, with no choices, carries the request's `usage`."""


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


def _salt_as_vllm_takes_it(salt: str) -> str:
    if any(c in CACHE_SALT_FORBIDDEN for c in salt):
        raise ValueError("cache_salt must not contain '@', '/', '\\' or NUL (vLLM's rule)")
    return salt


CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS), AfterValidator(_salt_as_vllm_takes_it)]


class SamplingFields(StrictModel):
    """The sampling fields completions and chat completions share (OpenAI's, plus vLLM's
    extensions `top_k`, `min_p`, `stop_token_ids`, `ignore_eos`, `min_tokens`,
    `repetition_penalty`, `include_stop_str_in_output`)."""

    model: str | None = None
    """The served model's name (`/v1/models`); null: the served model."""
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    """Choices per prompt, sampled independently (a GRPO group); each has its own seed."""
    temperature: float = Field(1.0, ge=0.0, le=10.0, allow_inf_nan=False)
    """0: greedy; otherwise at least 0.01 (smaller overflows)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p."""
    top_k: int = Field(0, ge=-1)
    """Only the k most likely tokens; 0 or -1: no cut."""
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    """Drop tokens less likely than min_p times the most likely one."""
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    """Choice i of prompt j samples with seed + j * n + i: a request repeated with its seed
    repeats its answers."""
    stop: StopString | list[StopString] | None = Field(None, max_length=MAX_STOP_STRINGS)
    """Stop strings: a choice ends when its text contains one (cut from the text unless
    include_stop_str_in_output); its token ids keep the tokens that made it."""
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    """Tokens that end a choice besides EOS (kept in its token ids)."""
    ignore_eos: bool = False
    """Keep generating past EOS, up to max_tokens."""
    min_tokens: int = Field(0, ge=0)
    """No EOS, stop token or stop string ends a choice before this many tokens."""
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0, allow_inf_nan=False)
    """> 1 discourages tokens already in the prompt or output (multiplicative)."""
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    """Subtracted once from the logit of every token already in the choice's output."""
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    """Subtracted from a token's logit once per time it occurs in the choice's output."""
    include_stop_str_in_output: bool = False
    """Keep a matched stop string at the end of the text."""
    stream: bool = False
    """Server-sent events: `data: {chunk}` lines, then `data: [DONE]`."""
    stream_options: StreamOptions | None = None
    """With stream: `include_usage` adds a last chunk carrying `usage`."""
    request_id: str | None = Field(None, min_length=1, max_length=256)
    """The request's id, as vLLM's: the answer's `id` is `cmpl-<request_id>` (chat:
    `chatcmpl-<request_id>`), by which `/abort_requests` ends it (docs/http_api.md#request-ids);
    null: a random one."""
    user: str | None = Field(None, max_length=256)
    """The end user, as the caller names it: accepted (OpenAI clients send it), changes nothing."""
    return_token_ids: bool | None = None
    """vLLM's switch for `token_ids` and `prompt_token_ids` in the answer: this app always returns
    them, so either value is accepted and changes nothing."""
    return_tokens_as_token_ids: bool | None = None
    """Write each logprob's token as `token_id:<id>` instead of its text (vLLM's): exact where a
    token is not valid text on its own (part of a multi-byte character). Null: no."""
    return_weight_versions: bool | None = None
    """vLLM's switch for each choice's `weight_versions`: this app always returns them; true
    writes each span's `version` as vLLM labels it (a string: "default" for the weights the
    engine started with, "k" for version k) instead of this app's integer."""
    cache_salt: CacheSalt | None = None
    """Only requests with the same salt share prefix-cache blocks (vLLM's and SGLang's); the
    embedded engine shares no KV between requests, so there it changes nothing. vLLM's rules:
    at most 128 characters, none of `@`, `/`, `\\` or NUL."""

    @field_validator("temperature")
    @classmethod
    def _sampleable(cls, t: float) -> float:
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}")
        return t

    @model_validator(mode="after")
    def _consistent(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        limit = self.output_limit()
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens {self.min_tokens} is over max_tokens {limit}")
        return self

    def output_limit(self) -> int | None:
        """The request's max output tokens (None: the rest of the model's context)."""
        raise NotImplementedError

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    """A text, a list of texts, a list of token ids, or a list of token-id lists."""
    max_tokens: int = Field(16, ge=1)
    """Output tokens per choice; prompt + max_tokens must fit the model's context."""
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """The sampled token's logprob, plus the `logprobs` most likely tokens' (OpenAI's shape; each
    position's `top_logprobs` also holds the sampled token, as vLLM's do)."""
    echo: bool = False
    """Prepend the prompt to each choice's text (and, with logprobs, its tokens' logprobs)."""
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """Each prompt token's logprob and rank, plus the `prompt_logprobs` most likely tokens', in
    each choice's `prompt_logprobs` (vLLM's shape). Not with `stream` (vLLM's rule)."""

    @field_validator("prompt")
    @classmethod
    def _no_empty(cls, prompt: str | list[str] | list[int] | list[list[int]]) -> object:
        if isinstance(prompt, list) and any(isinstance(p, list) and not p for p in prompt):
            raise ValueError("a token-id prompt must not be empty")
        return prompt

    @model_validator(mode="after")
    def _prompt_logprobs_unstreamed(self) -> CompletionRequest:
        if self.prompt_logprobs and self.stream:
            raise ValueError("prompt_logprobs are not available with stream: true; ask without streaming")
        return self

    def output_limit(self) -> int | None:
        return self.max_tokens

    def wants_prompt_logprobs(self) -> int | None:
        """How many alternatives each prompt position needs: `prompt_logprobs`, else `logprobs`
        when the prompt is echoed (vLLM's rule), else None."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str] | list[list[int]]:
        """The request's prompts, each a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]
        return p


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        c = self.content
        if c is None:
            return ""
        return c if isinstance(c, str) else "".join(p.text for p in c)


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`: the messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    """The conversation, rendered with the model's chat template (its token ids come back as
    each choice's `prompt_token_ids`)."""
    max_tokens: int | None = Field(None, ge=1)
    """Output tokens per choice; null: the rest of the model's context."""
    max_completion_tokens: int | None = Field(None, ge=1)
    """OpenAI's newer name for max_tokens; give one of them."""
    logprobs: bool = False
    """Each output token's logprob (OpenAI's chat shape: `logprobs.content`)."""
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """With logprobs: the most likely tokens' logprobs at each position."""
    add_generation_prompt: bool = True
    """End the rendered prompt with the assistant turn's opening (vLLM's extension)."""
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """Each token of the rendered conversation with its logprob and rank, plus the
    `prompt_logprobs` most likely tokens', in the answer's `prompt_logprobs` (vLLM's shape and
    place). Not with `stream` (vLLM's rule)."""

    @model_validator(mode="after")
    def _one_limit(self) -> ChatCompletionRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available with stream: true; ask without streaming")
        return self

    def wants_prompt_logprobs(self) -> int | None:
        """How many alternatives each prompt position needs (None: no prompt logprobs)."""
        return self.prompt_logprobs

    def output_limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens


# -- responses -------------------------------------------------------------------------------


class CompletionLogprobs(BaseModel):
    """OpenAI's completion logprobs: per token its text, logprob, top alternatives and offset."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]


class ChoiceTokens(BaseModel):
    """What this app adds to every choice: the tokens a trainer computes its loss on."""

    token_ids: list[int]
    """Output token ids (with the tokens of a matched stop string)."""
    prompt_token_ids: list[int]
    weight_version: int
    """The oldest weight version that produced a token of this choice."""
    weight_versions: list[WeightVersionSpan]
    """Contiguous spans over `token_ids` with the version that sampled them."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the choice (null: EOS or length)."""


class PromptLogprob(BaseModel):
    """One token at one prompt position (vLLM's `Logprob`)."""

    logprob: float
    rank: int | None = None
    """1: the most likely token at that position; null where the engine does not say."""
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""Per prompt position (null for the first): the prompt's token and the most likely ones, keyed
by token id (vLLM's `prompt_logprobs`)."""


class CompletionChoice(ChoiceTokens):
    index: int
    text: str
    finish_reason: FinishReason
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    """With `prompt_logprobs` asked."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    weight_version: int
    """The oldest weight version over all choices."""


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(ChoiceTokens):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude=True)
    """Carried to the ingress, which puts it at the top of the answer, where vLLM's chat does."""


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    weight_version: int
    prompt_token_ids: list[int] | None = None
    """The rendered conversation's token ids, where vLLM puts them (each choice has them too;
    null from an app that predates them)."""
    prompt_logprobs: PromptLogprobs | None = None
    """With `prompt_logprobs` asked: vLLM's shape, per position of the rendered conversation."""


# -- streamed chunks ---------------------------------------------------------------------------


class ChunkTokens(BaseModel):
    """What this app adds to every streamed choice delta."""

    token_ids: list[int]
    """The output token ids of this delta."""
    prompt_token_ids: list[int] | None = None
    """On a choice's first delta."""
    weight_version: int | None = None
    """The version that sampled this delta's tokens, as the replica saw it streaming (null: no
    tokens); the choice's last delta carries its exact spans."""
    weight_versions: list[WeightVersionSpan] | None = None
    """On a choice's last delta: the spans over all its tokens (as in the full answer)."""
    stop_reason: str | int | None = None


class CompletionChunkChoice(ChunkTokens):
    index: int
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(ChunkTokens):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rollout-profiler"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
