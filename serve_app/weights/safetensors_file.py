"""One safetensors file read from its header alone (the 8-byte length and the JSON header, never
the tensor data), opened only if it is a regular file and never blocking, and the `WeightsError`
every refusal of a weights path raises (serve_app/weights/checkpoint.py builds on it)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# safetensors refuses larger headers (its MAX_HEADER_SIZE); an index is a small JSON file too.
_MAX_HEADER_BYTES = 100_000_000
# Bits per element of each safetensors dtype (safetensors 0.8).
_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}  # fmt: skip

REWRITE = "write it again with safetensors (save_file, save_model or save_pretrained)"
"""The fix a message gives for a file safetensors cannot read."""


class WeightsError(ValueError):
    """A weights path a request gave cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it."""

    dtype: str  # the safetensors name: "F32", "BF16", ...
    shape: tuple[int, ...]


def read_header(path: Path, where: str | None = None) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, from its header alone: the 8-byte length and the JSON
    header are read, the tensor data is not (only the file's size is compared with the header's
    offsets, as safetensors does). `WeightsError` if the file is not valid safetensors; messages
    name the file `where` (default: its name)."""
    return _read_header(path, path.name if where is None else where)


@contextmanager
def open_regular(p: Path, where: str) -> Iterator[tuple[int, int]]:
    """(fd, size) of the regular file `p`: opened without blocking (O_NONBLOCK: a FIFO put there
    after a check does not block the open) and checked before anything is read."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise WeightsError(f"{where} cannot be opened: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise WeightsError(f"{where} is not a regular file; replace it with the file")
        yield fd, st.st_size
    finally:
        os.close(fd)


def pread(fd: int, length: int, offset: int, where: str) -> bytes:
    """`length` bytes of `fd` from `offset`; `WeightsError` if the file ends before."""
    chunks: list[bytes] = []
    got = 0
    while got < length:
        chunk = os.pread(fd, length - got, offset + got)
        if not chunk:
            raise WeightsError(f"{where} shrank while it was read; write it completely, then update")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_header(p: Path, where: str) -> dict[str, TensorInfo]:
    """The tensors of the safetensors file `p`: its 8-byte header length and JSON header are
    read, its tensor data is not; the file's size must be what the header's offsets add up to."""

    def bad(reason: str, fix: str = REWRITE) -> WeightsError:
        return WeightsError(f"{where} is not a readable safetensors file: {reason}; {fix}")

    with open_regular(p, where) as (fd, size):
        if size < 8:
            raise bad(f"it holds {size} bytes, fewer than the 8-byte header length")
        n = int.from_bytes(pread(fd, 8, 0, where), "little")
        if n > _MAX_HEADER_BYTES:
            raise bad(f"its header length reads {n} bytes, more than safetensors allows (not safetensors?)")
        if 8 + n > size:
            raise bad(f"its header length reads {n} bytes but only {size - 8} follow (cut short, or not safetensors?)")
        raw = pread(fd, n, 8, where)
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (ValueError, RecursionError) as e:
        raise bad(f"its header is not JSON ({short_error(e)})") from e
    if not isinstance(doc, dict):
        raise bad("its header is not a JSON object")
    out: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in doc.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise bad("its __metadata__ is not a map of strings")
            continue
        problem, info, begin, end = _entry(name, entry)
        if problem or info is None:
            raise bad(problem)
        out[name] = info
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise bad(f"tensor {name!r} starts at byte {begin} of the data, not {at} (overlap or gap)")
        at = end
    data = size - 8 - n
    if at > data:
        raise bad(
            f"its tensor data is cut short: the header describes {at} bytes, the file holds {data}",
            "copy the whole file (an unfinished copy or write?)",
        )
    if at < data:
        raise bad(f"it holds {data - at} bytes after its last tensor")
    return out


def _entry(name: str, entry: object) -> tuple[str, TensorInfo | None, int, int]:
    """(problem, info, begin, end) of one header entry; problem is "" when it is valid."""
    if not isinstance(entry, dict):
        return f"tensor {name!r} is described by {type(entry).__name__}, not an object", None, 0, 0
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPE_BITS:
        return f"tensor {name!r} has an unknown dtype {dtype!r}", None, 0, 0
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return f"tensor {name!r} has an invalid shape {shape!r}", None, 0, 0
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        return f"tensor {name!r} has invalid data_offsets {offsets!r}", None, 0, 0
    bits = _DTYPE_BITS[dtype]
    for d in shape:
        bits *= d
    if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
        span = offsets[1] - offsets[0]
        return f"tensor {name!r} ({dtype} {shape}) takes {bits / 8:g} bytes, its data_offsets {span}", None, 0, 0
    return "", TensorInfo(dtype, tuple(shape)), offsets[0], offsets[1]


def no_duplicates(pairs: Iterable[tuple[str, object]]) -> dict[str, object]:
    """A JSON `object_pairs_hook` that refuses a key given twice."""
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} twice")
        out[k] = v
    return out


def short_error(e: BaseException) -> str:
    """A parse error, short enough for a message."""
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at byte {e.pos}"
    return str(e)[:200] or type(e).__name__
