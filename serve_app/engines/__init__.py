"""Rollout engines, one package per `engine:` value (its adapter), each behind an
`EngineController` made by `create_engine`."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serve_app.config import AppArgs
    from serve_app.engines.adapter import EngineAdapter
    from serve_app.engines.controller import EngineController, SessionFactory

ENGINE_TRACE_ROOT = ".engine"
"""Under the replica's trace root: one directory per replica where an engine's own profiler
writes, before the export moves the files into the step directory (same filesystem, so moves are
renames)."""


def create_engine(
    args: AppArgs, session_factory: SessionFactory, replica_id: str, *, trace_root: Path
) -> EngineController:
    """Build the controller of the engine `args.engine` names, around its adapter.
    `session_factory` makes the replica's profiling session around the engine's profiler;
    `trace_root` is the root of the replica's trace store (save_path, or its node's directory
    when traces are shipped)."""
    from serve_app.engines.controller import EngineController
    from serve_app.tiny_model import ensure_tiny_model

    module, _, name = args.engine_options.implementation.partition(":")
    adapter: type[EngineAdapter] = getattr(importlib.import_module(module), name)
    return EngineController(
        adapter,
        args=args,
        model_dir=Path(args.model_path) if args.model_path else ensure_tiny_model(args.tiny_model),
        session_factory=session_factory,
        trace_dir=trace_root / ENGINE_TRACE_ROOT / replica_id,
    )
