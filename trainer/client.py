"""Async client of the rollout app's HTTP API (plus a small sync wrapper for scripts).

Retries only where repeating is safe: reads, and the control calls whose repeat is defined to
be harmless (start of the active step, a stop again, the same weight version again), and only
on connection failures, timeouts or 502/503/504, never after another 4xx. A 429 (the app's trace
export backlog is full) is waited out, following Retry-After, for up to `backlog_wait_s`.

A control call waits as long as the app may take for it (`serve_app.api.control_bound_s` of the
app's control_timeout_s, plus a margin), not a fixed time: a collective update of a large model
runs one control timeout per bucket. A call that times out anyway (it waited for the app's
control lock behind another call) is repeated: the app carries a control call to its end whatever
happens to the request, and a repeat joins it or finds it done
(docs/design.md#cancellation-safe-control).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from profiling.clock_exchange import PINGS, ClockReading, offset_from, reversed_offset
from profiling.manifest import ClockOffset, StepManifest
from profiling.weight_source import WeightSource
from serve_app.api import (
    AbortRequestsRequest,
    AbortRequestsResponse,
    ClockResponse,
    ControlCall,
    ReplicaReport,
    ResetPrefixCacheResponse,
    ScheduleResponse,
    ScheduleSpec,
    StartProfileRequest,
    StartProfileResponse,
    StatusResponse,
    StepsResponse,
    StopProfileRequest,
    StopProfileResponse,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
    control_bound_s,
)
from serve_app.generate_api import GenerateRequest, GenerateResponse
from serve_app.openai_api import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionRequest,
    CompletionResponse,
    ModelList,
    SamplingFields,
)

R = TypeVar("R", bound=BaseModel)
_RETRY_STATUS = {502, 503, 504}
_CONTROL_PREFIXES = ("/profile/", "/weights/")
"""The routes a control listener serves (besides /health and /metrics)."""
CONTROL_MARGIN_S = 10.0
"""What a control call waits beyond the app's bound for it: the HTTP hops, a busy machine."""


class RolloutError(RuntimeError):
    """The app refused a call: carries its status, its message, and per-replica results."""

    def __init__(self, method: str, path: str, status: int, detail: str, replicas: list[ReplicaReport]):
        self.status, self.detail, self.replicas = status, detail, replicas
        failed = ", ".join(f"{r.replica_id}: {r.error}" for r in replicas if not r.ok)
        super().__init__(f"{method} {path} -> {status}: {detail}" + (f" [{failed}]" if failed else ""))


