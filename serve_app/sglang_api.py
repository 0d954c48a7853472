"""The wire schema of SGLang 0.5.23's native routes that RL frameworks' clients call (AReaL's
`RemoteSGLangEngine`, slime's `SGLangEngine`; docs/http_api.md#sglang-routes), and their mapping
onto the app's own contract.

`/generate` is a completion (`SglangGenerateRequest.completion`): the same sampling, admission and
weight-version spans as `/v1/completions`, answered in SGLang's shape (`sglang_results`). The
weight-update and pause bodies map onto `/weights/update` and the client pause. SGLang labels
weight versions with strings, as vLLM does (`version_label`: "default" for version 0).

Pure pydantic; unknown fields are refused (422 naming the field), and so are SGLang's fields the
app cannot honour, each with why and what to do instead.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from profiling.config import StrictModel
from serve_app.api import ClientPauseMode, UpdateWeightsResponse
from serve_app.choices import LOWEST_LOGPROB
from serve_app.generate_api import version_label, version_of_label
from serve_app.openai_api import (
    MAX_CHOICES,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    MIN_TEMPERATURE,
    TOKEN_ID_PREFIX,
    CacheSalt,
    CompletionChoice,
    CompletionRequest,
    StopString,
)

GREEDY_BELOW = 1e-6
"""SGLang samples greedily below this temperature (its `_SAMPLING_EPS`)."""
MAX_STOP_STRINGS = 16
PAUSED_TEXT = "Generation paused successfully."
CONTINUED_TEXT = "Generation continued successfully."
LOADED_TEXT = "Succeeded to update model weights."
FLUSHED_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
NOT_FLUSHED_TEXT = "Flush cache failed.\n"
GROUP_JOINED_TEXT = "Succeeded to initialize custom process group."
GROUP_LEFT_TEXT = "Succeeded to destroy custom process group."
CHUNK_LOADED_TEXT = "Succeeded to update parameter online."
SESSION_TEXT = "Success"

_UNSET: tuple[Any, ...] = (None, False, [], {})
"""What SGLang reads as a field left unset: such a field is accepted and changes nothing."""

_UNSERVED_SAMPLING = {
    "custom_params": "custom logit processors are not served here; drop it (slime sends it, for "
    "return_top_p_token_ids, whenever top_p is not 1)",
    "json_schema": "structured output is not served here",
    "regex": "structured output is not served here",
    "ebnf": "structured output is not served here",
    "structural_tag": "structured output is not served here",
    "stop_regex": "stop on strings (`stop`) or on token ids (`stop_token_ids`)",
    "logit_bias": "logit biases are not served here",
    "beam_width": "beam search is not served here",
    "stream_interval": "this route does not stream; stream through /v1/completions",
    "watermark": "watermarking is not served here",
}
"""SGLang's sampling parameters the app cannot honour, each with why (422 naming it when set)."""

_UNSERVED_REQUEST = {
    "input_embeds": "give token ids (`input_ids`) or `text`",
    "image_data": "the app serves text models: give `input_ids` or `text`",
    "video_data": "the app serves text models: give `input_ids` or `text`",
    "audio_data": "the app serves text models: give `input_ids` or `text`",
    "modalities": "the app serves text models: give `input_ids` or `text`",
    "lora_path": "LoRA adapters are not served here: publish merged weights through /update_weights_from_disk",
    "custom_logit_processor": "custom logit processors are not served here",
    "token_ids_logprob": "ask for the most likely tokens with top_logprobs_num",
    "return_hidden_states": "hidden states are not returned here",
    "return_routed_experts": "routed experts are not returned here",
    "return_entropy": "entropies are not returned here",
    "session_params": "sessions are not served here",
    "data_parallel_rank": "the app's load balancer picks the replica",
    "routed_dp_rank": "the app's load balancer picks the replica",
    "bootstrap_host": "disaggregated prefill is not served here",
    "bootstrap_port": "disaggregated prefill is not served here",
    "bootstrap_room": "disaggregated prefill is not served here",
    "priority": "the app's engines schedule first come, first served",
    "extra_key": "give `cache_salt` to keep requests' prefix-cache blocks apart",
}
"""SGLang's `/generate` fields the app cannot honour, each with why (422 naming it when set)."""


