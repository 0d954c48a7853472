"""SGLang's native HTTP API as the SGLang engine uses it: request/response bodies and one client.

Field names, routes and answers follow SGLang 0.5.x (`sglang/srt/entrypoints/http_server.py`,
`sglang/srt/managers/io_struct.py`; see docs/sglang.md for the exact sources). SGLang's
request structs ignore unknown fields, so a misspelt field would silently do nothing: the bodies
we send are strict pydantic models (`extra="forbid"`), and the fake server in tests/ can reject
unknown fields outright.

`/generate` streams server-sent events (`SglangClient.stream`); closing that iterator closes the
HTTP stream, and SGLang aborts a request whose client went away.

Errors: every failed call raises `SglangError`, whose message names the server URL, the route,
the HTTP status and SGLang's own message. A profiler start/stop that SGLang refuses surfaces as a
bare HTTP 500 "Internal Server Error" (the route lets the RuntimeError escape; the reason is only
in the server's log), so the client appends the server log's last lines when it has them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from typing import Annotated, Any, Literal, TypeVar

import httpx
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

M = TypeVar("M", bound=BaseModel)


class _Request(BaseModel):
    """A body we send: unknown keys are our bug, not something for SGLang to ignore."""

    model_config = ConfigDict(extra="forbid")


class _Answer(BaseModel):
    """A body SGLang sends: it carries more than we read."""

    model_config = ConfigDict(extra="ignore")


class StartProfileBody(_Request):
    """`POST /start_profile` (ProfileReqInput / ProfileReq). SGLang names the trace files
    `{profile_prefix}-{profile_id}-TP-{tp}[-DP-..][-PP-..][-EP-..].trace.json.gz` in `output_dir`;
    `profile_id` is left to SGLang (its time), older 0.5.x servers do not accept it over HTTP."""

    output_dir: str
    profile_prefix: str
    activities: list[str] = Field(min_length=1)
    num_steps: int | None = Field(None, ge=1, description="Auto-stop after this many engine steps.")
    # Both default to on in SGLang when absent: always send them.
    with_stack: bool
    record_shapes: bool


class UpdateWeightsFromDiskBody(_Request):
    """`POST /update_weights_from_disk` (UpdateWeightFromDiskReqInput)."""

    model_path: str
    weight_version: str
    flush_cache: Literal[False] = False
    """The adapter flushes before the load (`/flush_cache`, while paused): SGLang's flush after it
    would, refused, fail the update with the new weights already loaded."""


class UpdateWeightsFromDiskAnswer(_Answer):
    success: bool
    message: str
    num_paused_requests: int | None = 0


def _version_label(label: object) -> str:
    """A weight version as SGLang keeps it for this app: the app's integer version, as a string
    (the adapter reads SGLang's label back as that integer)."""
    if isinstance(label, bool) or not isinstance(label, int | str) or not str(label).isdigit():
        raise ValueError(
            f"the weight version must be a non-negative integer (or its string, e.g. '3'), not {label!r}: "
            "the replica reads SGLang's weight_version back as the app's integer version"
        )
    return str(int(label))


VersionLabel = Annotated[str, BeforeValidator(_version_label)]


class InitWeightsUpdateGroupBody(_Request):
    """`POST /init_weights_update_group` (InitWeightsUpdateGroupReqInput): SGLang joins the
    trainer's group as rank `rank_offset` + its tp_rank of `world_size`, through a TCP rendezvous
    at `master_address:master_port` hosted by the trainer (rank 0)."""

    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, description="Rank 0 is the trainer's.")
    world_size: int = Field(ge=2)
    group_name: str = Field("weight_update_group", min_length=1)
    backend: str = Field("nccl", min_length=1)

    @model_validator(mode="after")
    def _rank_in_group(self) -> InitWeightsUpdateGroupBody:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} is outside a group of world_size {self.world_size}")
        return self


class UpdateWeightsFromDistributedBody(_Request):
    """`POST /update_weights_from_distributed` (UpdateWeightsFromDistributedReqInput): receive one
    broadcast from the group (one tensor per name, in order, or one `flattened_bucket`) and load
    it, then set `weight_version` and flush the cache."""

    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = Field("weight_update_group", min_length=1)
    load_format: Literal["flattened_bucket"] | None = None
    weight_version: VersionLabel | None = None
    flush_cache: Literal[True] = True
    """Always: no cached prefix computed on the old weights may serve the new ones."""

    @model_validator(mode="after")
    def _one_entry_per_tensor(self) -> UpdateWeightsFromDistributedBody:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(
                f"names, dtypes and shapes give one entry per tensor: got {len(self.names)}, "
                f"{len(self.dtypes)} and {len(self.shapes)}"
            )
        return self