class RolloutClient:
    def __init__(
        self,
        base_url: str,
        *,
        control_url: str | None = None,
        control_token: str | None = None,
        timeout_s: float | None = 60.0,
        control_wait_s: float | None = None,
        retries: int = 2,
        retry_backoff_s: float = 0.5,
        backlog_wait_s: float = 600.0,
        max_connections: int = 64,
    ):
        """`control_url`: the app's control listener (its control_listener args), where the
        control routes (/profile/*, /weights/update) go instead of `base_url`: there they never
        wait behind generation in Serve's proxy (docs/design.md#control-path). None: `base_url`.
        `timeout_s`: how long reads and generation calls wait for an answer (None: as long as
        they take). `control_wait_s`:
        how long a control call (start, stop, weight update) waits; None: the call's bound on
        the app, from the app's control_timeout_s (read once from /profile/status), plus
        CONTROL_MARGIN_S (`timeout_s` while the status cannot be read).
        `retries`/`retry_backoff_s`: for connection failures, timeouts and 502/503/504.
        `backlog_wait_s`: how long a call refused with 429 (earlier steps' traces still
        exporting) keeps being retried before the 429 is raised. `max_connections`: requests in
        flight at once (more wait for a connection)."""
        headers = {"Authorization": f"Bearer {control_token}"} if control_token else {}

        def connect(url: str) -> httpx.AsyncClient:
            limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
            return httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s, limits=limits)

        self._http = connect(base_url)
        self._control_http = connect(control_url) if control_url is not None else None
        self._retries = retries
        self._backoff = retry_backoff_s
        self._backlog_wait_s = backlog_wait_s
        self._timeout_s = timeout_s
        self._control_wait_s = control_wait_s
        self._app_control_timeout_s: float | None = None

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._control_http is not None:
            await self._control_http.aclose()

    async def _control_wait(self, call: ControlCall, body: UpdateWeightsRequest | None = None) -> float | None:
        """Seconds control call `call` waits for its answer (see `control_wait_s`)."""
        if self._control_wait_s is not None:
            return self._control_wait_s
        if self._app_control_timeout_s is None:
            try:
                self._app_control_timeout_s = (await self.status()).control_timeout_s
            except RolloutError:  # not readable now (the app restarting): the plain timeout, ask again next time
                return self._timeout_s
        if self._timeout_s is None:  # no bound on reads: none on control calls either
            return None
        transfer = body.collective if body is not None else None
        return control_bound_s(call, self._app_control_timeout_s, transfer) + CONTROL_MARGIN_S

    async def _call(
        self,
        method: str,
        path: str,
        model: type[R],
        body: BaseModel | None = None,
        *,
        retry: bool,
        wait_s: float | None = None,
    ) -> R:
        control_http = self._control_http
        http = control_http if control_http is not None and path.startswith(_CONTROL_PREFIXES) else self._http
        # An OpenAI body carries only the fields the caller set: a default sent explicitly would
        # read as "set" to the ingress, which refuses fields the engine cannot honour.
        sampling = isinstance(body, SamplingFields)
        payload = body.model_dump(mode="json", exclude_none=True, exclude_unset=sampling) if body is not None else None
        attempts = 1 + (self._retries if retry else 0)
        backlog_deadline = time.monotonic() + self._backlog_wait_s
        attempt = 0
        while True:
            try:
                resp = await http.request(
                    method, path, json=payload, timeout=wait_s if wait_s is not None else httpx.USE_CLIENT_DEFAULT
                )
            except httpx.TransportError as e:
                if attempt + 1 >= attempts:
                    raise RolloutError(method, path, 0, f"cannot reach the app: {e!r}", []) from e
            else:
                if resp.status_code < 400:
                    return model.model_validate(resp.json())
                if resp.status_code == 429 and retry:
                    wait = _retry_after_s(resp)
                    if time.monotonic() + wait <= backlog_deadline:
                        await asyncio.sleep(wait)
                        continue
                if resp.status_code not in _RETRY_STATUS or attempt + 1 >= attempts:
                    raise _error(method, path, resp)
            await asyncio.sleep(self._backoff * 2**attempt)
            attempt += 1

    # -- profiling ---------------------------------------------------------------------------
    async def start_profile(self, step: int, **options: Any) -> StartProfileResponse:
        """Start step `step` on every replica; `options` are StartProfileRequest fields."""
        body = StartProfileRequest(step=step, **options)
        wait_s = await self._control_wait("start")
        return await self._call("POST", "/profile/start", StartProfileResponse, body, retry=True, wait_s=wait_s)

    async def stop_profile(self, step: int, *, pause: bool = False) -> StopProfileResponse:
        body = StopProfileRequest(step=step, pause=pause)
        wait_s = await self._control_wait("stop")
        return await self._call("POST", "/profile/stop", StopProfileResponse, body, retry=True, wait_s=wait_s)

    async def set_schedule(self, schedule: ScheduleSpec) -> ScheduleResponse:
        """Give the app its own step schedule (`POST /profile/schedule`): it then drives the
        steps at every version published; answers once step 1 started where it profiles step 1."""
        wait_s = await self._control_wait("start")
        return await self._call("POST", "/profile/schedule", ScheduleResponse, schedule, retry=True, wait_s=wait_s)

    async def update_weights(self, version: int, path: str, *, resume: bool = True) -> UpdateWeightsResponse:
        return await self._update(UpdateWeightsRequest(version=version, path=path, resume=resume), retry=True)

    async def adopt_weights(self, version: int, *, resume: bool = True) -> UpdateWeightsResponse:
        """Publish `version`, which this trainer moved into the engines itself (source external):
        the app checks that every replica's engine reports it, and loads nothing."""
        return await self._update(
            UpdateWeightsRequest(version=version, source=WeightSource.EXTERNAL, resume=resume), retry=True
        )

    async def publish_weights(self, body: UpdateWeightsRequest) -> UpdateWeightsResponse:
        """Send `body` to /weights/update once, never repeated (a collective transfer's broadcast
        cannot be: trainer/collective.py sends it)."""
        return await self._update(body, retry=False)

    async def _update(self, body: UpdateWeightsRequest, *, retry: bool) -> UpdateWeightsResponse:
        wait_s = await self._control_wait("collective" if body.collective is not None else "update", body)
        return await self._call("POST", "/weights/update", UpdateWeightsResponse, body, retry=retry, wait_s=wait_s)

    async def status(self) -> StatusResponse:
        return await self._call("GET", "/profile/status", StatusResponse, retry=True)

    async def steps(self) -> StepsResponse:
        return await self._call("GET", "/profile/steps", StepsResponse, retry=True)

    async def clock_offset(self, pings: int = PINGS) -> ClockOffset:
        """This process's wall clock against the app's reference clock: `pings` exchanges with
        `GET /profile/clock`, each bracketed by this process's readings, the tightest kept."""
        readings = []
        for _ in range(pings):
            sent = time.time_ns()
            answer = await self._call("GET", "/profile/clock", ClockResponse, retry=True)
            readings.append(ClockReading(sent, answer.time_ns, time.time_ns()))
        # Here this process brackets and the app answers: that measures the app's clock
        # against this one, the reverse of what the manifest records.
        return reversed_offset(offset_from(readings))

    async def step(self, k: int) -> StepManifest:
        return await self._call("GET", f"/profile/steps/{k}", StepManifest, retry=True)

    # -- generation --------------------------------------------------------------------------
    async def generate_tokens(self, body: GenerateRequest) -> GenerateResponse:
        """vLLM's token-in, token-out `/inference/v1/generate`; never repeated (a repeat would
        sample again)."""
        return await self._call("POST", "/inference/v1/generate", GenerateResponse, body, retry=False)

    async def reset_prefix_cache(self) -> ResetPrefixCacheResponse:
        """Empty every replica's engine prefix cache (vLLM's `/reset_prefix_cache`)."""
        return await self._call("POST", "/reset_prefix_cache", ResetPrefixCacheResponse, retry=True)

    async def abort_requests(self, request_ids: list[str] | None) -> AbortRequestsResponse:
        """End the requests `request_ids` names (None: every one in flight) on every replica: each
        answers finish_reason abort with the tokens sampled so far (vLLM's `/abort_requests`)."""
        body = AbortRequestsRequest(request_ids=request_ids)
        return await self._call("POST", "/abort_requests", AbortRequestsResponse, body, retry=True)

    async def complete(
        self, prompt: str | list[str] | list[int] | list[list[int]], **fields: Any
    ) -> CompletionResponse:
        """/v1/completions; `fields` are CompletionRequest fields (max_tokens, temperature, ...)."""
        body = CompletionRequest(prompt=prompt, **fields)
        return await self._call("POST", "/v1/completions", CompletionResponse, body, retry=True)

    async def chat(self, messages: Sequence[ChatMessage | Mapping[str, Any]], **fields: Any) -> ChatCompletionResponse:
        """/v1/chat/completions over `messages` (ChatMessages or OpenAI's `{"role", "content"}`
        dicts), rendered with the served model's chat template; `fields` are
        ChatCompletionRequest fields (max_tokens, temperature, logprobs, n, ...). Each choice
        carries the rendered prompt's token ids, the answer's, and its weight-version spans."""
        body = ChatCompletionRequest(messages=list(messages), **fields)
        return await self._call("POST", "/v1/chat/completions", ChatCompletionResponse, body, retry=True)

    async def models(self) -> ModelList:
        return await self._call("GET", "/v1/models", ModelList, retry=True)


