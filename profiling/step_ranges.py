"""How each engine names one engine step (a forward pass) in its Chrome trace: the counters at
export and the analysis summaries read the same names."""

FORWARD_STEP = "forward_step#"
"""Ours (the embedded engine): `forward_step#<i> step=<k> weight_version=<v>`."""
VLLM_ITERATION = "execute_context_"
"""vLLM's worker: `execute_context_<n>(<tokens>)_generation_<m>(<tokens>)`, one per iteration."""
SGLANG_BATCH = "run_batch"
"""SGLang's scheduler: `run_batch` (opened in its pipeline-parallel loop only)."""

ENGINE_STEP_PREFIXES = (FORWARD_STEP, VLLM_ITERATION, SGLANG_BATCH)
