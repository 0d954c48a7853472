"""`python -m profiling`: commands, JSON output and exit codes (typer's CliRunner), and the
app commands against a small fake of the app's profiling routes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from typer.testing import CliRunner

from profiling.cli import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    app,
)
from profiling.store import MERGED_TRACE
from trainer.app_commands import TOKEN_ENV

from .synth import Proc, forward, write_step

MS = 1_000_000
runner = CliRunner()


def procs(step: int) -> list[Proc]:
    return [
        Proc(
            "rollout",
            r,
            os_pid=10 + i,
            events=[
                e for k in range(3) for e in forward(k, step, step - 1, (k + 1) * MS, 300.0, [("aten::mm", 100.0)])
            ],
            window=(0, 10 * MS),
            weight_version=step - 1,
        )
        for i, r in enumerate(("r0", "r1"))
    ]


@pytest.fixture
def saved(store):
    for k in (1, 2):
        write_step(store, k, procs(k))
    return store


def run(*args: str, env: dict | None = None):
    return runner.invoke(app, list(args), env=env)


def test_list_summarize_merge_diff_report(saved):
    root = str(saved.root)
    res = run("list", root, "--json")
    assert res.exit_code == EXIT_OK, res.output
    rows = json.loads(res.stdout)
    assert [(r["step"], r["status"], r["rollout"], r["merged"]) for r in rows] == [
        (1, "complete", 2, None),
        (2, "complete", 2, None),
    ]

    res = run("merge", root, "--step", "1", "--json")
    assert res.exit_code == EXIT_OK, res.output
    [record] = json.loads(res.stdout)
    assert record["status"] == "ok" and record["events"] > 0
    assert (saved.step_dir(1) / MERGED_TRACE).is_file() and not (saved.step_dir(2) / MERGED_TRACE).exists()

    res = run("merge", root)  # every step, human output
    assert res.exit_code == EXIT_OK, res.output
    assert "step 2:" in res.stdout and "merged.trace.json.gz" in res.stdout and "clock_sync" in res.stdout

    res = run("summarize", root, "--step", "2", "--json")
    assert res.exit_code == EXIT_OK, res.output
    [summary] = json.loads(res.stdout)
    assert summary["step"] == 2 and [p["forward_steps"] for p in summary["processes"]] == [3, 3]
    res = run("summarize", root)
    assert res.exit_code == EXIT_OK and "aten::mm" in res.stdout and "start spread" in res.stdout

    res = run("diff", root, "--step", "1", "--step", "2", "--json")
    assert res.exit_code == EXIT_OK, res.output
    d = json.loads(res.stdout)
    assert (d["a"], d["b"]) == (1, 2) and d["phases"] and d["ops"]
    res = run("diff", root, "--step", "1", "--step", "2")
    assert res.exit_code == EXIT_OK and "forward step, mean" in res.stdout

    res = run("report", root)
    assert res.exit_code == EXIT_OK, res.output
    assert (saved.root / "index.html").is_file() and (saved.step_dir(1) / "report.html").is_file()
    assert f"index: {saved.root / 'index.html'}" in res.stdout

    rows = json.loads(run("list", root, "--json").stdout)
    assert all(r["merged"] == "ok" and r["report"] for r in rows)


@pytest.mark.parametrize(
    "args, message",
    [
        (["merge", "{missing}"], "is not a directory"),
        (["merge", "{empty}"], "no step_<k> directories under"),
        (["merge", "{root}", "--step", "9"], "no step_9 under"),
        (["summarize", "{root}", "--step", "9"], "no step_9 under"),
        (["diff", "{root}", "--step", "1"], "exactly two steps"),
        (["diff", "{root}", "--step", "1", "--step", "1"], "two different steps"),
        (["report", "{empty}"], "no step_<k> directories under"),
        (["list", "{missing}"], "is not a directory"),
    ],
)
def test_bad_usage_exits_2_with_a_message(saved, tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    paths = {"missing": str(tmp_path / "nope"), "empty": str(tmp_path / "empty"), "root": str(saved.root)}
    res = run(*[a.format(**paths) for a in args])
    assert res.exit_code == EXIT_USAGE, res.output
    assert message in res.stderr and res.stderr.startswith("error: ")


def test_unknown_option_exits_2(saved):
    assert run("merge", str(saved.root), "--no-such-option").exit_code == EXIT_USAGE


def test_list_of_an_empty_save_path_is_empty(tmp_path):
    res = run("list", str(tmp_path), "--json")
    assert res.exit_code == EXIT_OK and json.loads(res.stdout) == []


def test_failed_merge_exits_1_and_names_the_cause(saved):
    (saved.step_dir(2) / MERGED_TRACE).mkdir()
    res = run("merge", str(saved.root))
    assert res.exit_code == EXIT_FAILED
    assert "merging step 2 failed" in res.stderr and "IsADirectoryError" in res.stderr
    assert (saved.step_dir(1) / MERGED_TRACE).is_file()  # the other step still merged


def test_module_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "profiling", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "merge" in proc.stdout and "Exit codes" in proc.stdout


# -- the app commands --------------------------------------------------------------------------


class FakeApp(BaseHTTPRequestHandler):
    """/profile/status, /profile/start, /profile/stop with a control token 's3cret'; replica r1
    fails starts of step 13."""

    def log_message(self, *args):  # keep test output clean
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") != "Bearer s3cret":
            self._send(401, {"detail": "missing or wrong control token"})
            return False
        return True

    def do_GET(self):
        if self.path == "/profile/status" and self._authorized():
            self._send(
                200,
                {
                    "state": "idle",
                    "active_step": None,
                    "steps": [],
                    "weight_version": 3,
                    "paused": False,
                    "replicas": [{"replica_id": "r0", "ok": True, "state": "idle", "weight_version": 3}],
                    "control_timeout_s": 30.0,
                },
            )

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if not self._authorized():
            return
        if self.path == "/profile/start":
            if body["step"] == 12:
                self._send(409, {"detail": "step 11 is being profiled; stop it before starting step 12"})
                return
            r1_ok = body["step"] != 13
            self._send(
                200,
                {
                    "step": body["step"],
                    "steps": [body["step"]],
                    "state": "profiling",
                    "replicas": [
                        {
                            "replica_id": "r0",
                            "ok": True,
                            "state": "profiling",
                            "active_step": body["step"],
                            "weight_version": 3,
                        },
                        {
                            "replica_id": "r1",
                            "ok": r1_ok,
                            "error": None if r1_ok else "start failed: boom",
                            "weight_version": 3,
                        },
                    ],
                },
            )
        elif self.path == "/profile/stop":
            self._send(
                200,
                {
                    "step": body["step"],
                    "stopped": True,
                    "manifest": f"/x/step_{body['step']}/manifest.json",
                    "replicas": [{"replica_id": "r0", "ok": True, "files": ["a"], "forward_steps": 5}],
                },
            )


@pytest.fixture
def fake_app() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeApp)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_app_commands(fake_app):
    token = {TOKEN_ENV: "s3cret"}
    res = run("status", "--url", fake_app, "--json", env=token)
    assert res.exit_code == EXIT_OK, res.output
    assert json.loads(res.stdout)["weight_version"] == 3
    res = run("start", "--url", fake_app, "--step", "4", "--token", "s3cret")
    assert res.exit_code == EXIT_OK, res.output
    assert "profiling" in res.stdout
    res = run("stop", "--url", fake_app, "--step", "4", env=token)
    assert res.exit_code == EXIT_OK and "manifest: /x/step_4/manifest.json" in res.stdout


def test_the_cli_reads_the_token_under_the_apps_name_and_the_old_one_with_a_warning(fake_app):
    assert TOKEN_ENV == "ROLLOUT_PROFILER_CONTROL_TOKEN"  # the image's and config/serve.vllm-gpu.yaml's
    res = run("status", "--url", fake_app, "--json", env={TOKEN_ENV: "s3cret"})
    assert res.exit_code == EXIT_OK and "deprecated" not in res.stderr, res.output
    res = run("status", "--url", fake_app, "--json", env={"ROLLOUT_CONTROL_TOKEN": "s3cret"})
    assert res.exit_code == EXIT_OK, res.output
    assert "ROLLOUT_CONTROL_TOKEN is deprecated" in res.stderr and TOKEN_ENV in res.stderr, res.stderr


def test_app_command_exit_codes(fake_app):
    res = run("status", "--url", fake_app)
    assert res.exit_code == EXIT_FAILED and "401" in res.stderr and TOKEN_ENV in res.stderr
    res = run("start", "--url", fake_app, "--step", "12", "--token", "s3cret")
    assert res.exit_code == EXIT_FAILED and "409" in res.stderr and "step 11 is being profiled" in res.stderr
    res = run("start", "--url", fake_app, "--step", "13", "--token", "s3cret", "--json")
    assert res.exit_code == EXIT_FAILED and "r1" in res.stderr
    assert json.loads(res.stdout)["replicas"][1]["error"] == "start failed: boom"  # still printed for scripts
    res = run("status", "--url", "http://127.0.0.1:9", "--timeout", "5")
    assert res.exit_code == EXIT_UNREACHABLE and "cannot reach the app" in res.stderr
    assert run("start", "--url", fake_app, "--step", "0").exit_code == EXIT_USAGE


def test_a_capped_window_says_what_it_kept_in_summarize_and_the_report(saved):
    [capped] = [e for e in saved.read_entries(1) if e.replica_id == "r0"]
    saved.write_entry(
        1, capped.model_copy(update={"auto_stopped": "max_forward_steps", "forward_steps_in_window": 3412})
    )
    saved.refresh_manifest(1)
    said = "kept 3 of 3,412 forward steps: max_forward_steps stopped the recording"
    r = run("summarize", str(saved.root), "--step", "1")
    assert r.exit_code == EXIT_OK, r.output
    assert f"rollout/r0: {said}" in r.output.replace("\n", " ") and "rollout/r1:" not in r.output
    by_key = {
        p["key"]: p
        for p in json.loads(run("summarize", str(saved.root), "--step", "1", "--json").output)[0]["processes"]
    }
    assert by_key["rollout/r0"]["kept"].startswith(said) and by_key["rollout/r1"]["kept"] is None
    assert run("report", str(saved.root)).exit_code == EXIT_OK
    html = (saved.step_dir(1) / "report.html").read_text()
    assert f"<b>rollout/r0</b>: {said}" in html and "<b>rollout/r1</b>" not in html
