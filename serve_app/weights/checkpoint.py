"""Weight checkpoints: where a request may point, what one checkpoint is, its tensors as its
safetensors headers describe them (no tensor data read), and reading them (safetensors only).

A weights path names one checkpoint: a `.safetensors` file, or a directory holding either one
`.safetensors` file or the shards of one sharded checkpoint as its one `*.safetensors.index.json`
lists them (`weight_map`), with no other `.safetensors` file beside them. Other files (config,
tokenizer) may sit beside it. Only regular files are opened, never blocking (a FIFO named like a
checkpoint is refused, not read).

Refusals are `WeightsError`s whose message names the cause and the fix with file names relative to
the weights directory (or the checkpoint's own directory), never a server's absolute path; the log
gets the full paths.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from serve_app.weights.safetensors_file import (
    REWRITE,
    TensorInfo,
    WeightsError,
    open_regular,
    pread,
    read_header,
    short_error,
)

log = logging.getLogger(__name__)

StateDict = dict[str, torch.Tensor]

SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"

_MAX_INDEX_BYTES = 100_000_000
_SHOWN = 3  # names listed per kind of problem; the count says how many there are

_ONE_CHECKPOINT = f"one {SUFFIX} file, or the shards of one sharded checkpoint with its {INDEX_SUFFIX}"


# -- the request's path ----------------------------------------------------------------------------


def resolve_weights_path(path: str, allowed_dir: str | os.PathLike) -> Path:
    """The real path of the checkpoint `path` names: relative to `allowed_dir` or absolute inside
    it (`~` is not expanded), one checkpoint (see the module's docstring), every file of it inside
    `allowed_dir` (no link out of it) with a valid safetensors header that its file's size
    matches. Messages name files relative to `allowed_dir`."""
    root = Path(allowed_dir).expanduser().resolve()
    real: Path | None = None
    try:
        if "\0" in path:  # said here, in one wording: the OS's own differs between Python versions
            raise WeightsError(f"{path!r} cannot be used: it holds a null byte, which no file name can; fix the path")
        candidate = Path(path)
        lexical = Path(os.path.normpath(candidate if candidate.is_absolute() else root / candidate))
        real = lexical.resolve()
        if not real.is_relative_to(root):
            if lexical.is_relative_to(root):
                raise WeightsError(
                    f"{path!r} links outside the weights directory; "
                    "copy the checkpoint into weights_dir instead of linking to it"
                )
            raise WeightsError(
                f"{path!r} is outside the weights directory; give a path relative to weights_dir "
                "or an absolute path inside it"
            )
        if not real.exists():
            hint = (
                "; '~' is not expanded: give a path relative to weights_dir or an absolute path inside it"
                if path.startswith("~")
                else "; write the checkpoint there first, or fix the path"
            )
            raise WeightsError(f"{_label(real, root)} does not exist in the weights directory{hint}")
        ckpt = _locate(real, root)
        for f in [*ckpt.files, *([ckpt.index] if ckpt.index else [])]:
            if not f.resolve().is_relative_to(root):  # a link in an allowed directory
                raise WeightsError(
                    f"{_label(f, root)} links outside the weights directory; "
                    "copy the file into weights_dir instead of linking to it"
                )
        _tensors(ckpt, root)
    except WeightsError as e:
        log.warning("weights path %r refused (weights_dir %s, resolved %s): %s", path, root, real, e)
        raise
    except (ValueError, OSError) as e:  # names too long, unreadable directories
        log.warning("weights path %r refused (weights_dir %s): %r", path, root, e)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise WeightsError(f"{path!r} cannot be used: {reason}; give a path relative to weights_dir") from e
    return real


# -- one checkpoint -----------------------------------------------------------------------------


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of the one checkpoint `path` names (a file, or a directory: see the
    module's docstring), sorted; `WeightsError` if it names none or more than one."""
    return _locate(path, _root_of(path)).files


def checkpoint_tensors(path: Path) -> dict[str, TensorInfo]:
    """The tensors of the one checkpoint `path` names, from its headers alone; a sharded
    checkpoint's shards must hold exactly what its index maps to them."""
    root = _root_of(path)
    return _tensors(_locate(path, root), root)


def check_checkpoint(path: Path, reference: Path) -> None:
    """Refuse, before any tensor is read, a checkpoint whose tensor names, dtypes or shapes differ
    from `reference`'s (the served model: its directory, or its checkpoint file). Reads only the
    safetensors headers of both, so it costs the same for a 1 GB or a 1 TB checkpoint.

    `path` must be one checkpoint (see the module's docstring). For `reference` a directory's
    index, else its `model.safetensors`, else its only `.safetensors` file is its checkpoint; a
    served model with no safetensors checkpoint (e.g. only `.bin` files) is not compared (logged).
    `WeightsError` names the missing, unexpected, wrong-dtype and wrong-shape tensors (the first
    few of each, with counts), or what is wrong with either checkpoint."""
    try:
        new = checkpoint_tensors(path)
    except WeightsError as e:
        log.warning("checkpoint %s refused: %s", path, e)
        raise
    try:
        ref_ckpt = _reference_checkpoint(reference)
        if ref_ckpt is None:
            log.warning("served model %s has no safetensors checkpoint: %s not compared with it", reference, path)
            return
        ref = _tensors(ref_ckpt, reference if reference.is_dir() else reference.parent)
    except WeightsError as e:
        log.error("the served model's checkpoint in %s cannot be read: %s", reference, e)
        raise WeightsError(f"the served model's checkpoint cannot be compared with: {e}") from e
    problems = _differences(new, ref)
    if problems:
        label = _label(path, _root_of(path)) + ("/" if path.is_dir() else "")
        msg = (
            f"{label} does not fit the served model: {'; '.join(problems)}. Fix: publish a checkpoint of "
            "the model the app serves (the same tensor names, dtypes and shapes as its checkpoint)"
        )
        log.warning("checkpoint %s refused against %s: %s", path, reference, msg)
        raise WeightsError(msg)


def _differences(new: dict[str, TensorInfo], ref: dict[str, TensorInfo]) -> list[str]:
    missing = sorted(ref.keys() - new.keys())
    unexpected = sorted(new.keys() - ref.keys())
    both = sorted(new.keys() & ref.keys())
    dtype = [f"{k} is {new[k].dtype}, served {ref[k].dtype}" for k in both if new[k].dtype != ref[k].dtype]
    shape = [f"{k} is {list(new[k].shape)}, served {list(ref[k].shape)}" for k in both if new[k].shape != ref[k].shape]
    out = []
    if missing:
        out.append(f"{len(missing)} of the served model's {len(ref)} tensors missing ({_few(missing)})")
    if unexpected:
        out.append(f"{_n(len(unexpected), 'unexpected tensor')} ({_few(unexpected)})")
    if dtype:
        out.append(f"{_n(len(dtype), 'tensor')} of the wrong dtype ({_few(dtype)})")
    if shape:
        out.append(f"{_n(len(shape), 'tensor')} of the wrong shape ({_few(shape)})")
    return out


# -- reading and staging ------------------------------------------------------------------------


def read_state_dict(path: Path) -> StateDict:
    """All tensors of the one checkpoint `path` names, on CPU. A tensor in two files is an error:
    which copy is meant is not knowable."""
    root = _root_of(path)
    state: StateDict = {}
    source: dict[str, str] = {}
    for f in checkpoint_files(path):
        try:
            shard = load_file(str(f))
        except (SafetensorError, OSError) as e:
            log.warning("reading %s failed: %r", f, e)
            raise WeightsError(f"{_label(f, root)} could not be read: {e}; {REWRITE}") from e
        if twice := sorted(shard.keys() & state.keys()):
            raise WeightsError(
                f"tensor {twice[0]!r} is in both {source[twice[0]]} and {_label(f, root)} "
                f"({_n(len(twice), 'tensor')} in both); keep one checkpoint per directory"
            )
        state.update(shard)
        source.update(dict.fromkeys(shard, _label(f, root)))
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


# -- internals ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Checkpoint:
    files: list[Path]  # its safetensors files, sorted
    index: Path | None = None  # a sharded checkpoint's index
    weight_map: dict[str, str] | None = None  # the index's tensor name -> shard file name


def _root_of(path: Path) -> Path:
    """What messages name files relative to when no weights directory is known: the
    checkpoint's parent (so a file is named by its name, a directory's file as `dir/file`)."""
    return path.parent


def _label(f: Path, root: Path) -> str:
    """`f` relative to `root` (never an absolute path: its name if it is not inside)."""
    try:
        rel = f.relative_to(root).as_posix()
    except ValueError:
        return f.name
    return "weights_dir itself" if rel == "." else rel


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _few(items: list[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    return shown if len(items) <= _SHOWN else f"{shown} and {len(items) - _SHOWN} more"


def _is_regular(p: Path) -> bool:
    """A regular file (links followed), found without opening it: a FIFO's open would block."""
    try:
        return stat.S_ISREG(p.stat().st_mode)
    except OSError:
        return False


def _locate(path: Path, root: Path) -> _Checkpoint:
    """The files of the one checkpoint `path` names; `WeightsError` unless it names exactly one."""
    where = _label(path, root)
    if path.is_dir():
        return _locate_in_dir(path, root)
    if not _is_regular(path):
        raise WeightsError(
            f"{where} is not a regular file or a directory; name a {SUFFIX} file or a directory holding "
            f"{_ONE_CHECKPOINT}"
        )
    if path.name.endswith(INDEX_SUFFIX):
        raise WeightsError(f"{where} is an index: name the directory holding it and its shards instead")
    if not path.name.endswith(SUFFIX):
        raise WeightsError(
            f"{where} is not a {SUFFIX} file; name a {SUFFIX} file or a directory holding {_ONE_CHECKPOINT}"
        )
    return _Checkpoint([path])


def _locate_in_dir(path: Path, root: Path) -> _Checkpoint:
    where = _label(path, root)
    names = sorted(os.listdir(path))
    weights = [n for n in names if n.endswith(SUFFIX)]
    indexes = [n for n in names if n.endswith(INDEX_SUFFIX)]
    for n in weights + indexes:
        if not _is_regular(path / n):
            raise WeightsError(
                f"{_label(path / n, root)} is not a regular file (a FIFO, a directory or a broken link?); "
                "remove it or replace it with the file"
            )
    if len(indexes) > 1:
        raise WeightsError(
            f"{where} holds {len(indexes)} checkpoint indexes ({_few(indexes)}); keep one checkpoint per directory"
        )
    if indexes:
        index = path / indexes[0]
        weight_map = _read_index(index, root)
        shards = sorted(set(weight_map.values()))
        absent = [s for s in shards if s not in weights]
        if absent:
            raise WeightsError(
                f"{_label(index, root)} lists {_n(len(absent), 'shard')} missing from {where} ({_few(absent)}); "
                "copy every shard beside the index, or write the checkpoint again"
            )
        extra = [n for n in weights if n not in shards]
        if extra:
            raise WeightsError(
                f"{where} holds {_n(len(extra), SUFFIX + ' file')} that {indexes[0]} does not list ({_few(extra)}); "
                "remove them: keep one checkpoint per directory"
            )
        return _Checkpoint([path / s for s in shards], index, weight_map)
    if not weights:
        raise WeightsError(f"{where} holds no {SUFFIX} file; write the checkpoint there ({_ONE_CHECKPOINT})")
    if len(weights) > 1:
        raise WeightsError(
            f"{where} holds {len(weights)} {SUFFIX} files ({_few(weights)}) and no {INDEX_SUFFIX}: which "
            "checkpoint is meant is not knowable; keep one checkpoint per directory (name a file to load "
            "one of them; a sharded checkpoint needs its index)"
        )
    return _Checkpoint([path / weights[0]])


def _reference_checkpoint(reference: Path) -> _Checkpoint | None:
    """The served model's checkpoint, leniently (a model directory may carry a second copy, e.g.
    `consolidated.safetensors` beside the shards): `model.safetensors.index.json` or its only
    index, else `model.safetensors` or its only safetensors file; None when it has none."""
    if not reference.is_dir():
        return _Checkpoint([reference])
    indexes = sorted(p.name for p in reference.glob("*" + INDEX_SUFFIX) if _is_regular(p))
    weights = sorted(p.name for p in reference.glob("*" + SUFFIX) if _is_regular(p))
    for found, preferred in ((indexes, "model" + INDEX_SUFFIX), (weights, "model" + SUFFIX)):
        chosen = preferred if preferred in found else found[0] if len(found) == 1 else None
        if chosen is None and found:
            raise WeightsError(
                f"the served model's directory holds {len(found)} checkpoints ({_few(found)}): which one "
                "is its checkpoint is not knowable; serve a model directory with one checkpoint"
            )
        if chosen is not None and found is indexes:
            weight_map = _read_index(reference / chosen, reference)
            return _Checkpoint(
                [reference / s for s in sorted(set(weight_map.values()))], reference / chosen, weight_map
            )
        if chosen is not None:
            return _Checkpoint([reference / chosen])
    return None


def _read_index(index: Path, root: Path) -> dict[str, str]:
    """`weight_map` of a sharded checkpoint's index: tensor name -> shard file name."""
    where = _label(index, root)
    with open_regular(index, where) as (fd, size):
        if size > _MAX_INDEX_BYTES:
            raise WeightsError(f"{where} is {size} bytes, too large for an index; write the index again")
        raw = pread(fd, size, 0, where)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise WeightsError(f"{where} is not JSON ({short_error(e)}); write the index again") from e
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightsError(f"{where} has no weight_map (tensor name -> shard file); write the index again")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard.endswith(SUFFIX) or shard != Path(shard).name:
            raise WeightsError(
                f"{where} maps tensor {name!r} to {shard!r}, not a {SUFFIX} file beside the index; "
                "write the index again"
            )
    return weight_map


def _tensors(ckpt: _Checkpoint, root: Path) -> dict[str, TensorInfo]:
    """The tensors of a checkpoint, from its headers; with an index, each shard must hold exactly
    the tensors the index maps to it."""
    headers = {f.name: read_header(f, _label(f, root)) for f in ckpt.files}
    if ckpt.index is not None and ckpt.weight_map is not None:
        wm = ckpt.weight_map
        absent = [f"{t} (in {s})" for t, s in sorted(wm.items()) if t not in headers[s]]
        stray = [f"{t} (in {s})" for s, h in sorted(headers.items()) for t in sorted(h) if wm.get(t) != s]
        if absent or stray:
            parts = [f"{_n(len(absent), 'tensor')} it maps not in its shard ({_few(absent)})"] if absent else []
            if stray:
                parts.append(f"{_n(len(stray), 'tensor')} in a shard it does not map it to ({_few(stray)})")
            raise WeightsError(
                f"{_label(ckpt.index, root)} does not match its shards: {'; '.join(parts)}; write the "
                "checkpoint again with its index (save_pretrained), one checkpoint per directory"
            )
    return {t: info for h in headers.values() for t, info in h.items()}
