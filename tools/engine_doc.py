"""Render the capability table of docs/engines.md from the engines' options classes.

    python -m tools.engine_doc            # rewrite the table in docs/engines.md
    python -m tools.engine_doc --check    # exit 1 if it is out of date with the code

One row per capability (`serve_app.engines.options.Capability`), one column per engine of
`serve_app.engines.registry.ENGINE_OPTIONS`: what each engine declares, so the page cannot claim
what the code refuses.
"""

from __future__ import annotations

import sys
from pathlib import Path

from serve_app.engines.options import CAPABILITY_USE, Capability
from serve_app.engines.registry import ENGINE_OPTIONS
from tools.generated_page import GeneratedPage

PAGE = GeneratedPage(
    doc=Path(__file__).resolve().parents[1] / "docs" / "engines.md",
    regenerate="python -m tools.engine_doc",
    what="the engines' declared capabilities",
    label="CAPABILITY TABLE",
)


def render_table() -> str:
    """The engine-by-capability table, in Markdown."""
    engines = list(ENGINE_OPTIONS.values())
    lines = [
        "| capability | lets a caller use | " + " | ".join(f"`{e.engine}`" for e in engines) + " |",
        "|---|---|" + "---|" * len(engines),
    ]
    for capability in Capability:
        marks = " | ".join("yes" if e.has(capability) else "—" for e in engines)
        lines.append(f"| `{capability.value}` | {CAPABILITY_USE[capability]} | {marks} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write (or with --check, verify) the table."""
    return PAGE.main(render_table, argv, __doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