class DestroyWeightsUpdateGroupBody(_Request):
    """`POST /destroy_weights_update_group` (DestroyWeightsUpdateGroupReqInput)."""

    group_name: str = Field("weight_update_group", min_length=1)


class BeginWeightUpdateBody(_Request):
    """`POST /begin_weight_update` (BeginWeightUpdateReqInput): SGLang 0.5.23 loads a distributed
    update only inside such a session (on every runner: `selector` keeps SGLang's "all")."""


class EndWeightUpdateBody(_Request):
    """`POST /end_weight_update` (EndWeightUpdateReqInput): close the session."""


class UpdateWeightVersionBody(_Request):
    """`POST /update_weight_version` (UpdateWeightVersionReqInput). `abort_all_requests` is always
    sent: SGLang's default (true) would end every request the app's replica has in flight."""

    new_version: VersionLabel
    abort_all_requests: Literal[False] = False


class WeightUpdateAnswer(_Answer):
    """`{success, message}`: the answer of SGLang's weight routes (HTTP 400 when not successful)."""

    success: bool
    message: str


class ModelInfoAnswer(_Answer):
    """`GET /model_info` (the part this adapter reads)."""

    weight_version: str | None = None


class PauseGenerationBody(_Request):
    """`POST /pause_generation` (PauseGenerationReqInput). `retract`: running requests go back
    to the queue and keep their tokens; their KV cache is dropped and recomputed after
    `/continue_generation`, which is what lets a weight update flush the cache. `in_place` keeps
    the KV cache, and a cache flush with requests running then fails an assertion that kills
    SGLang's scheduler. `abort` ends every request."""

    mode: Literal["abort", "retract", "in_place"]


class AbortRequestBody(_Request):
    """`POST /abort_request` (AbortReq): end request `rid`, or every request (`abort_all`). SGLang
    answers 200 with no body, whether or not it still runs the request; the request's own answer
    ends with finish_reason {"type": "abort"} and its tokens so far (a running one after one more
    forward, whose token it keeps)."""

    rid: str | None = None
    abort_all: bool = False


class ContinueGenerationBody(_Request):
    """`POST /continue_generation` (ContinueGenerationReqInput; newer versions add
    `torch_empty_cache`, default true)."""


class SamplingParams(_Request):
    """The `sampling_params` of `/generate` (SGLang's SamplingParams keywords,
    `sglang/srt/sampling/sampling_params.py`). Every field is sent, so that no SGLang default
    differing from ours applies; `sampling_seed`, `stop` and `stop_token_ids` only when set
    (older servers refuse an unknown `sampling_seed` key)."""

    max_new_tokens: int = Field(ge=1)
    temperature: float = Field(ge=0.0)
    """Below 1e-6 SGLang samples greedily (it sets top_k=1)."""
    top_p: float
    top_k: int
    """-1: the whole vocabulary (SGLang's "disable"; newer versions store it as 1 << 30)."""
    min_p: float
    sampling_seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool
    min_new_tokens: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    no_stop_trim: bool
    """Keep a matched stop string in SGLang's `text` (we read token ids: they always keep it)."""


class GenerateBody(_Request):
    """`POST /generate` (GenerateReqInput) for one prompt given as token ids."""

    input_ids: list[int] = Field(min_length=1)
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int | None = Field(None, ge=0)
    """The most likely tokens' logprobs per position, output and prompt alike."""
    logprob_start_len: int | None = None
    """0: also every prompt token's logprob (the first is null); SGLang's default -1: none."""
    cache_salt: str | None = None
    """Only requests with the same salt share radix-cache prefixes."""
    rid: str | None = None
    """The request's id, which `/abort_request` names it by (SGLang makes one when absent)."""


class FinishReason(_Answer):
    """`meta_info.finish_reason` (schedule_batch.py's FINISH_* `to_json`): {"type": "length",
    "length": n}, {"type": "stop", "matched": token id or stop string} or {"type": "abort",
    "message": ..., "status_code": ...}."""

    type: str
    matched: int | str | list[int] | None = None
    message: str | None = None
    status_code: int | None = None


class WeightVersionSpanAnswer(_Answer):
    """One span of `meta_info.weight_versions` (sglang/srt/utils/weight_versions.py)."""

    version: str
    start: int
    end: int


