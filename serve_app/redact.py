"""Absolute server paths out of what the app answers: error texts name the directory by its
config key (`<save_path>/step_3/...`) and any other absolute path by its last component only.
The full text goes to the log."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serve_app.config import AppArgs

# An absolute path of two or more components, not part of a URL or of a longer word.
_ABSOLUTE = re.compile(r"(?<![\w.:/<>~-])/(?:[^\s/'\"`:,;()\[\]<>]+/)+[^\s/'\"`:,;()\[\]<>]*")
ROUTES = ("/weights/update", "/profile/", "/v1/", "/inference/v1/generate")
"""The app's own routes that look like paths: an answer that names one (as the way out) keeps it."""


class Redactor:
    def __init__(self, roots: Mapping[str, str | None]):
        """`roots`: config key -> the absolute directory it names (None: not set)."""
        self._roots = sorted(((path.rstrip("/"), key) for key, path in roots.items() if path), key=lambda r: -len(r[0]))

    def __call__(self, text: str) -> str:
        for path, key in self._roots:
            text = text.replace(path, f"<{key}>")
        return _ABSOLUTE.sub(_last_component, text)


def _last_component(match: re.Match[str]) -> str:
    path = match.group(0)
    if path.startswith(ROUTES):
        return path
    return "<path>/" + path.rstrip("/").rsplit("/", 1)[-1]


def app_redactor(args: AppArgs) -> Redactor:
    """The redactor of one app: its directories by their config keys."""
    from serve_app.tiny_model import default_cache_dir

    return Redactor(
        {
            "save_path": args.save_path,
            "weights_dir": args.weights_dir,
            "node_dir": args.node_dir,
            "model_path": args.model_path,
            "model_cache": str(default_cache_dir()),
        }
    )
