"""Citations stay inside the repository and resolve.

`check_references` reads the repository's text files (code, tests, docs, config, Dockerfile,
.ci/run) and reports:

* a citation of a document outside the repository (the original design card, a reference
  folder next to the checkout, an absolute path of the development machine);
* a cited `docs/<page>.md` that does not exist;
* a cited `docs/<page>.md#<anchor>`, or inside docs/*.md a link `page.md#<anchor>` or
  `(#<anchor>)`, whose anchor the page does not have (an explicit `<a id="...">` or a
  GitHub-style heading slug).

tests/unit/test_docs.py checks the user guide's index and that its links reach existing files and
headings; this module checks citations in every kind of file, and explicit anchors. The patterns
below are built by concatenation so that this module's own source never matches them.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml"}
TEXT_PATHS = {"Dockerfile", ".ci/run"}

CARD = "cites the design card outside the repository; cite docs/design.md#<anchor>"
OUTSIDE = [
    (re.compile(r"\bDESIGN" + r"\.md"), CARD),
    (re.compile(r"\bDESIGN" + r" (§|card)"), CARD),
    (
        re.compile("shared" + "/reference"),
        "cites a reference document outside the repository; move its facts into docs/",
    ),
    (re.compile(r"\.\./" + "shared"), "cites a path outside the repository"),
    (re.compile("/wo" + "rk/"), "cites an absolute path of the development machine"),
]
DOCS_PAGE = re.compile(r"(?<![\w./-])docs/([\w./-]+?\.md)(?:#([\w-]+))?")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)
EXPLICIT_ID = re.compile(r"""\bid=["']([^"']+)["']""")


def text_files(root: Path) -> list[str]:
    """The repository's text files: tracked, and new ones git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    return sorted({p for p in out if (Path(p).suffix in TEXT_SUFFIXES or p in TEXT_PATHS) and (root / p).is_file()})


def anchors(page: Path) -> set[str]:
    """The anchors of a markdown page: explicit ids, and GitHub's heading slugs (lower case,
    punctuation other than '-' and '_' dropped, spaces to '-', -1, -2 ... for repeats)."""
    text = page.read_text()
    found = set(EXPLICIT_ID.findall(text))
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", text)):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def check_references(root: Path, files: Iterable[str]) -> list[str]:
    """One line per problem, `<file>:<line>: <what>`, for the files named relative to `root`."""
    problems: list[str] = []
    cache: dict[Path, set[str] | None] = {}

    def page_anchors(page: Path) -> set[str] | None:
        if page not in cache:
            cache[page] = anchors(page) if page.is_file() else None
        return cache[page]

    def check(where: str, page: Path, shown: str, anchor: str | None) -> None:
        found = page_anchors(page.resolve())
        if found is None:
            problems.append(f"{where}: {shown} does not exist")
        elif anchor and anchor not in found:
            problems.append(f"{where}: {shown} has no anchor #{anchor}")

    for name in files:
        path = root / name
        text = path.read_text(errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            where = f"{name}:{lineno}"
            for pattern, why in OUTSIDE:
                if pattern.search(line):
                    problems.append(f"{where}: {why}: {line.strip()[:120]}")
            for m in DOCS_PAGE.finditer(line):
                check(where, root / "docs" / m.group(1), f"docs/{m.group(1)}", m.group(2))
        if name.startswith("docs/") and path.suffix == ".md":
            body = FENCE.sub(lambda f: "\n" * f.group().count("\n"), text)
            for lineno, line in enumerate(body.splitlines(), 1):
                for target in MD_LINK.findall(line):
                    page, _, anchor = target.partition("#")
                    if not anchor or re.match(r"[a-z]+:", target) or (page and not page.endswith(".md")):
                        continue
                    dest = path.parent / page if page else path
                    check(f"{name}:{lineno}", dest, page or name, anchor)
    return problems


# -- the tree ----------------------------------------------------------------------------------


def test_tree_cites_only_documents_inside_it_and_every_citation_resolves():
    problems = check_references(ROOT, text_files(ROOT))
    assert not problems, "\n".join(problems)


# -- the checker can fail ------------------------------------------------------------------------

DESIGN_PAGE = """# Design

<a id="sync-order"></a>
## Sync order: stop, update, start

## Stop off the critical path

```bash
# not a heading
```
"""


def tree(tmp_path: Path, files: dict[str, str]) -> list[str]:
    """Write `files` (plus docs/design.md) under tmp_path and check them all."""
    files = {"docs/design.md": DESIGN_PAGE, **files}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return check_references(tmp_path, sorted(files))


def test_checker_reports_citations_of_documents_outside_the_repository(tmp_path):
    lines = [
        "see " + "DESIGN" + ".md §2",
        "as " + "DESIGN" + " §4 says",
        "the " + "DESIGN" + " card",
        "facts in " + "/wo" + "rk/" + "shared/" + "reference/engine_apis.md",
        "facts in " + "shared/" + "reference/torch_profiler_facts.md",
        "see " + "../" + "shared/notes.md",
    ]
    problems = tree(tmp_path, {"pkg/mod.py": '"""' + "\n".join(lines) + '"""\n'})
    flagged = {int(p.split(":")[1]) for p in problems}
    assert flagged == {1, 2, 3, 4, 5, 6}, problems


def test_checker_reports_a_cited_page_that_does_not_exist(tmp_path):
    missing = "docs/" + "sglang_notes.md"
    problems = tree(
        tmp_path,
        {"pkg/mod.py": f"# see {missing} for the sources\n", "README.md": f"[notes]({missing}#sources)\n"},
    )
    assert problems == [
        f"README.md:1: {missing} does not exist",
        f"pkg/mod.py:1: {missing} does not exist",
    ], problems


def test_checker_reports_an_anchor_the_page_does_not_have(tmp_path):
    other = "docs/" + "other.md"
    problems = tree(
        tmp_path,
        {
            "tests/test_x.py": '"""Exact attribution (docs/design.md' + '#step-semantic)."""\n',
            other: "# Other\n\nSee [design](design.md" + "#no-such-section) and [here](" + "#nowhere).\n",
        },
    )
    assert sorted(problems) == [
        f"{other}:3: design.md has no anchor #no-such-section",
        f"{other}:3: {other} has no anchor #nowhere",
        "tests/test_x.py:1: docs/design.md has no anchor #step-semantic",
    ], problems


def test_checker_accepts_explicit_ids_and_heading_slugs(tmp_path):
    problems = tree(
        tmp_path,
        {
            "pkg/mod.py": "# docs/design.md#sync-order, docs/design.md" + "#stop-off-the-critical-path\n",
            "docs/" + "other.md": "# Other\n\n## A `code` heading!\n\n"
            "[a](design.md#sync-order-stop-update-start) [b](#a-code-heading) [c](#other)\n"
            "```\n[in a fence](#nowhere)\n```\n",
        },
    )
    assert problems == []
    assert "not-a-heading" not in anchors(tmp_path / "docs" / "design.md")