def _refuse_unserved(data: Any, unserved: dict[str, str]) -> Any:
    """`data` without the fields of `unserved` that are unset; ValueError naming each one set."""
    if not isinstance(data, dict):
        return data
    problems = [f"{k}: {unserved[k]}" for k, v in data.items() if k in unserved and not _is_unset(v)]
    if problems:
        raise ValueError("; ".join(problems))
    return {k: v for k, v in data.items() if k not in unserved}


def _is_unset(value: Any) -> bool:
    return any(value is u or (type(value) is type(u) and value == u) for u in _UNSET)


class SglangSamplingParams(StrictModel):
    """SGLang's `sampling_params` the app honours, with SGLang's defaults, each as the app's
    completions honour its vLLM counterpart (named in its description)."""

    max_new_tokens: int = Field(128, ge=1)
    """Output tokens per choice (`max_tokens`; SGLang's null, the rest of the context, is not taken)."""
    min_new_tokens: int = Field(0, ge=0)
    """No EOS, stop token or stop string ends a choice before this many tokens (`min_tokens`)."""
    temperature: float = Field(1.0, ge=0.0, le=10.0, allow_inf_nan=False)
    """Below 1e-6: greedy (SGLang's rule); otherwise at least 0.01."""
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(-1, ge=-1)
    """-1 (or 0): the whole vocabulary."""
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0, allow_inf_nan=False)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    """Choices per prompt; with n > 1 the answer is a list, prompt by prompt (SGLang's order)."""
    stop: StopString | list[StopString] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    """Tokens that end a choice besides EOS (kept in `output_ids`)."""
    ignore_eos: bool = False
    skip_special_tokens: Literal[True] = True
    """Only true: `text` is decoded without special tokens (decode `output_ids` to keep them)."""
    spaces_between_special_tokens: bool = True
    """Accepted either way: `text` holds no special tokens to space."""
    no_stop_trim: bool = False
    """Keep a matched stop string at the end of `text` (`include_stop_str_in_output`)."""
    sampling_seed: int | None = Field(None, ge=0, le=2**63 - 1)
    """As `seed` on /v1/completions: choice i of prompt j samples with sampling_seed + j * n + i."""

    @model_validator(mode="before")
    @classmethod
    def _served(cls, data: Any) -> Any:
        return _refuse_unserved(data, _UNSERVED_SAMPLING)

    @field_validator("temperature")
    @classmethod
    def _sampleable(cls, t: float) -> float:
        if GREEDY_BELOW <= t < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be below {GREEDY_BELOW:g} (greedy) or at least {MIN_TEMPERATURE}")
        return 0.0 if t < GREEDY_BELOW else t

    @model_validator(mode="after")
    def _bounded(self) -> SglangSamplingParams:
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens {self.min_new_tokens} is over max_new_tokens {self.max_new_tokens}")
        return self


