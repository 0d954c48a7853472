"""Installs pip into the running interpreter's venv from the package index, for a venv made with
`--without-pip` where Debian/Ubuntu's ensurepip (python3-venv) is not installed (tools/setup.sh).

Standard library only: pip is what is missing. The index is PIP_INDEX_URL's, else PyPI's; the
wheel's sha256 from the index is checked before it runs."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

INDEX = (os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple").rstrip("/")


class _Links(HTMLParser):
    """The href of every anchor of a PEP 503 project page."""

    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def _wheels(page_url: str) -> list[tuple[str, str, str]]:
    """(filename, url, sha256) of pip's py3 wheels on the index's project page."""
    req = urllib.request.Request(page_url, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        body = resp.read()
        is_json = "json" in resp.headers.get("Content-Type", "")
    found = []
    if is_json:
        for f in json.loads(body)["files"]:
            if "sha256" in f.get("hashes", {}):
                found.append((f["filename"], urllib.parse.urljoin(page_url, f["url"]), f["hashes"]["sha256"]))
    else:
        links = _Links()
        links.feed(body.decode())
        for href in links.hrefs:
            url, _, fragment = urllib.parse.urljoin(page_url, href).partition("#sha256=")
            if fragment:
                found.append((url.rsplit("/", 1)[-1], url, fragment))
    return [w for w in found if w[0].endswith("-py3-none-any.whl")]


def _newest(wheels: list[tuple[str, str, str]]) -> tuple[str, str, str]:
    def version(filename: str) -> tuple[int, ...]:
        return tuple(int(p) if p.isdigit() else -1 for p in filename.split("-")[1].split("."))

    return max(wheels, key=lambda w: version(w[0]))


def main() -> None:
    page = f"{INDEX}/pip/"
    try:
        wheels = _wheels(page)
    except OSError as e:
        sys.exit(f"bootstrap_pip: cannot read {page} ({e}); set PIP_INDEX_URL to a reachable index, "
                 "or install Debian/Ubuntu's python3-venv and run tools/setup.sh again")
    if not wheels:
        sys.exit(f"bootstrap_pip: {page} lists no pip wheel with a sha256")
    name, url, sha256 = _newest(wheels)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = Path(tmp) / name
        with urllib.request.urlopen(url, timeout=120) as resp:
            wheel.write_bytes(resp.read())
        if hashlib.sha256(wheel.read_bytes()).hexdigest() != sha256:
            sys.exit(f"bootstrap_pip: {name} does not match the index's sha256; not installed")
        # A wheel is importable: pip installs itself from its own wheel.
        subprocess.run([sys.executable, f"{wheel}/pip", "install", "--no-index", str(wheel)], check=True)


if __name__ == "__main__":
    main()
