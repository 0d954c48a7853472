"""Rollout engines, one per `engine:` value, created by `create_engine`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from profiling.session import ProfileSession
    from serve_app.config import AppArgs
    from serve_app.engines.base import RolloutEngine


def create_engine(args: AppArgs, session: ProfileSession) -> RolloutEngine:
    if args.engine == "transformers":
        from pathlib import Path

        from serve_app.engines.tiny_model import ensure_tiny_model
        from serve_app.engines.transformers_engine import TransformersEngine

        model_dir = Path(args.model_path) if args.model_path else ensure_tiny_model(args.tiny_model)
        return TransformersEngine(
            model_dir=model_dir,
            model_name=args.model_name,
            session=session,
            max_batch_size=args.max_batch_size,
            hold_timeout_s=args.hold_timeout_s,
        )
    raise ValueError(f"unknown engine {args.engine!r}; supported: transformers")
