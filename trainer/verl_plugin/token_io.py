"""verl's token-in, token-out call as the app's `/inference/v1/generate`, and its answer back
(docs/frameworks/verl.md#generation).

verl's agent loops call `server.generate(request_id, prompt_ids, sampling_params, ...)` on a
rollout server and read a `TokenOutput`: the sampled token ids, their logprobs when asked
(`logprobs: true`), `stop_reason` (`completed`, or `aborted` for a request a sync cut short, which
verl's fully-async client sends again with the tokens so far) and `extra_fields.global_steps`, the
weight version that sampled them. This module does what verl's own vLLM server does with the
sampling parameters (vllm_async_server.py, `vLLMHttpServer.generate`): the default and the clamp
of `max_tokens`, `logprobs` as a boolean, the config's repetition penalty, `ignore_eos` and, with
`full_determinism`, a seed per replica; and reads the version from the app's per-token version
spans. Pure: no verl import, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from profiling.config import describe_validation_error
from serve_app.generate_api import GenerateRequest, GenerateResponse, version_of_label

ABORTED = "aborted"
"""verl's stop reason of a request a sync ended early (verl resends it with the tokens so far)."""
COMPLETED = "completed"
"""verl's stop reason of a request that stopped or reached its length."""
_MAX_TOKENS_KEYS = ("max_tokens", "max_new_tokens")
"""verl's name for the length limit, and SGLang's, which verl's vLLM server takes too."""


class UnsupportedRequest(ValueError):
    """A generate call the app cannot serve as verl asked it; the message names the argument."""


@dataclass(frozen=True)
class RolloutLimits:
    """What verl's rollout config says about a request's length and sampling defaults (its
    `actor_rollout_ref.rollout` keys of the same names)."""

    prompt_length: int
    response_length: int
    max_model_len: int | None
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    seed: int | None = None
    """The request seed under `full_determinism` (verl's `replica_rank + seed`); None: unseeded."""

    @property
    def context_length(self) -> int:
        """The longest prompt plus answer: `max_model_len`, else prompt plus response length (the
        value verl's vLLM server gives the engine)."""
        return self.max_model_len or self.prompt_length + self.response_length


def generate_request(
    request_id: str, prompt_ids: list[int], sampling_params: Mapping[str, Any], limits: RolloutLimits
) -> GenerateRequest:
    """The app's request for verl's call; UnsupportedRequest naming what the app cannot take."""
    params = dict(sampling_params)
    room = limits.context_length - len(prompt_ids)
    if room < 1:
        raise UnsupportedRequest(
            f"prompt length ({len(prompt_ids)}) leaves no room to generate within the context length "
            f"({limits.context_length}, actor_rollout_ref.rollout.max_model_len or prompt_length + "
            "response_length): shorten the prompt or raise max_model_len"
        )
    given = [k for k in _MAX_TOKENS_KEYS if k in params]
    if given:
        max_tokens = params.pop(given[0])
        for other in given[1:]:
            params.pop(other)
    else:
        max_tokens = min(limits.response_length, limits.prompt_length + limits.response_length - len(prompt_ids))
    params["max_tokens"] = max(1, min(int(max_tokens), room))
    params["logprobs"] = 0 if params.pop("logprobs", False) else None
    params.setdefault("repetition_penalty", limits.repetition_penalty)
    params.setdefault("ignore_eos", limits.ignore_eos)
    if limits.seed is not None:
        params.setdefault("seed", limits.seed)
    try:
        return GenerateRequest(request_id=request_id, token_ids=list(prompt_ids), sampling_params=params)
    except ValidationError as e:
        raise UnsupportedRequest(
            f"the app cannot serve this generate call as verl asked it: {describe_validation_error(e)} "
            "(the app takes vLLM's sampling parameters it honours: docs/http_api.md#vllm-routes)"
        ) from None


def token_output_fields(answer: GenerateResponse, *, logprobs: bool, served_version: int) -> dict[str, Any]:
    """verl's `TokenOutput` fields for the app's answer to one prompt. `served_version`: the
    version to report for an answer without tokens (a request aborted before its first one)."""
    choice = answer.choices[0]
    token_ids = list(choice.token_ids or [])
    versions = [v for s in choice.weight_versions or [] if (v := version_of_label(s.version)) is not None]
    newest = versions[-1] if versions else served_version
    content = choice.logprobs.content if choice.logprobs is not None else None
    return {
        "token_ids": token_ids,
        "log_probs": [c.logprob for c in content or []] if logprobs else None,
        "stop_reason": _stop_reason(choice.finish_reason),
        "extra_fields": {
            "global_steps": newest,
            "min_global_steps": min(versions, default=newest),
            "max_global_steps": newest,
        },
    }


def aborted_fields(served_version: int) -> dict[str, Any]:
    """verl's `TokenOutput` fields for a request refused at the closed gate (verl's
    `reject_request`): no tokens, `aborted`, so verl routes it elsewhere or sends it again."""
    return {
        "token_ids": [],
        "log_probs": None,
        "stop_reason": ABORTED,
        "extra_fields": {"global_steps": served_version},
    }


def _stop_reason(finish_reason: str | None) -> str | None:
    # verl's vLLM server: abort -> aborted, stop and length -> completed, anything else as is.
    if finish_reason == "abort":
        return ABORTED
    if finish_reason in ("stop", "length"):
        return COMPLETED
    return finish_reason
