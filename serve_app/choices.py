"""One prompt's choices, from the engine's deltas to OpenAI's shapes (docs/http_api.md#openai-routes).

The ingress sends each prompt of a request to one replica as a `PromptJob`; the replica turns
the request into a `SamplingSpec` per choice (`sampling_for`), runs the `n` sequences, and a
`ChoiceBuilder` per choice assembles what the engine streams: token ids, logprobs, weight-version
spans, and the text (decoded here for every engine, cut at a matched stop string).
"""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel, Field

from serve_app.engines.generation import GenerateDelta, SamplingSpec, SpanBuilder, TokenLogprobs
from serve_app.openai_api import (
    TOKEN_ID_PREFIX,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunkChoice,
    CompletionLogprobs,
    CompletionRequest,
    FinishReason,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)

LOWEST_LOGPROB = -9999.0
"""What a logprob of -inf is written as (vLLM's, and OpenAI's): JSON has no infinity."""

OpenAIRequest = CompletionRequest | ChatCompletionRequest


class Tokenizer(Protocol):
    """What a ChoiceBuilder needs of the engine's tokenizer (serve_app/engines/tokenizer.py)."""

    def detokenize(self, token_ids: list[int]) -> str: ...

    def token_strings(self, token_ids: list[int]) -> list[str]: ...


class PromptJob(BaseModel):
    """One prompt of a request and its `n` choices, run by one replica."""

    request: CompletionRequest | ChatCompletionRequest
    prompt_index: int
    prompt: str | list[int] | None = None
    """A completions prompt (text or token ids); None for chat (the request's messages)."""
    names: list[str] = Field(default_factory=list)
    """The ids `/abort_requests` finds this prompt's choices by: the answer's `id`, and the request
    id vLLM's server gives the prompt (docs/http_api.md#request-ids)."""


class JobAccepted(BaseModel):
    """A streamed job's first item: its prompt fits and its sequences are queued."""

    prompt_tokens: int


class JobDone(BaseModel):
    """A streamed job's last item."""

    completion_tokens: int


class JobResult(BaseModel):
    choices: list[CompletionChoice] | list[ChatChoice]
    prompt_tokens: int
    completion_tokens: int


def choice_index(request: OpenAIRequest, prompt_index: int, i: int) -> int:
    """OpenAI's numbering: choices of prompt j are j*n ... j*n + n-1."""
    return prompt_index * request.n + i


def sampling_for(request: OpenAIRequest, prompt_index: int, i: int, max_tokens: int) -> SamplingSpec:
    """The engine-neutral sampling of choice `i` of prompt `prompt_index`."""
    if isinstance(request, CompletionRequest):
        logprobs = request.logprobs
    else:
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    prompt_logprobs = request.wants_prompt_logprobs()
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=max(request.top_k, 0),
        min_p=request.min_p,
        seed=None if request.seed is None else request.seed + choice_index(request, prompt_index, i),
        stop=request.stop_strings(),
        stop_token_ids=list(request.stop_token_ids or []),
        ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens,
        repetition_penalty=request.repetition_penalty,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=request.include_stop_str_in_output,
    )