class SglangGenerateRequest(StrictModel):
    """`POST /generate`: one prompt, or a batch, as token ids (`input_ids`) or text (`text`)."""

    text: str | list[str] | None = Field(None, min_length=1)
    input_ids: list[int] | list[list[int]] | None = Field(None, min_length=1)
    sampling_params: SglangSamplingParams | None = None
    """One for every prompt of a batch."""
    rid: str | list[str] | None = None
    """The answer's `meta_info.id`: one id, or one per prompt of a batch; with a batch or n > 1
    one id is a prefix (`<rid>_<i>`). Default: a fresh id per answer."""
    return_logprob: bool = False
    """Each output token's `[logprob, token_id, null]` in `meta_info.output_token_logprobs`."""
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    """With return_logprob: the most likely tokens at each position (`output_top_logprobs`)."""
    logprob_start_len: int = Field(-1, ge=-1)
    """With return_logprob: the prompt's logprobs from this position on (`input_token_logprobs`,
    null for position 0); -1: none."""
    return_text_in_logprobs: Literal[False] = False
    """Only false: decode the token ids of the logprobs with /detokenize."""
    cache_salt: CacheSalt | None = None
    """Only requests with the same salt share prefix-cache blocks (as on /v1/completions)."""
    stream: Literal[False] = False
    """Only false: stream through /v1/completions."""

    @model_validator(mode="before")
    @classmethod
    def _served(cls, data: Any) -> Any:
        return _refuse_unserved(data, _UNSERVED_REQUEST)

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> SglangGenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give the prompt as `input_ids` or as `text`, one of them")
        ids = [p for p in self.prompts() if isinstance(p, list)]
        if any(not p for p in ids):
            raise ValueError("input_ids: a token-id prompt must not be empty")
        if any(t < 0 for p in ids for t in p):
            raise ValueError("input_ids must not contain negative values")
        if isinstance(self.rid, list) and len(self.rid) != len(self.prompts()):
            raise ValueError(f"rid: {len(self.rid)} ids for {len(self.prompts())} prompts; give one per prompt")
        return self

    @property
    def sampling(self) -> SglangSamplingParams:
        return self.sampling_params or SglangSamplingParams()

    def is_batch(self) -> bool:
        """Whether the answer is a list (SGLang's rule: a batch of prompts, or n > 1)."""
        ids = self.input_ids
        return isinstance(self.text, list) or bool(ids and isinstance(ids[0], list)) or self.sampling.n > 1

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts, each a text or a list of token ids."""
        prompt: Any = self.text if self.text is not None else self.input_ids
        return prompt if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else [prompt]

    def completion(self) -> CompletionRequest:
        """The same generation as a `/v1/completions` request (ValidationError naming the app's
        field where a value passes SGLang's rules but not the app's)."""
        sp = self.sampling
        k = self.top_logprobs_num
        return CompletionRequest(
            prompt=self.prompts(),
            n=sp.n,
            max_tokens=sp.max_new_tokens,
            min_tokens=sp.min_new_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            min_p=sp.min_p,
            seed=sp.sampling_seed,
            stop=sp.stop,
            stop_token_ids=sp.stop_token_ids,
            ignore_eos=sp.ignore_eos,
            repetition_penalty=sp.repetition_penalty,
            presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            include_stop_str_in_output=sp.no_stop_trim,
            logprobs=k if self.return_logprob else None,
            prompt_logprobs=k if self.return_logprob and self.logprob_start_len >= 0 else None,
            cache_salt=self.cache_salt,
            return_tokens_as_token_ids=True,
        )

    def answer_ids(self) -> list[str]:
        """`meta_info.id` of each answer, in the answers' order (prompt j's n choices together)."""
        n, prompts = self.sampling.n, len(self.prompts())
        if not self.is_batch():
            return [self.rid if isinstance(self.rid, str) else self.rid[0] if self.rid else uuid.uuid4().hex]
        if self.rid is None:
            return [uuid.uuid4().hex for _ in range(prompts * n)]
        bases = self.rid if isinstance(self.rid, list) else [f"{self.rid}_{j}" for j in range(prompts)]
        return [base if n == 1 else f"{base}_{i}" for base in bases for i in range(n)]


# -- /generate's answer ----------------------------------------------------------------------


class _Answer(BaseModel):
    """An answer's model: its fields' docstrings are their documentation (the schema's too)."""

    model_config = ConfigDict(use_attribute_docstrings=True)


TokenLogprob = tuple[float | None, int, None]
"""SGLang's `[logprob, token_id, text]`; the text is null (`return_text_in_logprobs` is false)."""


class SglangFinishReason(_Answer):
    """SGLang's finish reason: `stop` with what `matched` (a stop string, or the stop token's id,
    EOS's too), `length` with the `length` reached, or `abort` with a `message`."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None


class SglangVersionSpan(_Answer):
    """Output tokens `[start, end)` were sampled by weights `version` (labelled as SGLang labels them)."""

    version: str
    start: int
    end: int


class SglangMetaInfo(_Answer):
    id: str
    """`rid`, or a fresh id."""
    finish_reason: SglangFinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Always 0: the app does not count prefix-cache hits."""
    weight_version: str
    """The label of the weights that sampled the last token (SGLang's): "default" for the
    weights the engine started with, "<k>" for version k."""
    weight_versions: list[SglangVersionSpan]
    """Spans over the output tokens with the weights that sampled them (the app's spans, labelled)."""
    output_token_logprobs: list[TokenLogprob] | None = None
    """With return_logprob: each output token's `[logprob, token_id, null]`."""
    output_top_logprobs: list[list[TokenLogprob] | None] | None = None
    """With top_logprobs_num k: at each output position the k most likely tokens, most likely first."""
    input_token_logprobs: list[TokenLogprob] | None = None
    """With return_logprob: the prompt's tokens from logprob_start_len on (none for -1), the
    logprob of position 0 null."""
    input_top_logprobs: list[list[TokenLogprob] | None] | None = None
    """With top_logprobs_num and logprob_start_len: the most likely tokens at those prompt
    positions (null for position 0)."""


class SglangGenerateResult(_Answer):
    """One answer of `/generate` (a batch or n > 1: a list of them, prompt by prompt)."""

    text: str
    output_ids: list[int]
    meta_info: SglangMetaInfo


def sglang_results(request: SglangGenerateRequest, choices: list[CompletionChoice]) -> list[SglangGenerateResult]:
    """SGLang's answers from the completion choices of `request.completion()`, in their order."""
    return [_result(request, c, rid) for c, rid in zip(choices, request.answer_ids(), strict=True)]


def _result(request: SglangGenerateRequest, c: CompletionChoice, rid: str) -> SglangGenerateResult:
    spans = [SglangVersionSpan(version=version_label(s.version), start=s.start, end=s.end) for s in c.weight_versions]
    meta = SglangMetaInfo(
        id=rid,
        finish_reason=_finish(c),
        prompt_tokens=len(c.prompt_token_ids),
        completion_tokens=len(c.token_ids),
        weight_version=spans[-1].version if spans else version_label(c.weight_version),
        weight_versions=spans,
    )
    if request.return_logprob and c.logprobs is not None:
        lps = c.logprobs
        pairs = zip(c.token_ids, lps.token_logprobs, strict=True)
        meta.output_token_logprobs = [(LOWEST_LOGPROB if lp is None else lp, t, None) for t, lp in pairs]
        k = request.top_logprobs_num
        if k:
            meta.output_top_logprobs = [_top(top, k) for top in lps.top_logprobs or [None] * len(c.token_ids)]
        meta.input_token_logprobs, meta.input_top_logprobs = _input_logprobs(request, c)
    return SglangGenerateResult(text=c.text, output_ids=c.token_ids, meta_info=meta)


def _finish(c: CompletionChoice) -> SglangFinishReason:
    if c.finish_reason == "length":
        return SglangFinishReason(type="length", length=len(c.token_ids))
    if c.finish_reason == "stop":
        # EOS ends a choice without a stop reason: SGLang names its token as what matched.
        matched = c.stop_reason if c.stop_reason is not None else (c.token_ids[-1] if c.token_ids else None)
        return SglangFinishReason(type="stop", matched=matched)
    return SglangFinishReason(type="abort", message="Aborted")


def _top(top: dict[str, float] | None, k: int) -> list[TokenLogprob] | None:
    """The `k` most likely tokens of a completion position (keyed `token_id:<id>`; the sampled
    token is there too when it is not among them), most likely first."""
    if top is None:
        return None
    ranked = sorted(((v, int(t.removeprefix(TOKEN_ID_PREFIX))) for t, v in top.items()), key=lambda e: -e[0])
    return [(v, t, None) for v, t in ranked[:k]]


def _input_logprobs(
    request: SglangGenerateRequest, c: CompletionChoice
) -> tuple[list[TokenLogprob], list[list[TokenLogprob] | None] | None]:
    """The prompt's logprobs from `logprob_start_len` on (SGLang's: none for -1), and with
    top_logprobs_num its most likely tokens, from the completion's `prompt_logprobs`."""
    start, k = request.logprob_start_len, request.top_logprobs_num
    if start < 0 or c.prompt_logprobs is None:
        return [], ([] if k else None)
    own: list[TokenLogprob] = []
    tops: list[list[TokenLogprob] | None] = []
    for token, position in list(zip(c.prompt_token_ids, c.prompt_logprobs, strict=True))[start:]:
        entry = position.get(str(token)) if position else None
        own.append((None if entry is None else entry.logprob, token, None))
        ranked = sorted((e.rank, e.logprob, int(t)) for t, e in (position or {}).items() if e.rank and e.rank <= k)
        tops.append([(lp, t, None) for _, lp, t in ranked] if position else None)
    return own, (tops if k else None)


# -- weights, pause and the server's state -----------------------------------------------------


class UpdateWeightsFromDisk(StrictModel):
    """`POST /update_weights_from_disk`: publish the checkpoint at `model_path` as the next version."""

    model_path: str = Field(min_length=1)
    """A checkpoint inside the app's weights_dir, as /weights/update's `path` (an HF directory of
    safetensors files, as AReaL and slime write them, is one)."""
    weight_version: str | None = Field(None, min_length=1, max_length=64)
    """The version to publish, as SGLang labels it (slime sends "<k>"); default: the served
    version + 1."""
    load_format: Literal["auto", "safetensors"] | None = None
    """Only safetensors checkpoints are read."""
    abort_all_requests: bool = False
    """End the requests in flight before the load, on an engine that can abort (on one that
    cannot, they go on with the new weights)."""
    flush_cache: Literal[True] = True
    """Only true: every weight switch empties the prefix cache."""
    keep_pause: bool = False
    """Accepted either way: a client's pause lasts until /continue_generation, whatever loads."""
    torch_empty_cache: bool = False
    """Accepted either way: the engines free what a load leaves on their own."""
    recapture_cuda_graph: bool = False
    """Accepted either way: each engine's own load handles its CUDA graphs."""
    is_async: Literal[False] = False
    """Only false: the answer comes once every replica loaded."""
    token_step: int = 0
    """Accepted and not kept: the answers' weight_versions say which weights sampled each token."""

    def version(self, served: int) -> int:
        """The version to publish (ValueError for a label that names no version of the app)."""
        if self.weight_version is None:
            return served + 1
        version = version_of_label(self.weight_version)
        if version is None:
            raise ValueError(
                f'weight_version {self.weight_version!r} names no version of this app: its versions are "default" '
                "(the weights the engine started with) and positive integers"
            )
        return version


class UpdateWeightsFromDiskResponse(_Answer):
    """SGLang's answer: 200 with `success` true, or 400 with `success` false and why."""

    success: bool
    message: str
    num_paused_requests: int = 0
    """Generation requests in flight on the replicas when they loaded (they paused between
    engine steps and went on with the new weights)."""


class SglangResult(_Answer):
    """SGLang's answer of its weight-group routes: 200 with `success` true, or 400 with `success`
    false and why."""

    success: bool
    message: str


class SglangUpdateResult(SglangResult):
    """SGLang's answer to `/end_weight_update`, with the publication of the update's version (as
    `/weights/update` answers it, the app's own schedule's calls included)."""

    update: UpdateWeightsResponse | None = None


class InitWeightsUpdateGroup(StrictModel):
    """`POST /init_weights_update_group` (SGLang's InitWeightsUpdateGroupReqInput)."""

    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    """Where the app's engine workers start in the trainer's group (rank 0 is the trainer's): the
    app stands for one SGLang server whose TP ranks are every replica's in turn, so each replica
    is given its own offset."""
    world_size: int = Field(ge=2)
    group_name: str = Field("weight_update_group", min_length=1)
    backend: str = Field("nccl", min_length=1)
    """The group's backend, as SGLang takes it (gloo on CPU)."""

    @model_validator(mode="after")
    def _rank_in_group(self) -> InitWeightsUpdateGroup:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} is outside a group of world_size {self.world_size}")
        return self

    def engine_body(self) -> dict[str, Any]:
        """The fields each replica's SGLang gets, all but its own rank offset."""
        return self.model_dump(exclude={"rank_offset"})