LogprobEntry = tuple[float, int, str | None]
"""SGLang's (logprob, token id, text or null) of one token (`detokenize_logprob_tokens`)."""
PromptLogprobEntry = tuple[float | None, int, str | None]
"""The same for a prompt token: the first prompt token's logprob is null."""


class GenerateMetaInfo(_Answer):
    """`meta_info` of a `/generate` answer or stream chunk (tokenizer_manager.py,
    `_handle_batch_output`)."""

    finish_reason: FinishReason | None = None
    """Null on every stream chunk but the last."""
    weight_version: str | None = None
    """The server's `weight_version` when the chunk was built (SGLang's default is "default")."""
    weight_versions: list[WeightVersionSpanAnswer] | None = None
    """Newer servers, on the finished chunk: the version of every span of output tokens."""
    completion_tokens: int
    """Output tokens so far (cumulative in both streaming modes)."""
    output_token_logprobs: list[LogprobEntry] = Field(default_factory=list)
    """One per output token with `return_logprob` (all so far, or this chunk's with SGLang's
    --incremental-streaming-output)."""
    output_top_logprobs: list[list[LogprobEntry] | None] = Field(default_factory=list)
    """Per output token, the `top_logprobs_num` most likely tokens' (sliced as above)."""
    input_token_logprobs: list[PromptLogprobEntry] = Field(default_factory=list)
    """Per prompt token from `logprob_start_len` (never sliced)."""
    input_top_logprobs: list[list[LogprobEntry] | None] = Field(default_factory=list)
    """Per prompt token, the most likely tokens' (the first position: null)."""


class GenerateChunk(_Answer):
    """A `/generate` answer, or one `data:` event of its stream. `output_ids`: all output tokens
    so far, or this chunk's alone with SGLang's --incremental-streaming-output."""

    output_ids: list[int]
    meta_info: GenerateMetaInfo


class SglangError(RuntimeError):
    """A call to an SGLang server failed; the message says where, what, and SGLang's reason."""

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message)
        self.status = status


def _detail(resp: httpx.Response) -> str:
    """SGLang's own message out of any of its error shapes."""
    try:
        data = resp.json()
    except ValueError:
        return resp.text.strip() or resp.reason_phrase
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:  # /generate's {"error": {"message"}}
            return str(error["message"])
        if isinstance(error, str):  # /generate's JSON-contract refusal
            return error
        for key in ("message", "detail"):  # ErrorResponse / {success, message} / HTTPException
            if key in data:
                return str(data[key])
    return resp.text.strip()


_DONE = object()
"""`data: [DONE]`, the end of a `/generate` stream."""


