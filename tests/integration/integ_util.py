"""Shared helpers of the integration tests: HTTP clients, polling, concurrent generation, traces.

Not a conftest (the root tests/conftest.py is imported as the module `conftest`, and a second
conftest without a package would shadow it); test modules import from here directly.
"""

from __future__ import annotations

import gzip
import json
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import httpx

T = TypeVar("T")

HTTP_TIMEOUT_S = 60.0
MARKER = re.compile(r"^forward_step#(\d+) step=(\d+) weight_version=(\d+)$")
PROMPTS = [
    "The rollout server answers prompts",
    "A weight update publishes a new parameter version",
    "Red green blue yellow",
    "One two three four five",
    "The quick brown fox jumps",
    "Questions and answers, prompts and completions",
]


def client(base_url: str, token: str | None = None, timeout: float = HTTP_TIMEOUT_S) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=base_url, timeout=timeout, headers=headers)


def poll(fn: Callable[[], T], *, timeout: float, what: str, interval: float = 0.2) -> T:
    """Call `fn` until it returns something truthy; fail naming `what` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = fn()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


def ok(resp: httpx.Response, status: int = 200) -> dict:
    assert resp.status_code == status, f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text}"
    return resp.json()


def complete(c: httpx.Client, prompt: Any = "Hello", **body: Any) -> dict:
    return ok(c.post("/v1/completions", json={"prompt": prompt, **body}))


def complete_concurrently(c: httpx.Client, n: int = 6, max_tokens: int = 8, **body: Any) -> list[dict]:
    """`n` completions in flight at once (so the load balancer spreads them over replicas)."""
    with ThreadPoolExecutor(n) as pool:
        futures = [
            pool.submit(complete, c, PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, **body) for i in range(n)
        ]
        return [f.result() for f in futures]


def status(c: httpx.Client) -> dict:
    return ok(c.get("/profile/status"))


def generate_until_all_recorded(c: httpx.Client, replicas: int, *, timeout: float = 60.0) -> list[dict]:
    """Generate concurrently until every replica's active session counted a forward step."""
    results: list[dict] = []

    def recorded() -> bool:
        results.extend(complete_concurrently(c))
        st = status(c)
        live = [r for r in st["replicas"] if r["ok"]]
        return len(live) >= replicas and all((r["forward_steps"] or 0) > 0 for r in live)

    poll(recorded, timeout=timeout, what=f"{replicas} replicas to record forward steps", interval=0.0)
    return results


def stop_if_active(c: httpx.Client) -> None:
    """Leave the app idle and admitting (for `finally` blocks)."""
    st = status(c)
    if st["active_step"] is not None:
        ok(c.post("/profile/stop", json={"step": st["active_step"]}))


def wait_manifest(c: httpx.Client, step: int, statuses: tuple[str, ...], timeout: float = 60.0) -> dict:
    def done() -> dict | None:
        r = c.get(f"/profile/steps/{step}")
        if r.status_code != 200:
            return None
        m = r.json()
        return m if m["status"] in statuses else None

    return poll(done, timeout=timeout, what=f"step {step} manifest status in {statuses}")


def read_trace(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def forward_markers(trace: dict) -> list[tuple[int, int, int]]:
    """(index, step, weight_version) of every forward_step range in a Chrome trace."""
    found = []
    for ev in trace.get("traceEvents", []):
        m = MARKER.match(str(ev.get("name", "")))
        if m and ev.get("ph") == "X":
            found.append(tuple(int(g) for g in m.groups()))
    return found


def check_entry_traces(step_dir: Path, entry: dict, step: int) -> list[tuple[int, int, int]]:
    """Every file of a rollout entry exists, is a gzip Chrome trace, and its forward_step markers
    match the entry (count == forward_steps, all labelled with this step and its weight_version)."""
    assert entry["files"], entry
    markers: list[tuple[int, int, int]] = []
    for rel in entry["files"]:
        path = step_dir / rel
        assert path.is_file(), f"{path} listed in the manifest but missing"
        markers += forward_markers(read_trace(path))
    assert len(markers) == entry["forward_steps"], (len(markers), entry)
    assert sorted(i for i, _, _ in markers) == list(range(entry["forward_steps"]))
    assert {s for _, s, _ in markers} <= {step}
    assert {v for _, _, v in markers} <= {entry["weight_version"]}, (markers[:3], entry)
    return markers
