"""Weight files: where a request may point, and reading them (safetensors only)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

StateDict = dict[str, torch.Tensor]


class WeightsError(ValueError):
    """A weights path a request gave cannot be used; the message says why and what to do."""


def resolve_weights_path(path: str, allowed_dir: str | os.PathLike) -> Path:
    """The real path of `path`, which must lie inside `allowed_dir` and hold safetensors files."""
    root = Path(allowed_dir).expanduser().resolve()
    try:
        candidate = Path(path).expanduser()
        real = (candidate if candidate.is_absolute() else root / candidate).resolve()
        if not real.is_relative_to(root):
            raise WeightsError(f"path {path!r} is outside the allowed weights directory {root}")
        if not real.exists():
            raise WeightsError(f"path {path!r} does not exist (looked at {real})")
        files = safetensors_files(real)
    except WeightsError:
        raise
    except (ValueError, OSError) as e:  # NUL bytes, names too long, unreadable directories
        raise WeightsError(f"path {path!r} cannot be used: {e}") from e
    if not files:
        raise WeightsError(f"path {path!r} holds no .safetensors file")
    for f in files:
        if not f.resolve().is_relative_to(root):  # a link in an allowed directory
            raise WeightsError(f"{f.name} in {path!r} links outside the allowed weights directory {root}")
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise WeightsError(f"{f.name} is not a readable safetensors file: {e}") from e
    return real


def safetensors_files(path: Path) -> list[Path]:
    """The .safetensors files of a file or directory path: regular files only (opening a FIFO
    named like one would block its reader forever)."""
    if path.is_file():
        return [path] if path.suffix == ".safetensors" else []
    return sorted(f for f in path.glob("*.safetensors") if f.is_file())


def read_state_dict(path: Path) -> StateDict:
    """All tensors of a safetensors file or directory, on CPU. A tensor in two files is an
    error: which copy is meant is not knowable (a stale shard left beside a new checkpoint?)."""
    state: StateDict = {}
    source: dict[str, str] = {}
    for f in safetensors_files(path):
        try:
            shard = load_file(str(f))
        except (SafetensorError, OSError) as e:
            raise WeightsError(f"{f.name} could not be read: {e}") from e
        if twice := sorted(shard.keys() & state.keys()):
            raise WeightsError(
                f"tensor {twice[0]!r} is in both {source[twice[0]]} and {f.name} "
                f"({len(twice)} tensors in both); keep one checkpoint per directory"
            )
        state.update(shard)
        source.update(dict.fromkeys(shard, f.name))
    return state


def stage_weights(path: Path, staging: Path) -> Path:
    """A directory holding exactly the safetensors files of `path`: engines that load every
    safetensors file of a directory get a directory of one file when `path` is a file (the
    trainer's weights directory holds several versions side by side). `staging` is replaced."""
    if path.is_dir():
        return path
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    os.symlink(path.resolve(), staging / "model.safetensors")
    return staging