def _retry_after_s(resp: httpx.Response) -> float:
    try:
        return max(0.1, float(resp.headers.get("Retry-After", "1")))
    except ValueError:
        return 1.0


def _error(method: str, path: str, resp: httpx.Response) -> RolloutError:
    try:
        data = resp.json()
    except ValueError:
        data = {"detail": resp.text}
    detail = data.get("detail") if isinstance(data, dict) else data
    replicas = [ReplicaReport.model_validate(r) for r in data.get("replicas", [])] if isinstance(data, dict) else []
    return RolloutError(method, path, resp.status_code, str(detail), replicas)


class AppAddress(BaseModel):
    """Where a trainer reaches the app: its HTTP port, its control listener, its control token."""

    url: str
    control_url: str | None = None
    """The app's control listener (its control_listener args); None: control calls go to url."""
    control_token: str | None = None

    def client(self) -> RolloutClient:
        """A RolloutClient of this app (make it on the event loop that uses it)."""
        return RolloutClient(self.url, control_url=self.control_url, control_token=self.control_token)


class SyncRolloutClient:
    """Blocking wrapper for scripts: the same methods, run on a private event loop."""

    def __init__(self, base_url: str, **kwargs: Any):
        self._loop = asyncio.new_event_loop()
        self._client = self._loop.run_until_complete(_make(base_url, kwargs))

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not asyncio.iscoroutinefunction(attr):
            return attr
        return lambda *a, **kw: self._loop.run_until_complete(attr(*a, **kw))

    def close(self) -> None:
        self._loop.run_until_complete(self._client.aclose())
        self._loop.close()

    def __enter__(self) -> SyncRolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _make(base_url: str, kwargs: dict[str, Any]) -> RolloutClient:
    return RolloutClient(base_url, **kwargs)  # httpx binds its pool to the loop that makes it