def parse_sse_line(line: str) -> Any:
    """One line of SGLang's event stream (`data: <json>` lines separated by blank lines): the
    parsed JSON, `_DONE` for `data: [DONE]`, None for a line that carries no data."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        return _DONE
    try:
        return json.loads(data)
    except ValueError:
        return data


class SglangClient:
    """One SGLang server's native API over one `httpx.AsyncClient`.

    `log_tail` returns the last lines of the server's log when this replica launched the
    server (the only place SGLang says why a profiler call failed)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        log_tail: Callable[[], str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.url = url.rstrip("/")
        self._log_tail = log_tail
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeout_s, transport=transport)
        self.unreachable: str | None = None
        """Why the last call could not reach the server (None once a call got an answer)."""

    async def call(
        self, route: str, body: BaseModel | None = None, *, accept: tuple[int, ...] = (), own_connection: bool = False
    ) -> httpx.Response:
        """POST `body` to `route`; the response if its status is 2xx or in `accept`.

        `own_connection`: use a connection for this call alone. After an exception escapes a
        route (a refused profiler call), uvicorn answers 500 and then closes the connection;
        a pooled connection reused in that moment fails the next, unrelated call."""
        payload = None if body is None else body.model_dump(exclude_none=True)
        headers = {"Connection": "close"} if own_connection else None
        try:
            resp = await self._http.post(route, json=payload, headers=headers)
        except httpx.HTTPError as e:
            self.unreachable = f"{type(e).__name__}: {e}"
            raise SglangError(
                f"SGLang at {self.url} did not answer POST {route} ({self.unreachable}); "
                "is the server running and reachable from this replica?"
            ) from e
        self.unreachable = None
        if resp.is_success or resp.status_code in accept:
            return resp
        raise SglangError(self.describe(route, resp), status=resp.status_code)

    async def call_for(self, route: str, body: BaseModel | None, answer: type[M], *, accept: tuple[int, ...] = ()) -> M:
        """`call`, then parse the JSON answer as `answer`."""
        resp = await self.call(route, body, accept=accept)
        try:
            return answer.model_validate_json(resp.content)
        except ValidationError as e:
            if not resp.is_success:  # an accepted error status in another of SGLang's shapes
                raise SglangError(self.describe(route, resp), status=resp.status_code) from e
            raise SglangError(
                f"SGLang at {self.url} answered POST {route} with HTTP {resp.status_code} and a body this "
                f"adapter cannot read ({e.error_count()} problems: {e.errors()[0]['msg']}): {resp.text[:300]!r}; "
                "is the server an SGLang 0.5.x?",
                status=resp.status_code,
            ) from e

    async def get_for(self, route: str, answer: type[M]) -> M:
        """GET `route` (a route that needs no engine step) and parse its JSON answer as `answer`."""
        try:
            resp = await self._http.get(route)
        except httpx.HTTPError as e:
            self.unreachable = f"{type(e).__name__}: {e}"
            raise SglangError(
                f"SGLang at {self.url} did not answer GET {route} ({self.unreachable}); "
                "is the server running and reachable from this replica?"
            ) from e
        self.unreachable = None
        if not resp.is_success:
            raise SglangError(self.describe(route, resp, method="GET"), status=resp.status_code)
        try:
            return answer.model_validate_json(resp.content)
        except ValidationError as e:
            raise SglangError(
                f"SGLang at {self.url} answered GET {route} with a body this adapter cannot read: {resp.text[:300]!r}; "
                "is the server an SGLang 0.5.x?"
            ) from e

    async def stream(self, route: str, body: BaseModel) -> AsyncGenerator[dict[str, Any], None]:
        """POST `body` to a streaming route; each server-sent `data: {...}` event as parsed JSON,
        until `data: [DONE]`. Closing this iterator closes the HTTP stream (SGLang aborts a
        request whose client went away). An error event (`{"error": {"message"}}`, what SGLang
        streams for a ValueError raised after the answer began) raises SglangError with the
        error's `code` as status."""
        payload = body.model_dump(exclude_none=True)
        try:
            async with self._http.stream("POST", route, json=payload) as resp:
                self.unreachable = None
                if not resp.is_success:
                    await resp.aread()
                    raise SglangError(self.describe(route, resp), status=resp.status_code)
                async for line in resp.aiter_lines():
                    event = parse_sse_line(line)
                    if event is _DONE:
                        return
                    if event is None:
                        continue
                    if not isinstance(event, dict):
                        raise SglangError(
                            f"SGLang at {self.url} streamed an event this adapter cannot read "
                            f"on POST {route}: {line[:300]!r}"
                        )
                    if isinstance(error := event.get("error"), dict):
                        code = error.get("code")
                        raise SglangError(
                            f"SGLang at {self.url} streamed an error on POST {route}: {error.get('message')}",
                            status=code if isinstance(code, int) else None,
                        )
                    yield event
        except httpx.HTTPError as e:
            self.unreachable = f"{type(e).__name__}: {e}"
            raise SglangError(
                f"SGLang at {self.url} broke off POST {route} ({self.unreachable}); "
                "is the server running and reachable from this replica?"
            ) from e

    def describe(self, route: str, resp: httpx.Response, *, method: str = "POST") -> str:
        """The error message for an unexpected answer, with the server log's tail on a 500."""
        message = f"SGLang at {self.url} answered {method} {route} with HTTP {resp.status_code}: {_detail(resp)}"
        if resp.status_code >= 500:
            tail = self.log_tail()
            message += (
                f"; SGLang logs the reason; last server log lines:\n{tail}"
                if tail
                else "; SGLang logs the reason in its server log"
            )
        return message

    async def probe(self) -> None:
        """Check that the server answers again after `unreachable` was set. `GET /get_model_info`
        needs no engine step (`/health` runs a generation and hangs while generation is paused)."""
        try:
            resp = await self._http.get("/get_model_info")
        except httpx.HTTPError as e:
            self.unreachable = f"{type(e).__name__}: {e}"
            return
        self.unreachable = None if resp.is_success else f"GET /get_model_info answered HTTP {resp.status_code}"

    def log_tail(self) -> str:
        return self._log_tail() if self._log_tail else ""

    async def aclose(self) -> None:
        await self._http.aclose()
