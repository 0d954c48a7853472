"""Engine-agnostic profiling core: config, step schedule, profiler backends, the per-process
session state machine and the trace store. Imports neither Ray nor HTTP code."""
