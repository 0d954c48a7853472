"""Profiler backends, one per tool, created by `create_backend` from the session's options."""

from profiling.backends.base import ProfilerBackend, ProfilerStateError, RecordedTrace
from profiling.backends.factory import create_backend

__all__ = ["ProfilerBackend", "ProfilerStateError", "RecordedTrace", "create_backend"]
