"""How SGLang's own profiler names its traces, as the manifest entry's `TraceDialect`
(docs/sglang.md#forward-steps-and-weight-versions): the analysis reads SGLang's traces by it.

* Forward passes: SGLang's model runner opens `step[<MODE> bs=<n>[ toks=<t>]...]` around every
  forward of a batch, with or without pipeline parallelism (`sglang/srt/model_executor/
  model_runner.py`, `ModelRunner.forward`; the name from `sglang/srt/utils/profile_utils.py`,
  `build_step_span_name`; a `record_function` whenever a torch profiler runs, SGLang 0.5.23).
* Weight versions: SGLang writes none into its trace, so the adapter records one version per
  SGLang recording and names it in the prefix (`engine.segment_prefix`), which SGLang's file
  names keep: `<prefix>-v<version>-<profile_id>-TP-<tp>...` (its profile_id is its clock,
  `str(time.time())`); every TP rank of one recording writes its own file.
"""

from __future__ import annotations

from profiling.manifest import TraceDialect

SGLANG_FORWARD = "step["
"""The name prefix of SGLang's range around one forward."""

SGLANG_DIALECT = TraceDialect(
    forward_range=SGLANG_FORWARD,
    version_in="file_name",
    file_version=r"-v(\d+)-[^-]+-TP-\d+",
    rank_separator="-TP-",
)
"""The dialect of a trace SGLang's profiler wrote for this project's adapter."""
