"""Code in the docs that is marked as a snippet of an example is that example's code, verbatim, so
the docs show only code a test runs (docs/examples/*.py are run by tests).

A marker line `<!-- snippet: docs/examples/NAME.py#REGION -->` must be followed by a fenced
block equal to the lines between `# --8<-- [start:REGION]` and `# --8<-- [end:REGION]` of that
file, dedented."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!-- snippet: (?P<path>[^#\s]+)#(?P<region>[\w-]+) -->\n```\w*\n(?P<code>.*?)```", re.S)


def region(path: Path, name: str) -> str:
    """The dedented lines between the region's start and end markers, without trailing blank lines."""
    lines = path.read_text().splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == f"# --8<-- [start:{name}]"]
    ends = [i for i, line in enumerate(lines) if line.strip() == f"# --8<-- [end:{name}]"]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise ValueError(f"{path.name} has no single region {name!r}")
    # Blank lines before the end marker are the formatter's spacing, not the snippet's.
    return textwrap.dedent("".join(lines[starts[0] + 1 : ends[0]])).rstrip("\n") + "\n"


def snippet_problems(root: Path) -> list[str]:
    """One line per marked snippet that differs from its region (or names none)."""
    problems = []
    for doc in sorted((root / "docs").glob("*.md")):
        for m in MARKER.finditer(doc.read_text()):
            source = root / m["path"]
            try:
                expected = region(source, m["region"])
            except (OSError, ValueError) as e:
                problems.append(f"{doc.name}: {m['path']}#{m['region']}: {e}")
                continue
            if m["code"] != expected:
                problems.append(f"{doc.name}: {m['path']}#{m['region']} differs from the example's code")
    return problems


def test_every_snippet_in_the_docs_is_its_examples_code():
    assert snippet_problems(ROOT) == []
    marked = [m for doc in (ROOT / "docs").glob("*.md") for m in MARKER.finditer(doc.read_text())]
    assert len(marked) >= 3, "docs/trainer.md shows a snippet per weight transfer mode"


@pytest.mark.parametrize(
    ("doc_code", "problem"),
    [
        ("x = 2\n", "differs from the example's code"),
        (None, "has no single region 'missing'"),
    ],
)
def test_a_snippet_that_drifted_or_names_no_region_is_reported(tmp_path, doc_code, problem):
    (tmp_path / "docs" / "examples").mkdir(parents=True)
    (tmp_path / "docs" / "examples" / "ex.py").write_text(
        "def f():\n    # --8<-- [start:one]\n    x = 1\n    # --8<-- [end:one]\n"
    )
    name, code = ("one", doc_code) if doc_code is not None else ("missing", "x = 1\n")
    (tmp_path / "docs" / "page.md").write_text(f"<!-- snippet: docs/examples/ex.py#{name} -->\n```python\n{code}```\n")
    assert [p for p in snippet_problems(tmp_path) if problem in p] != []
    (tmp_path / "docs" / "page.md").write_text("<!-- snippet: docs/examples/ex.py#one -->\n```python\nx = 1\n```\n")
    assert snippet_problems(tmp_path) == []
