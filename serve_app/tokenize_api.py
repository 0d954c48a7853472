"""The wire schema of vLLM's /tokenize and /detokenize, with vLLM 0.33's shapes
(docs/http_api.md#vllm-routes): the served model's own tokenizer, as generation uses it, so a
client that tokenizes here and sends token ids gets the prompt it meant.

Pure pydantic; unknown fields are refused (422 naming the field), as on the OpenAI routes.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, field_validator

from profiling.config import StrictModel
from serve_app.openai_api import ChatMessage

MAX_DETOKENIZE_TOKENS = 1 << 20
"""Most token ids one /detokenize takes."""


class TokenizeCompletionRequest(StrictModel):
    """`POST /tokenize` of a text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    """Add the tokenizer's special tokens (e.g. BOS), as a completion's prompt gets them."""
    return_token_strs: bool | None = False
    """Also return each token's vocabulary string."""


class TokenizeChatRequest(StrictModel):
    """`POST /tokenize` of a conversation, rendered with the model's chat template as
    `/v1/chat/completions` renders it."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    """End with the assistant turn's opening."""
    add_special_tokens: bool = False
    """Only false: the chat template adds the model's special tokens itself."""
    return_token_strs: bool | None = False

    @field_validator("add_special_tokens")
    @classmethod
    def _template_adds_them(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "add_special_tokens: true is not taken for a chat here: the chat template adds the model's "
                "special tokens, as /v1/chat/completions renders it; leave it false"
            )
        return value


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest
"""A text prompt (`prompt`) or a conversation (`messages`)."""


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    """The model's context length (null: the engine does not say)."""
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictModel):
    """`POST /detokenize`: token ids back to text, special tokens kept (vLLM's)."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=2**63 - 1)]] = Field(max_length=MAX_DETOKENIZE_TOKENS)


class DetokenizeResponse(BaseModel):
    prompt: str
