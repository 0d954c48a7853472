"""Weights that reach replicas through the Ray object store (a trainer in the same Ray cluster),
so no node needs a shared filesystem. The HTTP `path` form stays for trainers outside it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import ray
from safetensors.torch import save_file


async def materialize_weights(refs: list[ray.ObjectRef], node_dir: Path, version: int) -> Path:
    """Write the state dict behind `refs[0]` to a safetensors file in this node's `node_dir`,
    so every engine loads it as it loads a path. (The ref travels inside a list so Ray hands
    it over unresolved.)"""
    state = await refs[0]
    if not isinstance(state, dict) or not state:
        raise ValueError(f"the object store holds {type(state).__name__}, not a non-empty state dict")
    weights_dir = node_dir / "weights"
    weights_dir.mkdir(parents=True, exist_ok=True)
    path = weights_dir / f"v{version}.safetensors"
    tmp = weights_dir / f".v{version}.{os.getpid()}.tmp"
    await asyncio.to_thread(save_file, {k: v.detach().cpu().contiguous() for k, v in state.items()}, str(tmp))
    tmp.replace(path)
    return path


def keep_only(path: Path) -> None:
    """After `path` loaded: remove the other versions' files next to it (a failed load removes
    `path` itself instead, so the served version's file stays)."""
    for other in path.parent.glob("v*.safetensors"):
        if other != path:
            other.unlink(missing_ok=True)
