"""The user guide holds together: the index lists every page, relative links and their anchors
resolve, and the step-timeline figure's script still draws."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} (.+)$", re.M)


def _slugs(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, -1, -2... for repeats."""
    seen: dict[str, int] = {}
    slugs = set()
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def test_index_lists_every_page():
    index = (DOCS / "README.md").read_text()
    listed = set(re.findall(r"\]\(([\w-]+\.md)\)", index))
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert pages - listed == set(), "pages missing from docs/README.md"
    assert listed - pages == set(), "docs/README.md links pages that do not exist"


def test_relative_links_and_anchors_resolve():
    broken = []
    for page in _pages():
        for target in _LINK.findall(_FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _slugs(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_step_timeline_figure_draws(tmp_path):
    out = tmp_path / "step_timeline.png"
    proc = subprocess.run(
        [sys.executable, str(DOCS / "figures" / "step_timeline.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.stat().st_size > 10_000
    assert (DOCS / "images" / "step_timeline.png").is_file(), "commit the drawn figure"


def test_the_readme_names_every_benchmark_config_and_cli_command():
    """The README's layout and CLI lines list what the repository holds (they went stale once)."""
    readme = (ROOT / "README.md").read_text()
    missing = [f"benchmarks/{p.name}" for p in (ROOT / "benchmarks").glob("*.py") if f"`{p.name}`" not in readme]
    missing += [f"config/{p.name}" for p in (ROOT / "config").glob("*.yaml") if f"`{p.name}`" not in readme]
    from typer.main import get_command

    from profiling.cli import app

    commands = get_command(app).commands  # type: ignore[attr-defined]
    lines = re.findall(r"python -m profiling ([\w|]+) ", readme)
    listed = {c for line in lines for c in line.split("|")}
    missing += [f"python -m profiling {c}" for c in sorted(set(commands) - listed)]
    assert not missing, f"README.md does not name: {missing}"
