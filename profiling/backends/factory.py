"""One factory keyed by `options.tool`."""

from __future__ import annotations

from profiling.backends.base import ProfilerBackend
from profiling.config import ProfileOptions


def create_backend(options: ProfileOptions) -> ProfilerBackend:
    if options.tool == "torch":
        from profiling.backends.torch_profiler import TorchProfilerBackend

        return TorchProfilerBackend(options)
    raise ValueError(f"unknown profiler tool {options.tool!r}; supported: torch")
