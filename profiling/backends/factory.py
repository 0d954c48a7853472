"""One factory keyed by `options.tool`. Backends are imported lazily: importing `profiling` never
imports torch_npu (only building an npu backend does)."""

from __future__ import annotations

from profiling.backends.base import ProfilerBackend
from profiling.config import ProfileOptions


def create_backend(options: ProfileOptions) -> ProfilerBackend:
    if options.tool == "torch":
        from profiling.backends.torch_profiler import TorchProfilerBackend

        return TorchProfilerBackend(options)
    if options.tool == "npu":
        from profiling.backends.npu_profiler import NpuProfilerBackend

        return NpuProfilerBackend(options)
    if options.tool == "nsys":
        from profiling.backends.nsys_profiler import NsysProfilerBackend

        return NsysProfilerBackend(options)
    raise ValueError(f"unknown profiler tool {options.tool!r}; supported: torch, npu, nsys")