class BeginWeightUpdate(StrictModel):
    """`POST /begin_weight_update` (SGLang's BeginWeightUpdateReqInput)."""

    selector: Literal["target", "all"] = "all"
    """The app's engines serve no draft model: the target is all of them."""


class EndWeightUpdate(StrictModel):
    """`POST /end_weight_update` (SGLang's EndWeightUpdateReqInput)."""


class UpdateWeightsFromDistributed(StrictModel):
    """`POST /update_weights_from_distributed` (SGLang's UpdateWeightsFromDistributedReqInput): one
    chunk of the open update, broadcast by the trainer to every replica's SGLang at once."""

    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = Field("weight_update_group", min_length=1)
    load_format: Literal["flattened_bucket"] | None = None
    weight_version: str | None = Field(None, min_length=1, max_length=64)
    """The version the update publishes at /end_weight_update, as SGLang labels it ("<k>");
    default: the served version + 1."""
    flush_cache: bool = True
    """Accepted either way: the prefix cache is emptied when the update is published."""
    abort_all_requests: bool = False
    """End the requests in flight first (they are held meanwhile), on an engine that can abort."""
    selector: Literal["target", "all"] = "all"
    torch_empty_cache: bool = False
    """Accepted either way: the engines free what a load leaves on their own."""

    @model_validator(mode="after")
    def _one_entry_per_tensor(self) -> UpdateWeightsFromDistributed:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(
                f"names, dtypes and shapes give one entry per tensor: got {len(self.names)}, "
                f"{len(self.dtypes)} and {len(self.shapes)}"
            )
        return self

    def engine_body(self) -> dict[str, Any]:
        """The chunk's fields each replica's SGLang gets (the version is set when it is published)."""
        return self.model_dump(include={"names", "dtypes", "shapes", "group_name", "load_format"}, exclude_none=True)


