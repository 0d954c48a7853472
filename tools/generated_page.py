"""A hand-written docs page with one generated block between two markers, and the command line
that rewrites the block (or, with --check, fails when it is stale). Used by tools/openapi_doc.py
and tools/config_doc.py."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GeneratedPage:
    doc: Path
    """The page (its default location in the repository)."""
    regenerate: str
    """The command that rewrites the block, named in the markers and in --check's message."""
    what: str
    """What the block is generated from, for --check's message ("the app's routes")."""
    label: str
    """The block's name in its markers ("ROUTE REFERENCE")."""

    @property
    def begin(self) -> str:
        return f"<!-- BEGIN GENERATED {self.label}: `{self.regenerate}` writes this part; do not edit it by hand -->"

    @property
    def end(self) -> str:
        return f"<!-- END GENERATED {self.label} -->"

    def splice(self, page: str, reference: str) -> str:
        """`page` with the text between the markers replaced by `reference`."""
        head, sep, rest = page.partition(self.begin)
        _, sep2, tail = rest.partition(self.end)
        if not sep or not sep2:
            raise ValueError(f"the page has no {self.begin!r} ... {self.end!r} block")
        return f"{head}{self.begin}\n\n{reference}\n{self.end}{tail}"

    def main(self, render: Callable[[], str], argv: list[str] | None, description: str) -> int:
        """Write (or with --check, verify) the generated block; the exit status."""
        parser = argparse.ArgumentParser(prog=self.regenerate, description=description)
        parser.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
        parser.add_argument("--doc", type=Path, default=self.doc, help="the page to update (default: %(default)s)")
        args = parser.parse_args(argv)
        page = args.doc.read_text()
        fresh = self.splice(page, render())
        if args.check:
            if fresh != page:
                print(f"{args.doc} is out of date with {self.what}; regenerate it: {self.regenerate}", file=sys.stderr)
                return 1
            return 0
        if fresh != page:
            args.doc.write_text(fresh)
            print(f"updated {args.doc}")
        return 0
