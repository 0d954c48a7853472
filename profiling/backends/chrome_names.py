"""Event names that torch.profiler writes into a Chrome trace without making them valid JSON.

With `with_stack`, torch's Python tracer names a frame by its code object's file and name, read
at export from pointers it took while recording without holding the code object. A code object
freed in between (a module's top-level code, gone once its import ends: the profiler's own lazy
imports run inside the first recorded window of a process) leaves whatever memory now holds
there, and the export writes it unescaped: a name with a `"`, a control byte or invalid UTF-8
makes the whole trace unreadable. Seen as `"name": "torch/profiler/_cupti_monitor.py(0): "",`.

`repair_names` finds such names after the export and writes them escaped, so the step keeps its
trace; the name itself was garbage either way.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

_BLOCK = 8 << 20
_STRING = rb'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrtu])*"'
_SCALAR = rb"(?:" + _STRING + rb"|-?[0-9][0-9.eE+-]*|true|false|null)"
_BAD_NAME = re.compile(rb'\n *"name": (?=")(?!' + _STRING + rb"(?:, " + _STRING + rb": " + _SCALAR + rb")*,?\n)")
"""A `"name"` line (Kineto writes one per line) whose value is not one valid JSON string ending
the line, or followed by more fields on it (Kineto's instant events: `"name": "Record Window
End", "ph": "i", "s": "g",`): about 0.5 s per 200 MB of trace, against the tens of seconds of
the export itself."""
_NAME_LINE = re.compile(rb'^( *"name": )"(.*)"(,?)$', re.DOTALL)


def repair_names(path: Path) -> int:
    """Rewrite `path`, a Chrome trace as torch.profiler exports it, with every event name that
    is not valid JSON (or not valid UTF-8) escaped; how many lines were repaired (0: the file is
    left untouched, the usual case)."""
    if not any(_needs_repair(block) for block in _blocks(path)):
        return 0
    repaired = 0
    fixed = path.with_name(path.name + ".names")
    try:
        with open(fixed, "wb") as out:
            for block in _blocks(path):
                if not _needs_repair(block):
                    out.write(block[1:])  # [0]: the newline the block starts with
                    continue
                lines = block.split(b"\n")
                for i, line in enumerate(lines):
                    good = _escaped(line.decode("utf-8", "replace").encode())
                    if good != line:
                        lines[i] = good
                        repaired += 1
                out.write(b"\n".join(lines[1:]))  # [0]: the newline the block starts with
        os.replace(fixed, path)
    finally:
        fixed.unlink(missing_ok=True)
    return repaired


def _needs_repair(block: bytes) -> bool:
    try:
        block.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return _BAD_NAME.search(block) is not None


def _escaped(line: bytes) -> bytes:
    """`line`, when it is a `"name"` line whose value is not valid JSON, with the value escaped."""
    if _BAD_NAME.match(b"\n" + line + b"\n") is None:
        return line
    m = _NAME_LINE.match(line)
    if m is None:
        return line
    head, value, comma = m.groups()
    return head + json.dumps(value.decode()).encode() + comma


def _blocks(path: Path) -> Iterator[bytes]:
    """`path` in blocks of about `_BLOCK` bytes, each ending just after a newline (the last may
    not), each starting with a newline that is not its own: the one that ended the block before,
    or, for the first, one in front of the file (so the pattern of a line sees its newline)."""
    carry = b"\n"
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            data = carry + block
            cut = data.rfind(b"\n")
            if cut <= 0:
                carry = data
                continue
            yield data[: cut + 1]
            carry = data[cut:]
    if carry != b"\n":
        yield carry
