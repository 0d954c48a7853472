"""How each engine names one engine step (a forward pass) in its Chrome trace: the counters at
export and the analysis summaries read the same names, each a prefix of the range's name."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

FORWARD_STEP = "forward_step#"
"""Ours (the embedded engine, vLLM's workers through the extension, the trainer):
`forward_step#<i> step=<k> weight_version=<v>`."""
VLLM_ITERATION = "execute_context_"
"""vLLM's own profiler in its worker: `execute_context_<n>(<tokens>)_generation_<m>(<tokens>)`,
one per iteration (traces recorded with vLLM's profiler, read by the analysis)."""
SGLANG_BATCH = "run_batch"
"""SGLang's scheduler: `run_batch` (opened in its pipeline-parallel loop only)."""
SGLANG_FORWARD = "step["
"""SGLang's model runner: `step[<MODE> bs=<n>[ toks=<t>]...]` around every forward of a batch,
with or without pipeline parallelism (`sglang/srt/model_executor/model_runner.py`,
`ModelRunner.forward`; the name from `sglang/srt/utils/profile_utils.py`, `build_step_span_name`;
a `record_function` whenever a torch profiler runs, `sglang/srt/utils/nvtx_utils.py`,
`profile_range`; SGLang 0.5.23)."""

ENGINE_STEP_PREFIXES = (FORWARD_STEP, VLLM_ITERATION, SGLANG_BATCH, SGLANG_FORWARD)

_SGLANG_SEGMENT = re.compile(r"-v(\d+)-[^-]+-TP-\d+")
"""An SGLang trace file of this project's adapter: `<prefix>-v<version>-<profile_id>-TP-<tp>...`
(SGLang's profile_id is its clock, `str(time.time())`): one recording per weight version, since
SGLang writes no version into the trace itself."""


def sglang_trace_version(name: str) -> int | None:
    """The weight version in the name of an SGLang trace file the adapter had written (None: not
    such a name)."""
    found = _SGLANG_SEGMENT.findall(name)
    return int(found[-1]) if found else None


def sglang_recording(name: str) -> str:
    """The recording an SGLang trace file belongs to (its name before `-TP-<rank>`): every rank
    of one recording runs the same forwards."""
    return name.split("-TP-")[0]

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