class DestroyWeightsUpdateGroup(StrictModel):
    """`POST /destroy_weights_update_group` (SGLang's DestroyWeightsUpdateGroupReqInput)."""

    group_name: str = Field("weight_update_group", min_length=1)


class PauseGeneration(StrictModel):
    mode: Literal["abort", "retract", "in_place"] = "abort"
    """How requests in flight are paused (SGLang's default: abort); see `sglang_pause_mode`."""


class ContinueGeneration(StrictModel):
    torch_empty_cache: bool = True
    """Accepted either way: the engines free what a load leaves on their own."""


class SglangStatus(_Answer):
    """SGLang's answer to /pause_generation and /continue_generation."""

    message: str
    status: Literal["ok"] = "ok"


def sglang_pause_mode(mode: Literal["abort", "retract", "in_place"]) -> ClientPauseMode:
    """The app's client pause for SGLang's mode: `keep` for each. `in_place` freezes requests in
    flight between engine steps and holds new ones. `retract` (SGLang moves them back to its
    waiting queue and recomputes their KV after continue) goes on after /continue_generation too.
    `abort` ends those in flight first (`/pause_generation` aborts them), then holds new ones like
    the others: SGLang queues them until /continue_generation, where vLLM's abort pause refuses
    them."""
    return "keep"


class ModelInfo(_Answer):
    """SGLang's `/model_info` keys the app can answer."""

    model_path: str
    """The served model's name: the app names no server path."""
    tokenizer_path: str
    """The served model's name, as `model_path` (the tokenizer comes with the model)."""
    served_model_name: str
    is_generation: bool = True
    weight_version: str
    """The served version's label: "default" for the weights the engine started with, "<k>" for version k."""
    preferred_sampling_params: None = None
    has_image_understanding: bool = False
    has_audio_understanding: bool = False


class WeightVersion(_Answer):
    """slime's `/get_weight_version` answer."""

    weight_version: str
