"""Rollout engines, one per `engine:` value, created by `create_engine`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serve_app.config import AppArgs
    from serve_app.engines.base import RolloutEngine
    from serve_app.engines.external import SessionFactory

ENGINE_TRACE_ROOT = ".engine"
"""Under the replica's trace root: one directory per replica where an engine's own profiler
writes, before the export moves the files into the step directory (same filesystem, so moves are
renames)."""


def create_engine(
    args: AppArgs, session_factory: SessionFactory, replica_id: str, *, trace_root: Path
) -> RolloutEngine:
    """Build the engine `args.engine` names. `session_factory` makes the replica's profiling
    session around the profiler backend the engine brings; `trace_root` is the root of the
    replica's trace store (save_path, or its node's directory when traces are shipped)."""
    from serve_app.engines.tiny_model import ensure_tiny_model

    model_dir = Path(args.model_path) if args.model_path else ensure_tiny_model(args.tiny_model)
    trace_dir = trace_root / ENGINE_TRACE_ROOT / replica_id
    if args.engine == "transformers":
        from profiling.backends import create_backend
        from serve_app.engines.transformers_engine import TransformersEngine

        return TransformersEngine(
            model_dir=model_dir,
            model_name=args.model_name,
            session=session_factory(create_backend),
            max_batch_size=args.max_batch_size,
            hold_timeout_s=args.hold_timeout_s,
        )
    if args.engine == "vllm":
        from serve_app.engines.vllm_engine import VllmEngine

        return VllmEngine(args=args, model_dir=model_dir, session_factory=session_factory, trace_dir=trace_dir)
    if args.engine == "sglang":
        from serve_app.engines.sglang_engine import SglangEngine

        return SglangEngine(args=args, model_dir=model_dir, session_factory=session_factory, trace_dir=trace_dir)
    raise ValueError(f"unknown engine {args.engine!r}; supported: transformers, vllm, sglang")