class ChoiceBuilder:
    """One choice: fed the engine's deltas, it yields stream pieces and the final choice."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        request: OpenAIRequest,
        index: int,
        prompt_ids: list[int],
        prompt_text: str | None,
        fallback_version: int,
    ):
        """`prompt_text`: the completions prompt as text (for echo); `fallback_version`: the
        replica's weight version, for a delta whose engine does not say."""
        self._tok = tokenizer
        self._request = request
        self._as_ids = bool(request.return_tokens_as_token_ids)
        self._chat = isinstance(request, ChatCompletionRequest)
        self.index = index
        self.prompt_ids = prompt_ids
        self._stops = request.stop_strings()
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self._echo = ""
        if isinstance(request, CompletionRequest) and request.echo:
            self._echo = prompt_text if prompt_text is not None else self._tok.detokenize(prompt_ids)
        self._fallback = fallback_version
        self.token_ids: list[int] = []
        self._logprobs: list[TokenLogprobs] = []
        self._prompt_logprobs: list[TokenLogprobs | None] | None = None
        self._spans = SpanBuilder()
        self._emitted = 0
        self._offset = 0
        self._started = False
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    # -- input -----------------------------------------------------------------------------
    def feed(self, delta: GenerateDelta) -> None:
        if delta.prompt_token_ids is not None:
            self.prompt_ids = delta.prompt_token_ids
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs = delta.prompt_logprobs
        self.token_ids.extend(delta.token_ids)
        self._logprobs.extend(delta.logprobs)
        self._spans.add(len(delta.token_ids), self._version_of(delta))
        if delta.weight_versions is not None:
            self._spans.replace(delta.weight_versions)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    # -- output ----------------------------------------------------------------------------
    def text(self) -> str:
        """The output text: decoded, cut at the matched stop string (unless kept)."""
        full = self._tok.detokenize(self.token_ids)
        if isinstance(self.stop_reason, str) and (at := full.find(self.stop_reason)) >= 0:
            return full[: at + len(self.stop_reason)] if self._request.include_stop_str_in_output else full[:at]
        return full

    def choice(self) -> CompletionChoice | ChatChoice:
        """The finished choice, as the full (not streamed) answer carries it."""
        assert self.finish_reason is not None, "a choice is built once its sequence finished"
        tokens = {
            "token_ids": self.token_ids,
            "prompt_token_ids": self.prompt_ids,
            "weight_version": min((s.version for s in self._spans.spans), default=self._fallback),
            "weight_versions": self._spans.spans,
            "stop_reason": self.stop_reason,
        }
        finish = self._wire_finish()
        if self._chat:
            return ChatChoice(
                index=self.index,
                message=AssistantMessage(content=self.text()),
                finish_reason=finish,
                logprobs=self._chat_logprobs(self.token_ids, self._logprobs),
                prompt_logprobs=self._prompt_logprobs_out(),
                **tokens,
            )
        return CompletionChoice(
            index=self.index,
            text=self._echo + self.text(),
            finish_reason=finish,
            logprobs=self._completion_logprobs(self.token_ids, self._logprobs, echo=True),
            prompt_logprobs=self._prompt_logprobs_out(),
            **tokens,
        )

    def piece(self, delta: GenerateDelta) -> CompletionChunkChoice | ChatChunkChoice | None:
        """Feed `delta` and return the stream piece it makes (None: nothing to send yet)."""
        self.feed(delta)
        first = not self._started
        if self.finished:
            text = self.text()
            new_text = text[self._emitted :]
            self._emitted = len(text)
        else:
            full = self._tok.detokenize(self.token_ids)
            # Hold back what may be the start of a stop string, or half of a multi-byte character.
            safe = len(full) - self._holdback
            while safe > self._emitted and full[safe - 1] == "\ufffd":
                safe -= 1
            new_text = full[self._emitted : safe] if safe > self._emitted else ""
            self._emitted = max(self._emitted, safe)
        if not (first or new_text or delta.token_ids or self.finished):
            return None
        self._started = True
        tokens = {
            "token_ids": delta.token_ids,
            "prompt_token_ids": self.prompt_ids if first else None,
            "weight_version": self._version_of(delta) if delta.token_ids else None,
            "weight_versions": self._spans.spans if self.finished else None,
            "stop_reason": self.stop_reason if self.finished else None,
        }
        finish = self._wire_finish() if self.finished else None
        if self._chat:
            return ChatChunkChoice(
                index=self.index,
                delta=ChatDelta(role="assistant" if first else None, content=new_text if new_text or first else None),
                finish_reason=finish,
                logprobs=self._chat_logprobs(delta.token_ids, delta.logprobs) if delta.token_ids else None,
                **tokens,
            )
        prefix = self._echo if first else ""
        return CompletionChunkChoice(
            index=self.index,
            text=prefix + new_text,
            finish_reason=finish,
            logprobs=self._completion_logprobs(delta.token_ids, delta.logprobs, echo=first),
            **tokens,
        )

    def _version_of(self, delta: GenerateDelta) -> int:
        """The version that sampled `delta`'s tokens (the replica's, where the engine does not say)."""
        return delta.weight_version if delta.weight_version is not None else self._fallback

    def _wire_finish(self) -> FinishReason:
        return "stop" if self.finish_reason == "stop" else "abort" if self.finish_reason == "abort" else "length"

    # -- logprobs --------------------------------------------------------------------------
    def _completion_logprobs(
        self, ids: list[int], logprobs: list[TokenLogprobs], *, echo: bool
    ) -> CompletionLogprobs | None:
        if not isinstance(self._request, CompletionRequest) or self._request.logprobs is None:
            return None
        all_ids: list[int] = []
        all_lps: list[TokenLogprobs | None] = []
        if echo and self._echo and self._prompt_logprobs is not None:
            all_ids += self.prompt_ids
            all_lps += self._prompt_logprobs
        all_ids += ids
        all_lps += logprobs
        strings = self._strings(all_ids)
        offsets = []
        for s in strings:
            offsets.append(self._offset)
            self._offset += len(s)
        return CompletionLogprobs(
            tokens=strings,
            token_logprobs=[None if lp is None else _finite(lp.logprob) for lp in all_lps],
            top_logprobs=[
                None if lp is None else self._top(token, lp) for token, lp in zip(all_ids, all_lps, strict=True)
            ],
            text_offset=offsets,
        )

    def _top(self, token_id: int, lp: TokenLogprobs) -> dict[str, float]:
        """The position's token and its `logprobs` most likely alternatives (vLLM's: the sampled
        token is always there, so `logprobs: 0` answers it alone)."""
        pairs = _own_first(token_id, lp)
        strings = self._strings([t for t, _ in pairs])
        return {s: _finite(v) for s, (_, v) in zip(strings, pairs, strict=True)}

    def _prompt_logprobs_out(self) -> PromptLogprobs | None:
        """vLLM's `prompt_logprobs`: per prompt position its token (with its rank) and the most
        likely ones (ranks 1, 2, ...), keyed by token id; null for the first position."""
        if self._request.prompt_logprobs is None:
            return None
        if self._prompt_logprobs is None:
            return None
        out: PromptLogprobs = []
        for token_id, lp in zip(self.prompt_ids, self._prompt_logprobs, strict=True):
            if lp is None:
                out.append(None)
                continue
            pairs = _own_first(token_id, lp)
            ranks: dict[int, int | None] = {t: r for r, t in enumerate(lp.top, start=1)}
            ranks[token_id] = lp.rank if lp.rank is not None else ranks.get(token_id)
            strings = self._strings([t for t, _ in pairs])
            out.append(
                {
                    str(t): PromptLogprob(logprob=_finite(v), rank=ranks.get(t), decoded_token=s)
                    for s, (t, v) in zip(strings, pairs, strict=True)
                }
            )
        return out

    def _strings(self, token_ids: list[int]) -> list[str]:
        """Each token as the answer writes it: its text, or `token_id:<id>` when asked."""
        if self._as_ids:
            return [f"{TOKEN_ID_PREFIX}{t}" for t in token_ids]
        return self._tok.token_strings(token_ids)

    def _chat_logprobs(self, ids: list[int], logprobs: list[TokenLogprobs]) -> ChatLogprobs | None:
        if not isinstance(self._request, ChatCompletionRequest) or not self._request.logprobs:
            return None
        content = []
        for s, lp in zip(self._strings(ids), logprobs, strict=True):
            top_ids = list(lp.top)
            tops = [
                TopLogprob(token=t, logprob=_finite(v), bytes=list(t.encode()))
                for t, v in zip(self._strings(top_ids), lp.top.values(), strict=True)
            ]
            content.append(
                TokenLogprob(token=s, logprob=_finite(lp.logprob), bytes=list(s.encode()), top_logprobs=tops)
            )
        return ChatLogprobs(content=content)


def _own_first(token_id: int, lp: TokenLogprobs) -> list[tuple[int, float]]:
    """(token id, logprob) at one position: its own token (sampled, or the prompt's), then each
    alternative of `lp.top` other than it."""
    return [(token_id, lp.logprob), *((t, v) for t, v in lp.top.items() if t != token_id)]


def _finite(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)
