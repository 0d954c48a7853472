"""Weight files: where a request may point, and reading them (safetensors only)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file


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
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise WeightsError(f"{f.name} is not a readable safetensors file: {e}") from e
    return real


def safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path] if path.suffix == ".safetensors" else []
    return sorted(path.glob("*.safetensors"))


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file or directory, on CPU."""
    state: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise WeightsError(f"{f.name} could not be read: {e}") from e
    return state
