"""How each engine names one engine step (a forward pass) in its Chrome trace: the counters at
export and the analysis summaries read the same names, each a prefix of the range's name."""

from __future__ import annotations

import gzip
from pathlib import Path

FORWARD_STEP = "forward_step#"
"""Ours (the embedded engine): `forward_step#<i> step=<k> weight_version=<v>`."""
VLLM_ITERATION = "execute_context_"
"""vLLM's worker: `execute_context_<n>(<tokens>)_generation_<m>(<tokens>)`, one per iteration."""
SGLANG_BATCH = "run_batch"
"""SGLang's scheduler: `run_batch` (opened in its pipeline-parallel loop only)."""

ENGINE_STEP_PREFIXES = (FORWARD_STEP, VLLM_ITERATION, SGLANG_BATCH)

_NAME = '"name": "'


def count_engine_steps(trace: Path, prefix: str) -> int:
    """User-annotation ranges whose name starts with `prefix` in one Chrome trace file (plain or
    gzipped). Read line by line, since traces can be large: Kineto writes one field per line,
    `"cat"` before `"name"`."""
    opener = gzip.open if trace.name.endswith(".gz") else open
    count, annotation = 0, False
    with opener(trace, "rt") as f:
        for line in f:
            if '"cat":' in line:
                annotation = '"user_annotation"' in line
            elif annotation and (i := line.find(_NAME)) >= 0 and line.startswith(prefix, i + len(_NAME)):
                count += 1
    return count
